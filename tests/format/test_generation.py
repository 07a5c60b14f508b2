"""Format version 3's documents: the pointer and the generation. Encoding by msgspec alone, seals pinned by bytes
written here by hand, strict decoding, paths that cannot leave the checkpoint, newer versions refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import blake3
import msgspec
import pytest

from tensorizer_manifest.errors import ManifestError, ManifestVersionError
from tensorizer_manifest.format import generation as g
from tensorizer_manifest.format.schema import Fingerprint, SigningKey, TensorFileRef, TensorRecord

ROOT = Path(__file__).resolve().parents[2]
ID1 = "20261203T081500Z-" + "1" * 32
ID2 = "20261203T091500Z-" + "2" * 32
HASH = "blake3:" + "a" * 64


def _generation(**fields) -> g.Generation:
    base = dict(format_version=3, id=ID2, parent=ID1, producer="tensorizer-manifest test", made_by="save")
    return g.Generation(**{**base, **fields})


def test_the_seal_covers_these_bytes_exactly():
    """The canonical bytes are written out here by hand from the rules (fields in declaration order, a field at
    its default left out, the seal left out), so any change of encoding shows as a failure of this test."""
    generation = _generation(
        model_files=[
            g.ModelFile(name="config.json", file=g.FileRef(path=f"generations/{ID2}/config.json", size=7, hash=HASH))
        ]
    )
    expected = (
        b"tensorizer-manifest seal v3 digest\n"
        b'{"format_version":3,"id":"' + ID2.encode() + b'","parent":"' + ID1.encode() + b'",'
        b'"producer":"tensorizer-manifest test","made_by":"save",'
        b'"model_files":[{"name":"config.json","file":{"path":"generations/' + ID2.encode() + b'/config.json",'
        b'"size":7,"hash":"' + HASH.encode() + b'"}}]}'
    )
    assert g.canonical_generation_bytes(generation, "digest") == expected
    sealed = g.seal_generation(generation)
    assert sealed.seal.mode == "digest"
    assert sealed.seal.hash == "blake3:" + blake3.blake3(expected).hexdigest()


def test_a_keyed_seal_depends_on_the_key_and_on_every_field():
    key, other = SigningKey(b"k" * 32), SigningKey(b"o" * 32)
    sealed = g.seal_generation(_generation(), key)
    assert sealed.seal.mode == "mac"
    assert sealed.seal.hash == g.generation_seal_hash(_generation(), "mac", key)
    assert sealed.seal.hash != g.generation_seal_hash(_generation(), "mac", other)
    assert sealed.seal.hash != g.generation_seal_hash(_generation(made_by="add-form"), "mac", key)
    assert sealed.seal.hash != g.generation_seal_hash(_generation(), "digest")


def test_defaults_are_left_out_and_come_back():
    generation = _generation(parent=None)
    data = g.encode_generation(generation)
    as_json = json.loads(data)
    assert set(as_json) == {"format_version", "id", "producer", "made_by"}  # parent None, empty lists, base none
    assert g.decode_generation(data) == generation
    assert g.decode_generation(data).base is None


def test_a_generation_with_every_part_round_trips():
    fingerprint = Fingerprint(
        vllm_version="0.32.0", torch_version="2.13.0", tensorizer_version="2.10.1", architectures=["LlamaForCausalLM"],
        model_class="vllm.LlamaForCausalLM", dtype="bfloat16", quantization=None, quant_config_hash=None,
        kv_cache_dtype="auto", tensor_parallel_size=2, tensor_parallel_rank=0, pipeline_parallel_size=1,
        pipeline_parallel_rank=0, device_type="cpu",
    )  # fmt: skip
    ref = g.FileRef(path=f"generations/{ID2}/model-tp0-of-2.manifest.json", size=10, hash=HASH)
    base = g.FileRef(path=f"generations/{ID2}/base.manifest.json", size=3, hash=HASH)
    rank = g.RankRef(stem="model-tp0-of-2", manifest=ref)
    generation = _generation(
        base=g.BaseRef(mode="inside", document=base, tensor_files=[f"generations/{ID1}/base.0123.tensors"]),
        form_sets=[g.FormSet(layout=g.Layout(tp=2), fingerprint=fingerprint, ranks=[rank])],
        compile_forms=[
            g.CompileForm(
                machine=["AVX512"], vllm_version="0.32.0", torch_version="2.13.0", config_hash="abc",
                archive=g.FileRef(path=f"generations/{ID2}/compile-avx512.bin", size=5, hash=HASH),
                files=[g.CompileFile(path="inductor/x.py", offset=0, size=5, hash=HASH)],
            )
        ],
    )  # fmt: skip
    decoded = g.decode_generation(g.encode_generation(generation))
    assert decoded == generation
    assert decoded.named_paths() == [
        f"generations/{ID2}/base.manifest.json",
        f"generations/{ID1}/base.0123.tensors",  # kept from the generation that wrote it
        f"generations/{ID2}/model-tp0-of-2.manifest.json",
        f"generations/{ID2}/compile-avx512.bin",
    ]
    assert '"tp":2' in msgspec.json.encode(decoded.form_sets[0].layout).decode()
    assert msgspec.json.encode(g.Layout()) == b"{}"


def test_a_base_document_round_trips_and_names_what_each_module_takes():
    def record(name: str) -> TensorRecord:
        return TensorRecord(name=name, kind="parameter", dtype="bfloat16", shape=[2], stride=[1], nbytes=4,
                            hash=HASH, key=name)  # fmt: skip

    base = g.BaseDocument(
        format_version=3,
        observed=g.Layout(tp=2),
        tensor_file=TensorFileRef(path="base.0123.tensors", size=10, tensor_count=3, digest=HASH),
        tensors=[record("a.q"), record("a.k"), record("rotary.inv_freq")],
        consumers={"a.q": ["a.qkv"], "a.k": ["a.qkv", "b.tied"]},
        loaded={"a.qkv": ["weight"], "b.tied": ["weight"]},
    )
    assert g.decode_base(g.encode_base(base)) == base
    assert [t.name for t in base.needed_by({"b.tied"})] == ["a.k"]
    assert [t.name for t in base.needed_by({"a.qkv", "b.tied", "c"})] == ["a.q", "a.k"]
    assert base.needed_by({"rotary"}) == []
    with pytest.raises(ManifestError, match="base document"):
        g.decode_base(b'{"format_version": 3}')


@pytest.mark.parametrize(
    "path",
    ["../outside", "/etc/passwd", "generations/../../x", ".hidden", "generations/.x/y", "a//b", "", "a/", "a\\b"],
)
def test_no_document_names_a_file_outside_its_checkpoint(path):
    data = msgspec.json.encode({"format_version": 3, "generation": ID1, "document": path, "hash": HASH})
    with pytest.raises(ManifestError, match="document"):
        g.decode_pointer(data)


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        ({"id": "not-an-id"}, "$.id"),
        ({"id": "20261203T081500Z-" + "1" * 31}, "$.id"),
        ({"made_by": "magic"}, "$.made_by"),
        ({"unknown_field": 1}, "unknown field `unknown_field`"),
        ({"format_version": 2}, "$.format_version"),
    ],
)
def test_a_damaged_generation_is_refused_with_its_location(edit, where):
    document = json.loads(g.encode_generation(_generation()))
    document.update(edit)
    with pytest.raises(ManifestError, match=re.escape(where)) as refused:
        g.decode_generation(json.dumps(document).encode(), "gen.json")
    assert "gen.json" in str(refused.value)
    assert not isinstance(refused.value, ManifestVersionError)


@pytest.mark.parametrize("extra", [{}, {"a_field_of_version_4": True}])
def test_a_newer_format_is_refused_as_such(extra):
    document = {**json.loads(g.encode_generation(_generation())), "format_version": 4, **extra}
    with pytest.raises(ManifestVersionError, match="format version 4 is newer"):
        g.decode_generation(json.dumps(document).encode())
    pointer = {"format_version": 4, "generation": ID1, "document": g.generation_document_path(ID1), "hash": HASH}
    with pytest.raises(ManifestVersionError):
        g.decode_pointer(json.dumps({**pointer, **extra}).encode())


def test_a_pointer_names_its_generation_and_that_generation_s_document():
    document = g.encode_generation(_generation())
    pointer = g.pointer_to(ID2, document)
    assert g.decode_pointer(g.encode_pointer(pointer)) == pointer
    assert pointer.hash == "blake3:" + blake3.blake3(document).hexdigest()
    moved = {**msgspec.to_builtins(pointer), "document": g.generation_document_path(ID1)}
    with pytest.raises(ManifestError, match="names generation"):
        g.decode_pointer(json.dumps(moved).encode())


@pytest.mark.parametrize("data", [b"", b"  ", b"{", b"[]", b'"x"'])
def test_garbage_is_a_manifest_error(data):
    with pytest.raises(ManifestError):
        g.decode_pointer(data)
    with pytest.raises(ManifestError):
        g.decode_generation(data)


def test_generation_ids_are_new_each_time_and_carry_the_time():
    ids = {g.new_generation_id(now=0.0) for _ in range(1000)}
    assert len(ids) == 1000
    assert all(i.startswith("19700101T000000Z-") and g.is_generation_id(i) for i in ids)


def test_checked_in_json_schema_matches_the_types():
    on_disk = json.loads((ROOT / "schemas" / "manifest-v3.schema.json").read_text())
    assert on_disk == g.json_schema(), "run `make schema` and commit schemas/"
