"""Rebuilding a running engine's pre-step state (``rebuild``): its pieces without an engine. The claims (a
default-loaded engine saves what the capture path saves; changed weights are refused) are proved on real
vLLM in ``test_e2e_running_engine.py`` and ``test_e2e_serve.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from tensorizer_manifest import rebuild  # noqa: E402


def test_bit_identity_sees_every_bit_and_no_more():
    a = torch.tensor([1.0, float("nan"), -0.0])
    assert rebuild._same(a, a.clone())  # NaN equals itself bit for bit
    assert not rebuild._same(a, torch.tensor([1.0, float("nan"), 0.0]))  # -0.0 is not 0.0
    assert rebuild._same(torch.tensor(2.0), torch.tensor(2.0))  # 0-dim
    assert not rebuild._same(torch.tensor(2.0), torch.tensor([2.0]))  # shape
    assert not rebuild._same(torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float16))
    assert rebuild._same(torch.empty(0), torch.empty(0))
    t = torch.arange(6.0).reshape(2, 3)
    assert rebuild._same(t.t(), t.t().contiguous())  # the values, whatever the strides


class _Method:
    def __init__(self):
        self.kernel = None


def test_attributes_before_the_step_are_kept_without_tensor_containers():
    layer = torch.nn.Linear(2, 2)
    layer.quant_method = _Method()
    layer.flag = "as loaded"
    rebuild.remember_pre_step_attributes(layer)
    layer.flag, layer.quant_method.kernel = "after the step", object()
    before = rebuild._PRE_STEP_ATTRIBUTES[layer]
    assert before["flag"] == "as loaded"
    assert not set(rebuild._CONTAINERS) & set(before)  # tensors are vLLM's record, not copied here
    assert rebuild._PRE_STEP_ATTRIBUTES[layer.quant_method] == {"kernel": None}


def test_a_loader_bound_to_the_live_layer_is_bound_to_its_shadow():
    live, shadow = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    weight.weight_loader = live.extra_repr  # any method of the live layer
    rebound = rebuild._rebind(weight, live, shadow)
    assert rebound.weight_loader.__self__ is shadow


def test_a_large_tensor_held_as_an_attribute_is_not_kept_alive():
    layer = torch.nn.Module()
    layer.small = torch.zeros(4)
    layer.large = torch.zeros(rebuild._MAX_KEPT_TENSOR_BYTES // 4 + 1)  # float32: just over the limit
    rebuild.remember_pre_step_attributes(layer)
    before = rebuild._PRE_STEP_ATTRIBUTES[layer]
    assert "small" in before and "large" not in before
