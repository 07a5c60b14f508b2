"""Every crafted bad input is refused by `validate` (API and CLI) with its typed error and gist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from helpers.bad_inputs import BAD_INPUTS
from helpers.synthetic import FINGERPRINT, write_synthetic_checkpoint

from tensorizer_manifest import errors
from tensorizer_manifest.checks.validate import check_engine_settings, check_files, open_checked, validate_checkpoint
from tensorizer_manifest.storage.checkpoint import load_manifest


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("pristine") / "ckpt")


def _damaged(pristine, tmp_path, case):
    d = tmp_path / "ckpt"
    shutil.copytree(pristine, d, symlinks=True)
    case.mutate(d)
    return d


def test_the_catalog_is_large_enough():
    assert len(BAD_INPUTS) >= 30
    assert len({c.name for c in BAD_INPUTS}) == len(BAD_INPUTS)


def test_pristine_checkpoint_is_valid(pristine):
    report = validate_checkpoint(pristine)
    assert report.ok, report.problems
    assert report.hashes_checked == report.stored > 0


@pytest.mark.parametrize("case", [c for c in BAD_INPUTS if c.scope == "offline"], ids=str)
def test_validate_refuses(pristine, tmp_path, case):
    d = _damaged(pristine, tmp_path, case)
    report = validate_checkpoint(d)
    assert not report.ok
    kinds = {p.kind.__name__ for p in report.problems}
    assert case.error in kinds, report.problems
    assert any(re.search(case.gist, str(p)) for p in report.problems if p.kind.__name__ == case.error), report.problems


def _open_and_close(manifest, path):
    with open_checked(manifest, path):
        pass


@pytest.mark.parametrize("checks", [check_files, _open_and_close], ids=["check_files", "open_checked"])
@pytest.mark.parametrize("case", [c for c in BAD_INPUTS if c.scope == "offline"], ids=str)
def test_loader_checks_refuse_before_reading_weights_or_hashes_catch_it(pristine, tmp_path, case, checks):
    """What the vLLM loader runs before building the model (``open_checked``; ``check_files`` is the same checks
    without the open file); data damage is caught by hashes while reading."""
    d = _damaged(pristine, tmp_path, case)
    expected = getattr(errors, case.error)
    with pytest.raises(errors.TensorizerManifestError) as info:
        manifest, path = load_manifest(d)
        checks(manifest, path)
        report = validate_checkpoint(d)  # the content hashes, which the loader checks as it reads
        report.raise_for_problems()
    assert isinstance(info.value, expected), info.value
    assert re.search(case.gist, str(info.value)), str(info.value)


@pytest.mark.parametrize("case", [c for c in BAD_INPUTS if c.scope == "engine"], ids=str)
def test_validate_with_engine_settings_refuses(pristine, tmp_path, case):
    d = _damaged(pristine, tmp_path, case)
    assert validate_checkpoint(d).ok  # nothing is wrong with the files themselves
    problems = check_engine_settings(
        next(d.glob("*.manifest.json")),
        dtype=FINGERPRINT.dtype,
        quantization="none",
        tensor_parallel_size=FINGERPRINT.tensor_parallel_size,
    )
    assert [p.kind.__name__ for p in problems] == [case.error]
    assert re.search(case.gist, str(problems[0]))


@pytest.mark.parametrize(
    "case", [c for c in BAD_INPUTS if c.name in ("tensor-data-flipped", "manifest-not-json", "path-absolute")], ids=str
)
def test_validate_cli_one_line_per_problem_and_exit_1(pristine, tmp_path, case):
    d = _damaged(pristine, tmp_path, case)
    proc = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(d)],
        capture_output=True,
        text=True,
        env={"COLUMNS": "300", "PATH": ""},
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and case.error in proc.stderr
    as_json = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(d), "--json"], capture_output=True, text=True
    )
    assert as_json.returncode == 1
    doc = json.loads(as_json.stdout)
    assert doc["ok"] is False and any(p["error"] == case.error for p in doc["problems"])


def test_validate_cli_exit_codes(pristine, tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(pristine)], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    usage = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", "--no-such-flag", str(pristine)],
        capture_output=True,
        text=True,
    )
    assert usage.returncode == 2


@pytest.mark.e2e
def test_vllm_loader_refuses_every_bad_input_and_serves_nothing(scenarios, tmp_path):
    """The real loader, inside a real engine, on a checkpoint saved by real vLLM (W8A8: raw and processed layers)."""
    from conftest import run_script
    from helpers.bad_inputs import MODEL_BAD_INPUTS

    model_dir = scenarios.e2e("w8a8-int8")["model_dir"]
    results = run_script(
        "scenarios/bad_inputs_loader.py", model_dir, "w8a8-int8", str(tmp_path), marker="LOADER_RESULT", timeout=1800
    )
    cases = BAD_INPUTS + MODEL_BAD_INPUTS
    assert set(results) == {c.name for c in cases}
    for case in cases:
        outcome = results[case.name]
        assert outcome["tokens"] is None, f"{case}: tokens were served from a damaged checkpoint"
        assert outcome["error"] == case.error, (case.name, outcome)
        assert re.search(case.gist, outcome["message"]), (case.name, outcome["message"])


# --- the seal: every field of the manifest is bound ------------------------------------------

SEAL_GIST = "modified after it was saved"
#: Other values of the Literal fields, so that an edit of one still decodes.
_LITERALS = [("raw", "processed"), ("parameter", "buffer"), ("bfloat16", "float16"), ("float32", "int32"),
             ("int8", "uint8"), ("none", "tensorizer-xsalsa20poly1305-blake3-key")]  # fmt: skip


def _rich_checkpoint(pristine, directory):
    """The synthetic checkpoint with plain values of every kind in runtime state and Parameter attributes, sealed."""
    import msgspec

    from tensorizer_manifest.format.schema import RuntimeAttr, decode_manifest, encode_manifest, seal_manifest

    shutil.copytree(pristine, directory)
    path = next(directory.glob("*.manifest.json"))
    manifest = decode_manifest(path.read_bytes())
    manifest.modules[0].runtime_state += [
        RuntimeAttr(owner="layer", name=n, type=t, rebuilt_by="cpu_unquantized_gemm", value=v)
        for n, t, v in [("scale", "float", 0.125), ("bits", "int", 8), ("on", "bool", True), ("kind", "str", "x"),
                        ("dims", "tuple", [1, 2.5, "a", False])]
    ]  # fmt: skip
    manifest.modules[1].tensors[0].param_attrs = {"input_dim": 1, "packed": [0, 1], "scale": 0.5}
    manifest.seal = seal_manifest(manifest)
    path.write_bytes(encode_manifest(manifest))
    assert validate_checkpoint(directory).ok
    return directory, path, msgspec.json.decode(path.read_bytes())


def _paths(node, prefix=()):
    """Every value in a manifest document (containers too), except the seal and ``format_version`` (1 is
    the only version that decodes)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if prefix == () and key in ("seal", "format_version"):
            continue
        yield prefix + (key,), value
        yield from _paths(value, prefix + (key,))


def _edits(key, value, samples):
    """Candidate edits of one value, same kind first; the first one that still decodes is used."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1]
    if isinstance(value, float):
        return [value + 0.5]
    if isinstance(value, str):
        others = [b for pair in _LITERALS for a, b in (pair, pair[::-1]) if a == value]
        last = value[-1:] or "x"
        return [*others, value[:-1] + ("1" if last != "1" else "2"), value + "x"]
    if value is None:
        return ["torch.nn.parameter.Parameter", "x", True, 1, 1.5, [1]]
    if isinstance(value, list):
        if not value:
            return [[samples[key]]] if key in samples else [[1], ["x"]]
        return [[*value, value[0]], value[:-1]]
    if key == "param_attrs":
        return [{**value, "added": 1}]
    return []  # a struct: its fields are edited one by one


def test_every_single_field_edit_is_refused_by_the_seal(pristine, tmp_path):
    """Walk the whole manifest: each value (every kind, every struct, runtime values, kernels, the fingerprint,
    the producer) edited alone and re-encoded is refused offline, by the seal itself."""
    import copy

    import msgspec

    from tensorizer_manifest.format.schema import decode_manifest

    directory, path, doc = _rich_checkpoint(pristine, tmp_path / "ckpt")
    original = decode_manifest(path.read_bytes())
    samples = {}
    for p, value in _paths(doc):
        if isinstance(value, list) and value and isinstance(p[-1], str):
            samples.setdefault(p[-1], copy.deepcopy(value[0]))
    edited, kinds, undecodable = 0, set(), []
    for p, value in _paths(doc):
        key = p[-1] if isinstance(p[-1], str) else p[-2]
        candidates = _edits(key, value, samples)
        if not candidates:
            continue
        for new in candidates:
            changed = copy.deepcopy(doc)
            parent = changed
            for part in p[:-1]:
                parent = parent[part]
            parent[p[-1]] = new
            data = msgspec.json.encode(changed)
            try:
                if decode_manifest(data) != original:
                    break
            except errors.ManifestError:
                continue
        else:
            undecodable.append(p)
            continue
        path.write_bytes(data)
        report = validate_checkpoint(directory, verify_hashes=False)
        assert report.problems and report.problems[0].kind is errors.IntegrityError, (p, new, report.problems)
        assert SEAL_GIST in report.problems[0].message, (p, new, report.problems[0])
        edited += 1
        kinds.add(type(value).__name__)
    assert not undecodable, f"no edit of these decodes: {undecodable}"
    assert kinds == {"str", "int", "bool", "float", "list", "dict", "NoneType"}, kinds
    assert edited > 150, edited


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda doc: doc.update(producer="tensorizer-manifest 9"), id="producer"),
        pytest.param(lambda doc: doc["modules"][0]["kernels"][0].update(kernel_class="x.Y"), id="kernel-class"),
        pytest.param(lambda doc: doc["modules"][0]["runtime_state"][1].update(value=0.25), id="runtime-value"),
        pytest.param(lambda doc: doc["fingerprint"].update(revision="main"), id="fingerprint"),
    ],
)
def test_the_loader_checks_refuse_an_edited_manifest(pristine, tmp_path, edit):
    directory, path, doc = _rich_checkpoint(pristine, tmp_path / "ckpt")
    edit(doc)
    path.write_text(json.dumps(doc))
    manifest, manifest_path = load_manifest(directory)
    with pytest.raises(errors.IntegrityError, match=SEAL_GIST):
        check_files(manifest, manifest_path)


@pytest.fixture
def key_files(tmp_path):
    good, other, short = tmp_path / "good.key", tmp_path / "other.key", tmp_path / "short.key"
    good.write_bytes(b"k" * 31 + b"\n")
    other.write_bytes(b"k" * 31 + b"\r")
    short.write_bytes(b"k" * 15)
    return good, other, short


@pytest.fixture
def mac_checkpoint(tmp_path, key_files):
    from helpers.synthetic import make_capture

    from tensorizer_manifest.save.write import write_checkpoint
    from tensorizer_manifest.storage.checkpoint import read_signing_key

    directory = tmp_path / "mac"
    write_checkpoint(make_capture(), directory, "model", signing_key=read_signing_key(key_files[0]))
    return directory


def test_a_mac_manifest_passes_with_its_key_only(mac_checkpoint, key_files, monkeypatch):
    good, other, _ = key_files
    monkeypatch.delenv("TENSORIZER_MANIFEST_SIGNING_KEY", raising=False)
    assert json.loads(next(mac_checkpoint.glob("*.manifest.json")).read_text())["seal"]["mode"] == "mac"
    report = validate_checkpoint(mac_checkpoint, signing_key_file=good)
    assert report.ok and not report.warnings, report.problems
    without = validate_checkpoint(mac_checkpoint)
    assert [p.kind for p in without.problems] == [errors.ConfigurationError]
    assert "--signing-key-file" in without.problems[0].message
    wrong = validate_checkpoint(mac_checkpoint, signing_key_file=other)  # differs in its last byte only
    assert [p.kind for p in wrong.problems] == [errors.IntegrityError]
    assert "signing key is not the one" in wrong.problems[0].message
    monkeypatch.setenv("TENSORIZER_MANIFEST_SIGNING_KEY", str(good))
    assert validate_checkpoint(mac_checkpoint).ok
    manifest, manifest_path = load_manifest(mac_checkpoint)
    from tensorizer_manifest.storage.checkpoint import read_signing_key

    check_files(manifest, manifest_path, signing_key=read_signing_key(good))
    with pytest.raises(errors.ConfigurationError, match="sealed with a signing key"):
        check_files(manifest, manifest_path)


def test_a_mac_manifest_edited_and_resealed_without_the_key_is_refused(mac_checkpoint, key_files):
    """Who can write the manifest but lacks the key can only make a digest seal, which a key refuses."""
    from helpers.bad_inputs import reseal

    path = next(mac_checkpoint.glob("*.manifest.json"))
    doc = json.loads(path.read_text())
    doc["modules"][0]["kernels"][0]["kernel_class"] = "evil.Kernel"
    reseal(doc)
    path.write_text(json.dumps(doc))
    report = validate_checkpoint(mac_checkpoint, signing_key_file=key_files[0])
    assert [p.kind for p in report.problems] == [errors.IntegrityError]
    assert "plain digest" in report.problems[0].message
    doc["seal"]["mode"] = "mac"  # a digest passed off as a MAC
    path.write_text(json.dumps(doc))
    report = validate_checkpoint(mac_checkpoint, signing_key_file=key_files[0])
    assert "signing key is not the one" in report.problems[0].message


def test_an_unsealed_manifest_is_a_warning_without_a_key_and_refused_with_one(pristine, tmp_path, key_files):
    d = tmp_path / "ckpt"
    shutil.copytree(pristine, d)
    path = next(d.glob("*.manifest.json"))
    doc = json.loads(path.read_text())
    doc.pop("seal")  # as 0.2.0 wrote it
    path.write_text(json.dumps(doc))
    report = validate_checkpoint(d)
    assert report.ok and len(report.warnings) == 1 and "not sealed" in report.warnings[0]
    assert report.to_dict()["warnings"] == list(report.warnings)
    refused = validate_checkpoint(d, signing_key_file=key_files[0])
    assert [p.kind for p in refused.problems] == [errors.IntegrityError] and "not sealed" in str(refused.problems[0])
    cli = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(d), "--no-hashes"],
        capture_output=True,
        text=True,
        env={"COLUMNS": "300", "PATH": ""},
    )
    assert cli.returncode == 0 and "warning" in cli.stderr and "not sealed" in cli.stderr, cli.stderr


def test_the_key_never_shows(mac_checkpoint, key_files, tmp_path):
    good, other, short = key_files
    secret = good.read_bytes().decode().strip()
    messages = [str(p) for p in validate_checkpoint(mac_checkpoint, signing_key_file=other).problems]
    messages += [str(p) for p in validate_checkpoint(mac_checkpoint, signing_key_file=short).problems]
    as_path = tmp_path / secret  # a key pasted where its path belongs
    messages += [str(p) for p in validate_checkpoint(mac_checkpoint, signing_key_file=as_path).problems]
    assert len(messages) == 3 and "at least 16" in messages[1] and "not the key itself" in messages[2]
    assert not any(secret in m for m in messages), messages
    assert secret not in next(mac_checkpoint.glob("*.manifest.json")).read_text()
    cli = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(mac_checkpoint), "--signing-key-file",
         str(good), "--json"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert cli.returncode == 0 and secret not in cli.stdout + cli.stderr, cli.stderr


# --- the tensor file's prefix: checked before tensorizer parses it ------------------------------


def _index_length_offset(data: bytes, prefix_size: int) -> int:
    """Where tensorizer's file header stores the length of its index (which runs to ``prefix_size``)."""
    return next(o for o in range(prefix_size - 8) if int.from_bytes(data[o : o + 8], "little") == prefix_size - o - 8)


def _claim_a_huge_index(directory, claim: int) -> None:
    manifest, _ = load_manifest(directory)
    tensor_path = directory / manifest.tensor_file.path
    data = bytearray(tensor_path.read_bytes())
    at = _index_length_offset(bytes(data), manifest.tensor_file.prefix_size)
    data[at : at + 8] = claim.to_bytes(8, "little")
    tensor_path.write_bytes(bytes(data))


def _peak_bytes(fn) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


CLAIM = 256 << 20


def test_a_damaged_index_length_is_refused_before_tensorizer_allocates_it(pristine, tmp_path, monkeypatch):
    """No address-space cap: peak memory stays within the recorded prefix (read in bounded chunks), and
    tensorizer's deserializer is never built."""
    import tensorizer

    d = tmp_path / "ckpt"
    shutil.copytree(pristine, d)
    _claim_a_huge_index(d, CLAIM)
    prefix = load_manifest(d)[0].tensor_file.prefix_size
    built = []
    monkeypatch.setattr(tensorizer, "TensorDeserializer", lambda *a, **k: built.append(a) or 1 / 0)
    reports = []
    peak = _peak_bytes(lambda: reports.append(validate_checkpoint(d)))
    assert [p.kind for p in reports[0].problems] == [errors.IntegrityError]
    assert "checked before tensorizer reads it" in reports[0].problems[0].message
    manifest, manifest_path = load_manifest(d)

    def loader_checks():
        with pytest.raises(errors.IntegrityError, match="checked before tensorizer reads it"):
            check_files(manifest, manifest_path)

    peak = max(peak, _peak_bytes(loader_checks))
    assert not built, "tensorizer opened a file whose header was not checked"
    assert peak < prefix + (2 << 20), f"peak {peak} bytes for a {prefix} byte prefix"


def test_without_a_recorded_prefix_the_index_length_is_still_bounded_by_the_records(pristine, tmp_path):
    """A 0.2.0 manifest (no prefix, no seal), where tensorizer used to believe the damaged length and allocate it:
    the index's length is checked against what the records' entries can take, before tensorizer parses it."""
    d = tmp_path / "ckpt"
    shutil.copytree(pristine, d)
    _claim_a_huge_index(d, CLAIM)
    path = next(d.glob("*.manifest.json"))
    doc = json.loads(path.read_text())
    doc.pop("seal")
    doc["tensor_file"].update(prefix_size=None, prefix_hash=None)
    path.write_text(json.dumps(doc))
    reports = []
    peak = _peak_bytes(lambda: reports.append(validate_checkpoint(d, verify_hashes=False)))
    assert [p.kind for p in reports[0].problems] == [errors.IntegrityError]
    assert f"tensorizer's index claims {CLAIM} bytes" in reports[0].problems[0].message
    assert peak < 2 << 20, peak


def test_a_remote_checkpoint_validates_with_its_hashes_and_each_failure_is_typed(pristine, moto_s3, tmp_path):
    from helpers.servers import BUCKET, RangeHTTPServer, closed_endpoint

    from tensorizer_manifest.storage.remote import RemoteOptions
    from tensorizer_manifest.storage.remote_checkpoint import upload_checkpoint

    options = RemoteOptions(moto_s3.key_id, moto_s3.secret, moto_s3.endpoint)
    uri = f"s3://{BUCKET}/validate-test"
    upload_checkpoint(pristine, uri, options)
    report = validate_checkpoint(uri, remote=options)
    assert report.ok, report.problems
    assert report.hashes_checked == report.stored > 0 and str(report.tensor_path).startswith(uri + "/")
    manifest, manifest_path = load_manifest(uri, remote=options)
    assert str(check_files(manifest, manifest_path)) == str(report.tensor_path)

    unreachable = RemoteOptions(moto_s3.key_id, moto_s3.secret, closed_endpoint())
    [problem] = validate_checkpoint(uri, remote=unreachable).problems
    assert problem.kind is errors.RemoteUnreachableError
    [problem] = validate_checkpoint(f"s3://{BUCKET}/no-such-prefix", remote=options).problems
    assert problem.kind is errors.RemoteNotFoundError

    d = tmp_path / "served"
    shutil.copytree(pristine, d / "ckpt")
    size = manifest.tensor_file.size
    cut = manifest.tensor_file.prefix_size + (size - manifest.tensor_file.prefix_size) // 2
    with RangeHTTPServer(d, cut_after=cut) as server:  # stops sending halfway through the tensor data
        report = validate_checkpoint(f"{server.url}/ckpt")
    [problem] = report.problems
    assert problem.kind is errors.RemoteStorageError and "cut short" in problem.message
    assert not report.ok


# --- encrypted checkpoints --------------------------------------------------------------------------


@pytest.fixture
def encrypted(tmp_path, key_files):
    """An encrypted checkpoint (sealed from its key), and one sealed with a signing key as well."""
    from helpers.synthetic import make_capture

    from tensorizer_manifest.save.write import write_checkpoint
    from tensorizer_manifest.storage.checkpoint import read_encryption_key, read_signing_key

    key = read_encryption_key(key_files[0])
    write_checkpoint(make_capture(), tmp_path / "enc", "model", encryption_key=key)
    write_checkpoint(
        make_capture(), tmp_path / "both", "model", signing_key=read_signing_key(key_files[0]), encryption_key=key
    )
    return tmp_path / "enc", tmp_path / "both"


def test_an_encrypted_checkpoint_validates_fully_with_its_key_and_all_but_hashes_without(
    encrypted, key_files, monkeypatch
):
    from tensorizer_manifest.progress import ProgressUpdate

    good, other, _ = key_files
    monkeypatch.delenv("TENSORIZER_MANIFEST_ENCRYPTION_KEY", raising=False)
    directory = encrypted[0]
    updates: list[ProgressUpdate] = []
    report = validate_checkpoint(directory, encryption_key_file=good, progress=updates.append)
    assert report.ok and report.encrypted and not report.warnings, report.problems
    assert report.hashes_checked == report.stored > 0  # of the plaintext, after decryption
    assert len(updates) == report.stored and updates[-1].nbytes == updates[-1].total_bytes
    without = validate_checkpoint(directory)
    assert without.ok and without.encrypted and without.hashes_checked == 0, without.problems
    assert any("content hashes were not checked: the tensor file is encrypted" in w for w in without.warnings)
    assert any("seal was not checked" in w for w in without.warnings)
    wrong = validate_checkpoint(directory, encryption_key_file=other)
    assert [p.kind for p in wrong.problems] == [errors.IntegrityError] and wrong.hashes_checked == 0
    assert "encryption key is not the one" in wrong.problems[0].message
    monkeypatch.setenv("TENSORIZER_MANIFEST_ENCRYPTION_KEY", str(good))
    assert validate_checkpoint(directory).hashes_checked == report.stored


def test_with_a_signing_key_too_a_wrong_encryption_key_is_a_decryption_failure(encrypted, key_files):
    good, other, _ = key_files
    both = encrypted[1]
    assert validate_checkpoint(both, signing_key_file=good, encryption_key_file=good).ok
    wrong = validate_checkpoint(both, signing_key_file=good, encryption_key_file=other)
    assert [p.kind for p in wrong.problems] == [errors.IntegrityError], wrong.problems
    assert "decryption failed" in wrong.problems[0].message
    manifest, path = load_manifest(both)
    from tensorizer_manifest.storage.checkpoint import read_signing_key

    with pytest.raises(errors.ConfigurationError, match="tensor file is encrypted; pass its key file"):
        check_files(manifest, path, signing_key=read_signing_key(good))


def test_a_forged_plain_checkpoint_is_refused_given_the_key_and_a_forged_seal_always(
    pristine, encrypted, key_files, tmp_path
):
    """Who can write the bucket but lacks the key can neither pass a plain checkpoint off as the encrypted one,
    nor claim encryption under a digest seal."""
    from helpers.bad_inputs import reseal

    good = key_files[0]
    plain = validate_checkpoint(pristine, encryption_key_file=good)
    assert [p.kind for p in plain.problems] == [errors.IntegrityError]
    assert "not encrypted" in plain.problems[0].message
    d = tmp_path / "forged"
    shutil.copytree(encrypted[0], d)
    path = next(d.glob("*.manifest.json"))
    doc = json.loads(path.read_text())
    doc["modules"][0]["kernels"][0]["kernel_class"] = "evil.Kernel"
    reseal(doc)  # a digest: all one can make without the key
    path.write_text(json.dumps(doc))
    for key in (good, None):
        report = validate_checkpoint(d, encryption_key_file=key)
        assert errors.IntegrityError in [p.kind for p in report.problems], report
        assert any("not sealed with a key" in p.message for p in report.problems)


def test_the_encryption_key_never_shows(encrypted, key_files):
    good, other, _ = key_files
    secret = good.read_bytes().decode().strip()
    directory = encrypted[0]
    assert secret not in next(directory.glob("*.manifest.json")).read_text()
    cli = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(directory), "--encryption-key-file",
         str(good), "--json"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    doc = json.loads(cli.stdout)
    assert cli.returncode == 0 and doc["encrypted"] and doc["hashes_checked"] > 0, cli.stderr
    assert secret not in cli.stdout + cli.stderr
    wrong = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(directory), "--encryption-key-file",
         str(other)],
        capture_output=True,
        text=True,
        env={"COLUMNS": "300", "PATH": ""},
    )  # fmt: skip
    assert wrong.returncode == 1 and "IntegrityError" in wrong.stderr and secret not in wrong.stderr
    from tensorizer_manifest.storage.checkpoint import read_encryption_key

    assert secret not in repr(read_encryption_key(good))


def _count_tensorizer_opens(monkeypatch) -> list[str]:
    import tensorizer

    opened: list[str] = []
    original = tensorizer.TensorDeserializer.__init__

    def counting(self, source, *args, **kwargs):
        opened.append(str(source))
        original(self, source, *args, **kwargs)

    monkeypatch.setattr(tensorizer.TensorDeserializer, "__init__", counting)
    return opened


def test_open_checked_parses_the_tensor_file_header_once(pristine, monkeypatch):
    from tensorizer_manifest.storage.tensor_file import read_index

    manifest, path = load_manifest(pristine)
    expected_index = read_index(next(pristine.glob("*.tensors")))
    opened = _count_tensorizer_opens(monkeypatch)
    with open_checked(manifest, path) as reader:
        assert len(opened) == 1, opened  # check_files alone opens it once more, to read the index
        assert reader.index() == expected_index
        tensors = dict(reader.stream())
    assert set(tensors) == {t.key for m in manifest.modules for t in m.tensors if t.key and not t.alias_of}
    opened.clear()
    check_files(manifest, path)
    assert len(opened) == 1


def test_open_checked_refuses_a_damaged_header_before_tensorizer_parses_it(pristine, tmp_path, monkeypatch):
    case = next(c for c in BAD_INPUTS if c.name == "tensor-header-flipped")
    manifest, path = load_manifest(_damaged(pristine, tmp_path, case))
    opened = _count_tensorizer_opens(monkeypatch)
    with pytest.raises(errors.IntegrityError, match="checked before tensorizer reads it"):
        with open_checked(manifest, path):
            pytest.fail("a damaged file was opened")
    assert opened == []


def test_an_old_unsealed_manifest_that_hides_an_encrypted_tensor_file_is_refused_at_open(encrypted, monkeypatch):
    """Without a prefix or seal (0.2.0 and older) only tensorizer's open finds the file encrypted: an IntegrityError,
    not a request for a key the manifest never mentions."""
    monkeypatch.delenv("TENSORIZER_MANIFEST_ENCRYPTION_KEY", raising=False)
    directory = encrypted[0]
    path = next(directory.glob("*.manifest.json"))
    doc = json.loads(path.read_text())
    doc["seal"] = None
    doc["tensor_file"].update(encryption="none", prefix_size=None, prefix_hash=None, head_hash=None)
    path.write_text(json.dumps(doc))
    manifest, manifest_path = load_manifest(directory)
    with pytest.raises(errors.IntegrityError, match="encrypted, its manifest says it is not"):
        with open_checked(manifest, manifest_path):
            pytest.fail("an encrypted file was opened as a plain one")


@pytest.fixture(scope="module")
def with_fallbacks(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("fallbacks") / "ckpt", fallbacks=True)


def test_raw_fallbacks_are_stored_after_every_layers_own_tensors_and_validated(with_fallbacks):
    from tensorizer_manifest.storage.tensor_file import read_index

    manifest, path = load_manifest(with_fallbacks)
    assert manifest.format_version == 2
    (layer,) = [m for m in manifest.modules if m.fallback]
    index = read_index(path.parent / manifest.tensor_file.path)
    own = [index[t.key].data_offset for m in manifest.modules for t in m.tensors if t.key and not t.alias_of]
    fallback = [index[t.key].data_offset for t in layer.fallback]
    assert fallback and min(fallback) > max(own), "a load that needs no fallback reads one run and stops"
    report = validate_checkpoint(with_fallbacks)
    assert report.ok, report.problems
    assert report.hashes_checked == report.stored == manifest.tensor_file.tensor_count
    assert report.stored == len(own) + len(fallback)


def test_damaged_fallback_bytes_are_caught_by_their_content_hash(with_fallbacks, tmp_path):
    from tensorizer_manifest.storage.tensor_file import read_index

    d = tmp_path / "ckpt"
    shutil.copytree(with_fallbacks, d)
    manifest, path = load_manifest(d)
    key = next(m for m in manifest.modules if m.fallback).fallback[0].key
    tensors = path.parent / manifest.tensor_file.path
    entry = read_index(tensors)[key]
    data = bytearray(tensors.read_bytes())
    data[entry.data_offset + 5] ^= 0xFF
    tensors.write_bytes(bytes(data))
    report = validate_checkpoint(d)
    assert [p.kind for p in report.problems] == [errors.IntegrityError]
    assert key in report.problems[0].message and "content hash" in report.problems[0].message


@pytest.mark.parametrize(
    "edit, gist",
    [
        (lambda doc: doc.update(format_version=1), "format version 1 but holds raw fallbacks"),
        (lambda doc: _fallback_layer(doc).update(state="raw", replay="post_load"), "is not a processed layer"),
        (lambda doc: _fallback_layer(doc)["fallback"][0].update(alias_of="model.norm.weight", key=None), "alias"),
        (lambda doc: _fallback_layer(doc)["fallback"][0].update(shape=[4, 13, 32]), "digest"),
    ],
    ids=["version-1-with-fallbacks", "fallback-on-a-raw-layer", "fallback-alias", "fallback-record-edited"],
)
def test_an_edited_fallback_is_refused(with_fallbacks, tmp_path, edit, gist):
    d = tmp_path / "ckpt"
    shutil.copytree(with_fallbacks, d)
    path = d / "model.manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    doc["seal"] = None  # resealing is the edit test's business: here the records themselves must be refused
    path.write_text(json.dumps(doc))
    report = validate_checkpoint(d)
    assert not report.ok and any(gist in p.message for p in report.problems), report.problems


def _fallback_layer(doc: dict) -> dict:
    return next(m for m in doc["modules"] if m.get("fallback"))
