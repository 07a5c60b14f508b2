"""Observing layers: snapshots, their diff, kernels and owners, and vLLM's post-load order."""

from __future__ import annotations

import pytest
import torch

from tensorizer_manifest.errors import UnsupportedModelError
from tensorizer_manifest.live_model.layers import (
    PreStepCopies,
    describe,
    diff_snapshots,
    find_kernels,
    owners_of,
    post_load_steps,
    refuse_model_level_hook,
    snapshot_module,
)
from tensorizer_manifest.storage.spill import SpillFile


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
        self.register_buffer("scale", torch.tensor(1.0))
        self.flag = 1.0


@pytest.fixture
def copies(tmp_path):
    with SpillFile(tmp_path) as spill:
        yield PreStepCopies(spill)


def test_diff_sees_new_attributes_and_replaced_tensors(copies):
    layer = _Layer()
    before = snapshot_module(layer, copies)
    layer.flag = 2.0
    layer.handle = object()
    layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    diff = diff_snapshots(before, snapshot_module(layer, None))
    assert diff.changed_tensors == {"weight"}
    assert set(diff.changed_attrs) == {("layer", "flag"), ("layer", "handle")}
    # The before-snapshot kept a copy of the raw weight, on disk; its stand-in holds no memory.
    assert before.tensors["weight"].tensor.is_meta
    assert torch.equal(before.tensors["weight"].data(), torch.ones(2, 2))


def test_diff_sees_in_place_changes(copies):
    layer = _Layer()
    before = snapshot_module(layer, copies)
    layer.scale.fill_(3.0)
    diff = diff_snapshots(before, snapshot_module(layer, None))
    assert diff.changed_tensors == {"scale"} and not diff.changed_attrs


def test_diff_sees_removed_tensors_and_attributes(copies):
    layer = _Layer()
    before = snapshot_module(layer, copies)
    del layer.scale
    del layer.flag
    diff = diff_snapshots(before, snapshot_module(layer, None))
    assert diff.removed_tensors == {"scale"} and diff.removed_attrs == {("layer", "flag")}


def test_diff_sees_writes_through_data_that_bump_no_version(copies):
    layer = _Layer()
    before = snapshot_module(layer, copies)
    layer.weight.data.copy_(torch.full((2, 2), 5.0))
    assert diff_snapshots(before, snapshot_module(layer, None)).changed_tensors == {"weight"}


def test_without_a_copy_content_hashes_see_writes_through_data():
    """vLLM 0.33's ``replace_parameter`` copies a same-shaped result into the parameter through ``.data``: no
    version counter moves, and a snapshot of references alone sees the new bytes on both sides. Hashes see it."""
    layer = _Layer()
    by_reference = snapshot_module(layer, None)
    hashed = snapshot_module(layer, None, content_hashes=True)
    assert diff_snapshots(hashed, snapshot_module(layer, None)).empty  # nothing written: nothing changed
    layer.weight.data.copy_(torch.full((2, 2), 5.0))
    assert diff_snapshots(by_reference, snapshot_module(layer, None)).empty  # the blind spot hashes close
    assert diff_snapshots(hashed, snapshot_module(layer, None)).changed_tensors == {"weight"}


def test_add_form_s_recorder_hashes_what_it_does_not_copy():
    from tensorizer_manifest.save.capture import FallbackRecorder

    layer = _Layer()
    recorder = FallbackRecorder(torch.nn.Sequential(layer), {"0"}, "cpu")
    recorder.layer_ready("0", layer)
    assert {name: slot.content_hash is not None for name, slot in recorder.before["0"].tensors.items()} == {
        "weight": True,
        "scale": True,
    }


def test_diff_is_empty_when_nothing_changed(copies):
    layer = _Layer()
    before = snapshot_module(layer, copies)
    assert diff_snapshots(before, snapshot_module(layer, None)).empty


def test_copies_keep_ties_and_store_a_tied_tensor_once(copies):
    a, b = _Layer(), _Layer()
    b.weight = a.weight
    sa, sb = snapshot_module(a, copies), snapshot_module(b, copies)
    assert sa.tensors["weight"].tensor is sb.tensors["weight"].tensor
    assert sa.tensors["weight"].stored is sb.tensors["weight"].stored
    assert sa.tensors["weight"].tensor is not a.weight
    assert copies.spill.count == 3  # a.weight, a.scale, b.scale


def test_a_copy_stands_in_with_the_class_attributes_and_layout_of_a_fresh_clone(copies):
    layer = torch.nn.Module()
    weight = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t()[1:]  # non-contiguous, storage offset
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.weight.output_dim = 0
    slot = snapshot_module(layer, copies).tensors["weight"]
    assert type(slot.tensor) is torch.nn.Parameter and slot.tensor.output_dim == 0
    assert (slot.tensor.dtype, slot.tensor.shape, slot.tensor.stride()) == (weight.dtype, weight.shape, weight.stride())
    assert slot.tensor.storage_offset() == 0 and not slot.tensor.requires_grad
    assert torch.equal(slot.data(), weight)


def test_a_copy_compares_by_bytes_even_when_values_compare_equal(copies):
    layer = _Layer()
    layer.weight.data.copy_(torch.tensor([[0.0, 1.0], [1.0, 1.0]]))
    before = snapshot_module(layer, copies)
    layer.weight.data[0, 0] = -0.0  # == 0.0, other bytes, and no version bump
    assert diff_snapshots(before, snapshot_module(layer, None)).changed_tensors == {"weight"}


class FakeKernel:
    """A double of a vLLM kernel object: recognised by its class name."""


class _QuantMethod:
    def __init__(self):
        self.kernel = FakeKernel()


def test_kernels_and_owners_are_found_on_the_layer_and_its_quant_method():
    layer = _Layer()
    layer.quant_method = _QuantMethod()
    layer.cpu_linear = torch.nn.functional.linear
    kernels = {(k.owner, k.attr): k.kernel_class for k in find_kernels(layer)}
    assert kernels[("quant_method", "kernel")].endswith("FakeKernel")
    assert kernels[("layer", "cpu_linear")] == "torch._C._nn.linear"
    assert set(owners_of(layer)) == {"layer", "quant_method", "quant_method.kernel"}


def test_describe_names_closures_by_their_free_variables():
    handler = object()

    def gemm(x):
        return handler

    assert describe(gemm).endswith("gemm[handler]")
    assert describe(3) == "builtins.int"


def test_post_load_steps_follow_vllms_order():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    class Method(QuantizeMethodBase):  # a double: only its type matters here
        def create_weights(self, *args, **kwargs):
            pass

        def apply(self, *args, **kwargs):
            pass

    model = torch.nn.Module()
    model.a = _Layer()
    model.b = _Layer()
    model.a.quant_method = Method()
    model.b.quant_method = Method()
    model.norm = _Layer()
    assert [(path, kind) for path, _, kind in post_load_steps(model)] == [("a", "quant_method"), ("b", "quant_method")]


def test_model_level_hook_is_refused():
    model = torch.nn.Module()
    model.process_weights_after_loading = lambda: None
    with pytest.raises(UnsupportedModelError, match="model-level post-load hook"):
        refuse_model_level_hook(model)
