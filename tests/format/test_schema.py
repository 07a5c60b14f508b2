"""The manifest format: strict decoding with located errors, constraints, plain values, the JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorizer_manifest.checks.validate import validate_checkpoint
from tensorizer_manifest.errors import ManifestError, ManifestVersionError
from tensorizer_manifest.format import schema
from tensorizer_manifest.storage.checkpoint import load_manifest

ROOT = Path(__file__).resolve().parents[2]
V1 = Path(__file__).parents[1] / "fixtures" / "v1-checkpoint"


def test_checked_in_json_schema_matches_the_types():
    on_disk = json.loads((ROOT / "schemas" / f"manifest-v{schema.FORMAT_VERSION}.schema.json").read_text())
    assert on_disk == schema.json_schema(), "run `make schema` and commit schemas/"


def test_the_published_v1_schema_is_the_current_one_without_fallbacks():
    """Version 2 only appended fields (msgspec's rules: ``fallback`` to module records, ``added_forms`` to the
    manifest): v1's schema, as published, is the current one without them, so a version-1 manifest is read by
    both."""
    v1 = json.loads((ROOT / "schemas" / "manifest-v1.schema.json").read_text())
    current = schema.json_schema()
    del current["$defs"]["ModuleRecord"]["properties"]["fallback"]
    del current["$defs"]["Manifest"]["properties"]["added_forms"]
    del current["$defs"]["Manifest"]["properties"]["save_id"]
    del current["$defs"]["AddedForm"]
    assert v1 == current


def _v1_manifest_type() -> type:
    """``schema.Manifest`` as version 1 had it: module records without ``fallback``, no ``added_forms``, unknown
    fields refused."""
    fields = [
        (f.name, f.type, f.default) if f.default is not msgspec.NODEFAULT else (f.name, f.type)
        for f in msgspec.structs.fields(schema.ModuleRecord)
        if f.name != "fallback"
    ]
    v1_module = msgspec.defstruct("ModuleRecordV1", fields, kw_only=True, forbid_unknown_fields=True)
    return msgspec.defstruct(
        "ManifestV1",
        [(f.name, list[v1_module] if f.name == "modules" else f.type) + (() if f.required else (f.default,))
         for f in msgspec.structs.fields(schema.Manifest) if f.name not in ("added_forms", "save_id")],
        kw_only=True,
        forbid_unknown_fields=True,
    )  # fmt: skip


def _with_a_fallback(manifest: schema.Manifest) -> schema.Manifest:
    """A copy whose first processed layer keeps its own tensors' records as a fallback (as if pre-step)."""
    manifest = schema.decode_manifest(schema.encode_manifest(manifest))
    module = next(m for m in manifest.modules if m.tensors)
    module.state, module.replay = "processed", "cpu_unquantized_moe"
    module.fallback = [msgspec.structs.replace(t, key=schema.fallback_name(t.key)) for t in module.tensors]
    return manifest


def test_a_manifest_without_fallbacks_encodes_as_version_1_did():
    """No ``fallback`` key, so 0.3.0 (which refuses unknown fields) reads it, and older seals hold (the 0.2.0
    fixtures' test below checks their bytes)."""
    manifest = schema.decode_manifest((V1 / "model.manifest.json").read_bytes())
    assert schema.required_format_version(manifest) == 1
    assert b"fallback" not in schema.encode_manifest(manifest)
    assert b"fallback" not in schema.canonical_bytes(manifest, "digest")
    v1_reader = msgspec.json.Decoder(_v1_manifest_type())
    assert v1_reader.decode(schema.encode_manifest(manifest))  # a reader without the field: no unknown field


def test_fallbacks_need_version_2_and_are_encoded_and_sealed():
    manifest = _with_a_fallback(_tiny_manifest())
    assert schema.required_format_version(manifest) == schema.FALLBACKS_FORMAT_VERSION == 2
    again = schema.decode_manifest(schema.encode_manifest(manifest))
    assert again.modules == manifest.modules
    before = schema.seal_hash(manifest, "digest")
    manifest.modules[next(i for i, m in enumerate(manifest.modules) if m.fallback)].fallback[0].nbytes += 1
    assert schema.seal_hash(manifest, "digest") != before
    names = [name for name, _ in manifest.fallback_records()]
    assert names and all(name.startswith(schema.FALLBACK_PREFIX) for name in names)
    assert manifest.ordered_records()[-len(names) :] == manifest.fallback_records()


def test_a_string_that_looks_like_an_empty_fallback_is_kept():
    """Only the field is left out: inside a JSON string every quote is escaped, so the bytes differ."""
    manifest = _tiny_manifest()
    manifest.producer = 'x,"fallback":[]}'
    assert schema.decode_manifest(schema.encode_manifest(manifest)).producer == manifest.producer


def test_published_schema_carries_the_constraints():
    defs = schema.json_schema()["$defs"]
    record = defs["TensorRecord"]["properties"]
    assert record["hash"]["pattern"] == r"^blake3:[0-9a-f]{64}$"
    assert record["shape"]["items"]["minimum"] == 0
    assert "bfloat16" in record["dtype"]["enum"] and "object" not in record["dtype"]["enum"]


def test_checked_in_v1_checkpoint_still_validates():
    """Written by tensorizer-manifest 0.1.0 (format 1). Never regenerate it: it is the old reader's promise."""
    manifest, _ = load_manifest(V1)
    assert manifest.format_version == 1
    report = validate_checkpoint(V1)
    assert report.ok, report.problems
    assert report.hashes_checked == 5
    assert manifest.seal is None and manifest.tensor_file.prefix_size is None  # written before both existed
    assert [w for w in report.warnings if "not sealed" in w], report.warnings


def test_manifest_from_a_newer_format_is_refused_naming_both_versions():
    with pytest.raises(ManifestVersionError, match=rf"version 7 .* version {schema.FORMAT_VERSION} "):
        schema.decode_manifest(b'{"format_version": 7}')


def test_a_newer_manifest_that_this_version_could_decode_is_refused_all_the_same():
    doc = json.loads((V1 / "model.manifest.json").read_text())
    doc["format_version"] = schema.FORMAT_VERSION + 1  # every field still one this version reads
    with pytest.raises(ManifestVersionError, match=f"version {schema.FORMAT_VERSION + 1} is newer"):
        schema.decode_manifest(json.dumps(doc).encode())


@pytest.mark.parametrize(
    "data, gist",
    [
        (b"", "empty"),
        (b"   \n", "empty"),
        (b"{not json", "not valid JSON"),
        (b"[]", "Expected `object`"),
        (b'{"format_version": 1}', "missing required field"),
        (b'{"format_version": 0}', r">= 1 - at `\$.format_version`"),
    ],
)
def test_bad_manifest_bytes_raise_manifest_error(data, gist):
    with pytest.raises(ManifestError, match=gist):
        schema.decode_manifest(data)


def _v1_doc() -> dict:
    return json.loads((V1 / "model.manifest.json").read_text())


@pytest.mark.parametrize(
    "field, value, gist",
    [
        ("hash", "md5:1234", "matching regex"),
        ("hash", "blake3:" + "A" * 64, "matching regex"),
        ("shape", [-1, 4], ">= 0"),
        ("stride", [4, -1], ">= 0"),
        ("nbytes", -2, ">= 0"),
        ("dtype", "object", "Invalid enum value 'object'"),
    ],
)
def test_record_constraints_are_refused_at_decode_with_their_location(field, value, gist):
    doc = _v1_doc()
    doc["modules"][0]["tensors"][0][field] = value
    with pytest.raises(ManifestError, match=gist) as info:
        schema.decode_manifest(json.dumps(doc).encode())
    assert f"$.modules[0].tensors[0].{field}" in str(info.value)
    assert "re-save" in str(info.value)


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, (True, None)),
        (3, (True, 3)),
        (True, (True, True)),
        ("column", (True, "column")),
        ((1, 2), (True, [1, 2])),
        (["gate", "up"], (True, ["gate", "up"])),
        ([True, 1, 2.5, "x"], (True, [True, 1, 2.5, "x"])),
        ([[1, 2]], (False, None)),
        ({"a": 1}, (False, None)),
        (print, (False, None)),
    ],
)
def test_plain_value_is_the_one_definition(value, expected):
    assert schema.plain_value(value) == expected


def test_every_plain_value_survives_a_manifest_round_trip():
    doc = _v1_doc()
    attrs = {"names": ["gate_proj", "up_proj"], "flags": [True, False], "mixed": [1, 2.5], "n": 3, "s": "x"}
    doc["modules"][0]["tensors"][0]["param_attrs"] = attrs
    manifest = schema.decode_manifest(json.dumps(doc).encode())
    again = schema.decode_manifest(schema.encode_manifest(manifest))
    assert again.modules[0].tensors[0].param_attrs == attrs


def test_dtype_tables_agree():
    from typing import get_args

    assert set(schema.DTYPE_ITEMSIZE) == set(get_args(schema.DType))


def test_digest_binds_every_records_form():
    manifest = schema.decode_manifest((V1 / "model.manifest.json").read_bytes())
    records = manifest.ordered_records()
    assert schema.digest_records(records) == manifest.tensor_file.digest
    name, record = records[0]
    changed = msgspec.structs.replace(record, stride=[*record.stride[:-1], record.stride[-1] + 1])
    assert schema.digest_records([(name, changed), *records[1:]]) != manifest.tensor_file.digest


def test_full_name_and_qualified_class():
    assert schema.full_name("", "weight") == "weight"
    assert schema.full_name("model.norm", "weight") == "model.norm.weight"
    assert schema.qualified_class(ValueError) == "builtins.ValueError"
    assert schema.qualified_class(Path("x")).startswith("pathlib.")


def _tiny_manifest() -> schema.Manifest:
    data = (V1 / "model.manifest.json").read_bytes()
    return schema.decode_manifest(data)


def test_the_seal_covers_the_canonical_encoding_and_its_mode():
    manifest = _tiny_manifest()
    digest = schema.seal_manifest(manifest)
    assert digest.mode == "digest" and digest.hash == schema.seal_hash(manifest, "digest")
    manifest.seal = digest  # the seal itself is not part of what it covers
    assert schema.seal_hash(manifest, "digest") == digest.hash
    again = schema.decode_manifest(schema.encode_manifest(manifest))
    assert schema.seal_hash(again, "digest") == digest.hash  # encode/decode keeps the canonical bytes
    assert schema.canonical_bytes(again, "digest") == schema.canonical_bytes(manifest, "digest")
    key = schema.SigningKey(b"0123456789abcdef")
    mac = schema.seal_manifest(manifest, key)
    other = schema.seal_manifest(manifest, schema.SigningKey(b"0123456789abcdeF"))
    assert mac.mode == "mac" and mac.hash not in (digest.hash, other.hash)
    manifest.modules[0].kernels = [schema.KernelRecord(owner="layer", attr="x", kernel_class="y.Z")]
    assert schema.seal_hash(manifest, "digest") != digest.hash


def test_a_signing_key_is_never_shown_or_pickled_and_not_too_short():
    import pickle

    from tensorizer_manifest.errors import ConfigurationError

    key = schema.SigningKey(b"secret-secret-secret")
    assert "secret" not in repr(key) and "secret" not in str(key)
    with pytest.raises(TypeError):
        pickle.dumps(key)
    with pytest.raises(ConfigurationError, match="at least 16"):
        schema.SigningKey(b"short")
    long = schema.SigningKey(b"x" * 100_000)  # any length works: the MAC key is derived from it
    assert long.mac(b"data").startswith("blake3:")


FIXTURES = Path(__file__).parents[1] / "fixtures"
#: The signing key of the checked-in mac fixture (a test key, published on purpose).
FIXTURE_SIGNING_KEY = b"tensorizer-manifest test key 0.2"


@pytest.mark.parametrize("mode", ["digest", "mac"])
def test_seals_made_by_0_2_0_still_match(mode):
    """Written while 0.3.0 was developed (their producer still says 0.2.0), before ``tensor_file.encryption``
    existed. Never regenerate them: a field added after the seal is left out of its bytes while it holds its
    default."""
    manifest = schema.decode_manifest((FIXTURES / f"sealed-0.2.0-{mode}.manifest.json").read_bytes())
    assert manifest.producer == "tensorizer-manifest 0.2.0" and manifest.tensor_file.encryption == "none"
    key = schema.SigningKey(FIXTURE_SIGNING_KEY) if mode == "mac" else None
    assert schema.seal_hash(manifest, mode, key) == manifest.seal.hash
    assert b'"encryption"' not in schema.canonical_bytes(manifest, mode)


def test_encryption_is_sealed_once_set_and_its_seal_is_keyed_from_the_encryption_key():
    manifest = _tiny_manifest()
    plain = schema.canonical_bytes(manifest, "digest")
    manifest.tensor_file.encryption = schema.ENCRYPTION_TENSORIZER
    assert schema.canonical_bytes(manifest, "digest") != plain
    assert f'"encryption":"{schema.ENCRYPTION_TENSORIZER}"'.encode() in schema.canonical_bytes(manifest, "digest")
    key = schema.EncryptionKey(b"e" * 32)
    seal = schema.seal_manifest(manifest, encryption_key=key)
    assert seal.mode == "mac-encryption-key"
    assert seal.hash == schema.seal_hash(manifest, "mac-encryption-key", encryption_key=key)
    assert seal.hash != schema.seal_hash(manifest, "mac-encryption-key", encryption_key=schema.EncryptionKey(b"f" * 32))
    # the same bytes as a signing key make another seal: the contexts differ
    assert seal.hash != schema.SigningKey(b"e" * 32).mac(schema.canonical_bytes(manifest, "mac-encryption-key"))
    assert schema.seal_manifest(manifest, schema.SigningKey(b"s" * 32), key).mode == "mac"  # a signing key wins
    from tensorizer_manifest.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="needs the encryption key"):
        schema.seal_hash(manifest, "mac-encryption-key")


def test_an_encryption_key_is_never_shown_or_pickled_and_its_derived_keys_differ():
    import pickle

    import blake3

    from tensorizer_manifest.errors import ConfigurationError

    material = b"secret-secret-secret-secret-1234"
    key = schema.EncryptionKey(material)
    assert "secret" not in repr(key) and "secret" not in str(key)
    with pytest.raises(TypeError):
        pickle.dumps(key)
    with pytest.raises(ConfigurationError, match="encryption key has 5 bytes"):
        schema.EncryptionKey(b"short")
    tensorizer_key = key.tensorizer_key()
    assert len(tensorizer_key) == 32 and tensorizer_key != material
    # documented, so that tensorizer alone can decrypt: blake3 derive_key with this context
    context = "tensorizer-manifest 2025 tensorizer encryption key v1"
    assert tensorizer_key == blake3.blake3(material, derive_key_context=context).digest()


def test_the_checked_in_v2_checkpoint_still_reads_and_validates():
    """Written by 0.4.0.dev0 with a raw fallback and an added form; never regenerate it: later versions must
    keep reading it (and its seal must keep matching) as this one does."""
    directory = Path(__file__).parents[1] / "fixtures" / "v2-checkpoint"
    manifest, _ = load_manifest(directory)
    assert manifest.format_version == 2 and manifest.producer == "tensorizer-manifest 0.4.0.dev0"
    assert sum(1 for m in manifest.modules if m.fallback) == 1 and len(manifest.added_forms) == 1
    report = validate_checkpoint(directory)
    assert report.ok, report.problems
    assert report.hashes_checked == report.stored == manifest.tensor_file.tensor_count + 1
    # its form records no base (forms gained it later): loaders skip it, and validate says so
    assert manifest.added_forms[0].base is None
    assert [w for w in report.warnings if "does not record the raw fallbacks" in w and "loaders skip it" in w]


def test_the_checked_in_v3_checkpoint_with_a_base_still_reads_and_validates():
    """Written by 0.5.0.dev0 with vLLM 0.32.0 (a one-layer Llama in bf16, ``save --base inside``: one generation,
    the TP=1 form set and the base); never regenerate it: later versions must keep reading it, its base included,
    as this one does."""
    from tensorizer_manifest.storage.checkpoint import load_base, load_generation

    directory = Path(__file__).parents[1] / "fixtures" / "v3-checkpoint"
    generation, _ = load_generation(directory)
    assert generation.made_by == "save" and generation.parent is None
    assert [(s.layout.tp, s.layout.pp, s.fingerprint.vllm_version) for s in generation.form_sets] == [(1, 1, "0.32.0")]
    base, _, _ = load_base(directory, generation)
    assert generation.base.mode == "inside" and base.observed.tp == 1
    assert len(base.tensors) == 12 and base.consumers["model.embed_tokens.weight"] == ["model.embed_tokens"]
    manifest, _ = load_manifest(directory)
    assert manifest.producer == "tensorizer-manifest 0.5.0.dev0"
    stub = json.loads((directory / "model.manifest.json").read_text())  # what readers of 0.4 and older meet
    assert stub == {"format_version": 3, "pointer": "tensorizer-manifest.json"}
    report = validate_checkpoint(directory)
    assert report.ok, report.problems
    assert report.hashes_checked == report.stored == manifest.tensor_file.tensor_count + len(base.tensors)


def test_the_checked_in_v3_checkpoint_whose_form_set_leaves_layers_to_the_base_still_reads_and_validates():
    """Written by 0.5.0.dev0 of 2026-12-04 with vLLM 0.32.0 on AVX-512 (the same one-layer Llama, saved with the
    default base): its form set stores only what vLLM's step changed, the other layers' records held by the base
    (no key). Never regenerate it. Its records pass the checks beside its base, and only there."""
    from tensorizer_manifest.checks.records import check_manifest
    from tensorizer_manifest.format.schema import fed_from_base, held_by_base
    from tensorizer_manifest.storage.checkpoint import load_base, load_generation

    directory = Path(__file__).parents[1] / "fixtures" / "v3-checkpoint-fed"
    generation, _ = load_generation(directory)
    base, _, _ = load_base(directory, generation)
    manifest, manifest_path = load_manifest(directory)
    fed = [m.path for m in manifest.modules if fed_from_base(m.tensors)]
    assert "model.layers.0.self_attn.qkv_proj" in fed and "model.embed_tokens" in fed and len(fed) == 9
    held = [t for m in manifest.modules for t in m.tensors if held_by_base(t)]
    stored = [t for m in manifest.modules for t in m.tensors if t.key is not None]
    assert manifest.tensor_file.tensor_count == len(stored) and held
    report = validate_checkpoint(directory)
    assert report.ok, report.problems
    assert report.hashes_checked == report.stored == len(stored) + len(base.tensors)
    problems, _ = check_manifest(manifest, manifest_path)  # as if its generation had no base
    assert problems and all("no tensor file key" in p.message for p in problems)


_NAMES_THE_ENCODER_LEAVES_OUT = st.sampled_from(["fallback", "added_forms", "save_id", "input_dim", "base"])
_PLAIN = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.just([]),
    st.just("fallback"),
    st.lists(st.integers(0, 3), max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(
    attrs=st.dictionaries(_NAMES_THE_ENCODER_LEAVES_OUT, _PLAIN, max_size=4),
    form=st.dictionaries(_NAMES_THE_ENCODER_LEAVES_OUT, _PLAIN, max_size=4),
)
def test_a_dict_holding_the_names_of_fields_left_out_round_trips_exactly(attrs, form):
    """``"fallback": []`` (or ``"added_forms": []``, ``"save_id": null``) as a key and value of a record's own
    dicts is data, kept, wherever it sits in the dict; only the struct fields themselves are left out."""
    manifest = _tiny_manifest()
    module = manifest.modules[0]
    module.form = form
    module.tensors[0].param_attrs = attrs
    again = schema.decode_manifest(schema.encode_manifest(manifest))
    assert again.modules[0].form == form and again.modules[0].tensors[0].param_attrs == attrs
    assert again == manifest
    assert schema.seal_hash(again, "digest") == schema.seal_hash(manifest, "digest")
