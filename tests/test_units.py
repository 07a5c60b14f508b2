"""Unit tests with no vLLM engine: schema, tensor records, hashing, capture diffs, public API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

import tensorizer_manifest as tm
from tensorizer_manifest import schema
from tensorizer_manifest.capture import diff_snapshots, snapshot_module
from tensorizer_manifest.errors import IntegrityError, ManifestError, ManifestVersionError
from tensorizer_manifest.tensors import (
    TensorFileReader,
    hash_tensor,
    make_parameter,
    make_record,
    materialize,
    param_class_from_name,
    write_tensor_file,
)

ROOT = Path(__file__).resolve().parent.parent


def test_public_api_is_what_was_meant():
    assert set(tm.__all__) == {
        "__version__",
        "FORMAT_VERSION",
        "LOAD_FORMAT",
        "CAPTURE_LOAD_FORMAT",
        "WORKER_EXTENSION",
        "Manifest",
        "save_checkpoint",
        "read_manifest",
        "decode_manifest",
        "encode_manifest",
        "json_schema",
        "TensorizerManifestError",
        "ManifestError",
        "ManifestVersionError",
        "CheckpointNotFoundError",
        "IntegrityError",
        "CompatibilityError",
        "UnsupportedModelError",
        "ReplayError",
    }
    for name in tm.__all__:
        assert hasattr(tm, name), name


def test_every_error_is_a_tensorizer_manifest_error_and_a_builtin():
    assert issubclass(tm.ManifestError, ValueError)
    assert issubclass(tm.ManifestVersionError, tm.ManifestError)
    assert issubclass(tm.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(tm.ReplayError, RuntimeError)
    for name in (
        "ManifestError",
        "CheckpointNotFoundError",
        "IntegrityError",
        "CompatibilityError",
        "UnsupportedModelError",
        "ReplayError",
    ):
        assert issubclass(getattr(tm, name), tm.TensorizerManifestError)


def test_checked_in_json_schema_matches_the_types():
    on_disk = json.loads((ROOT / "schemas" / "manifest-v1.schema.json").read_text())
    assert on_disk == schema.json_schema(), "run `make schema` and commit schemas/"


def test_manifest_from_a_newer_format_is_refused_naming_both_versions():
    with pytest.raises(ManifestVersionError, match=r"version 7 .* version 1"):
        schema.decode_manifest(b'{"format_version": 7}')


@pytest.mark.parametrize(
    "data, gist",
    [
        (b"", "empty"),
        (b"   \n", "empty"),
        (b"{not json", "not valid JSON"),
        (b"[]", "Expected `object`"),
        (b'{"format_version": 1}', "missing required field"),
    ],
)
def test_bad_manifest_bytes_raise_manifest_error(data, gist):
    with pytest.raises(ManifestError, match=gist):
        schema.decode_manifest(data)


def _record(tensor, name="w", kind="parameter"):
    return make_record(name, tensor, kind=kind, persistent=True, key=name)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # non-contiguous
        torch.arange(20, dtype=torch.int32)[5:13].reshape(2, 4),  # storage offset
        torch.randn(4, 3).to(torch.bfloat16),
        torch.tensor(2.5),
    ],
)
def test_materialize_restores_dtype_shape_and_stride(tensor):
    record = _record(tensor)
    got = materialize(record, tensor.contiguous(), "w")
    assert got.dtype == tensor.dtype and got.shape == tensor.shape and got.stride() == tensor.stride()
    assert torch.equal(got, tensor)


def test_materialize_refuses_data_of_another_dtype():
    record = _record(torch.zeros(2, 2, dtype=torch.bfloat16))
    with pytest.raises(IntegrityError, match="bfloat16"):
        materialize(record, torch.zeros(2, 2, dtype=torch.float16), "w")


def test_zero_length_bfloat16_is_recorded_not_stored():
    empty = torch.empty(0, dtype=torch.bfloat16)
    record = _record(empty)
    assert record.key is None and record.nbytes == 0
    got = materialize(record, None, "w")
    assert got.dtype == torch.bfloat16 and got.shape == (0,)


def test_tensor_file_round_trip_keeps_dtypes(tmp_path):
    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.randint(-100, 100, (4, 4), dtype=torch.int8),
        "c": torch.tensor([1.5], dtype=torch.float32),
        "d": torch.arange(6, dtype=torch.int32),
    }
    path = tmp_path / "x.tensors"
    write_tensor_file(path, tensors.items())
    reader = TensorFileReader(path)
    try:
        for key, tensor in tensors.items():
            got = reader.read(key)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor)
            assert hash_tensor(got) == hash_tensor(tensor)
    finally:
        reader.close()


def test_hash_sees_a_single_flipped_bit():
    t = torch.zeros(1024, dtype=torch.bfloat16)
    u = t.clone()
    u.view(torch.int16)[100] ^= 1
    assert hash_tensor(t) != hash_tensor(u)


def test_parameter_class_and_plain_attributes_survive():
    p = torch.nn.Parameter(torch.ones(2, 3), requires_grad=False)
    p.output_dim = 0
    p.input_dim = 1
    record = _record(p)
    assert record.param_attrs == {"output_dim": 0, "input_dim": 1}
    q = make_parameter(record, torch.ones(2, 3))
    assert type(q) is torch.nn.Parameter and not q.requires_grad and q.output_dim == 0


@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "torch.Tensor", "subprocess.Popen"])
def test_manifest_cannot_name_arbitrary_classes(name):
    with pytest.raises(ManifestError, match="not one the loader may build"):
        param_class_from_name(name)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
        self.register_buffer("scale", torch.tensor(1.0))
        self.flag = 1.0


def test_capture_diff_sees_new_attributes_and_replaced_tensors():
    layer = _Layer()
    before = snapshot_module(layer, clones={})
    layer.flag = 2.0
    layer.handle = object()
    layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    diff = diff_snapshots(before, snapshot_module(layer, None))
    assert diff.changed_tensors == {"weight"}
    assert set(diff.changed_attrs) == {("layer", "flag"), ("layer", "handle")}
    # The before-snapshot kept a copy of the raw weight.
    assert torch.equal(before.tensors["weight"].tensor, torch.ones(2, 2))


def test_capture_diff_sees_in_place_changes():
    layer = _Layer()
    before = snapshot_module(layer, clones={})
    layer.scale.fill_(3.0)
    diff = diff_snapshots(before, snapshot_module(layer, None))
    assert diff.changed_tensors == {"scale"} and not diff.changed_attrs


def test_capture_diff_is_empty_when_nothing_changed():
    layer = _Layer()
    before = snapshot_module(layer, clones={})
    assert diff_snapshots(before, snapshot_module(layer, None)).empty


def test_cli_inspect_and_schema_do_not_import_torch_or_vllm(tmp_path):
    code = (
        "import sys\n"
        "from tensorizer_manifest.cli import app\n"
        "try:\n    app(['schema'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert msgspec.json.decode(proc.stdout)["$ref"] == "#/$defs/Manifest"


def test_every_fingerprint_field_has_a_written_policy():
    from tensorizer_manifest.fingerprint import EXACT, INFORMATIONAL, PROCESSED_ONLY

    fields = set(schema.Fingerprint.__struct_fields__)
    policies = [*EXACT, *PROCESSED_ONLY, *INFORMATIONAL]
    assert len(policies) == len(set(policies)), "a field has two policies"
    assert set(policies) == fields
    doc = (ROOT / "docs" / "fingerprint-policy.md").read_text()
    for name in fields:
        assert name in doc, f"docs/fingerprint-policy.md does not discuss {name}"


def test_no_pickle_anywhere_in_the_package():
    for path in (ROOT / "tensorizer_manifest").glob("*.py"):
        text = path.read_text()
        for needle in ("import pickle", "cloudpickle", "torch.load(", "pickle.load"):
            assert needle not in text, f"{path.name} uses {needle}"


def test_loader_options_are_validated():
    pytest.importorskip("vllm")
    from tensorizer_manifest.errors import CompatibilityError
    from tensorizer_manifest.vllm_integration import _load_options

    class LoadConfig:
        model_loader_extra_config = {"verify_hashes": "no"}

    assert _load_options(LoadConfig()).verify_hashes is False
    LoadConfig.model_loader_extra_config = {"verfy_hashes": False}
    with pytest.raises(CompatibilityError, match="verfy_hashes"):
        _load_options(LoadConfig())
