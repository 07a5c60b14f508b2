"""Live tensors to records and back: dtype, layout, Parameter class and attributes, hashes."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tensorizer_manifest.errors import IntegrityError, ManifestError
from tensorizer_manifest.format.schema import TensorRecord, decode_manifest, encode_manifest
from tensorizer_manifest.live_model.layers import PreStepCopies, snapshot_module
from tensorizer_manifest.live_model.tensors import (
    dtype_from_name,
    hash_tensor,
    make_parameter,
    make_record,
    materialize,
    param_class_from_name,
)
from tensorizer_manifest.storage.spill import SpillFile


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


def test_every_format_dtype_maps_to_torch():
    from tensorizer_manifest.format.schema import DTYPE_ITEMSIZE

    for name, itemsize in DTYPE_ITEMSIZE.items():
        assert torch.empty(0, dtype=dtype_from_name(name)).element_size() == itemsize, name
    with pytest.raises(ManifestError, match="does not exist in torch"):
        dtype_from_name("float128")


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


def test_list_of_strings_parameter_attribute_round_trips_from_capture_to_load(tmp_path):
    """Capture copies it, the manifest records it, the loader sets it: nothing dropped on the way."""
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.ones(2, 3), requires_grad=False)
    layer.weight.shard_names = ["q", "k", "v"]
    layer.weight.shard_flags = (True, False)
    layer.weight.weight_loader = print  # not plain: vLLM's fresh Parameter carries its own
    with SpillFile(tmp_path) as spill:
        slot = snapshot_module(layer, PreStepCopies(spill)).tensors["weight"]
    kept = slot.tensor
    assert kept.shard_names == ["q", "k", "v"] and kept.shard_flags == (True, False)
    record = make_record("weight", kept, kind="parameter", persistent=True, key="weight", content_hash=slot.stored.hash)
    assert record.param_attrs == {"shard_names": ["q", "k", "v"], "shard_flags": [True, False]}
    decoded = msgspec.json.decode(msgspec.json.encode(record), type=TensorRecord)
    param = make_parameter(decoded, torch.ones(2, 3))
    assert param.shard_names == ["q", "k", "v"] and param.shard_flags == [True, False]
    assert not hasattr(param, "weight_loader")


@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "torch.Tensor", "subprocess.Popen"])
def test_manifest_cannot_name_arbitrary_classes(name):
    with pytest.raises(ManifestError, match="not one the loader may build"):
        param_class_from_name(name)


def test_a_vllm_parameter_class_is_allowed():
    pytest.importorskip("vllm")
    cls = param_class_from_name("vllm.model_executor.parameter.ModelWeightParameter")
    assert issubclass(cls, torch.nn.Parameter)
    with pytest.raises(ManifestError, match="does not exist"):
        param_class_from_name("vllm.model_executor.parameter.NoSuchParameter")


def test_a_raw_kv_cache_scale_comes_back_as_vllms_own_class():
    """An FP8 model's raw attention layer holds KVCacheScaleParameter scales (a --portable save): the loader
    rebuilds them as that class, around the saved bytes, without calling its constructor."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.kv_cache import KVCacheScaleParameter

    record = make_record("k_scale", KVCacheScaleParameter(), kind="parameter", persistent=True, key="k")
    param = make_parameter(record, torch.tensor(0.25))
    assert type(param) is KVCacheScaleParameter and param.item() == 0.25


def test_records_survive_encoding(tmp_path):
    from helpers.synthetic import write_synthetic_checkpoint

    path = write_synthetic_checkpoint(tmp_path / "ckpt") / "model.manifest.json"
    manifest = decode_manifest(path.read_bytes())
    assert decode_manifest(encode_manifest(manifest)) == manifest


def test_a_large_tensor_hashes_the_same_with_blake3_threads_as_on_one_thread():
    import blake3

    from tensorizer_manifest.format import schema

    big = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: over the threaded size
    assert big.numel() * big.element_size() >= schema.THREADED_HASH_BYTES
    one_thread = "blake3:" + blake3.blake3(big.numpy().tobytes()).hexdigest()
    assert hash_tensor(big) == one_thread
