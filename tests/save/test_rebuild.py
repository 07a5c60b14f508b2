"""Rebuilding a running engine's pre-step state (``rebuild``): its pieces without an engine. The claims (a
default-loaded engine saves what the capture path saves; changed weights are refused) are proved on real
vLLM in ``test_e2e_running_engine.py`` and ``test_e2e_serve.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from tensorizer_manifest.errors import CheckpointNotFoundError, NotReproducibleError, UnsupportedModelError  # noqa: E402
from tensorizer_manifest.save import rebuild  # noqa: E402


class _Kernel:
    """Stands in for a vLLM kernel object: forked, since its module is one of vLLM's layer packages."""

    def __init__(self):
        self.config = {"group": 32}
        self.handle = None

    def run(self):
        return self.handle


class _Method:
    def __init__(self, kernel):
        self.kernel = kernel
        self.linear_method = kernel.run


class _Config:
    """Not one of vLLM's layer packages: shared, never copied."""


for _cls in (_Kernel, _Method):
    _cls.__module__ = "vllm.model_executor.layers.test_doubles"


def test_the_state_before_the_step_is_a_private_copy_the_step_cannot_reach():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    config = _Config()
    for layer in model:
        layer.quant_method = _Method(_Kernel())
        layer.config = config
        layer.flag = "as loaded"
    model[1].quant_method.kernel = model[0].quant_method.kernel  # shared by two layers
    rebuild.remember_pre_step_attributes(model)
    live = model[0].quant_method
    model[0].flag, live.kernel.handle = "after the step", object()  # what vLLM's step does to the live layer
    before = rebuild._PRE_STEP_ATTRIBUTES[model[0]]
    assert before["flag"] == "as loaded"
    assert not set(rebuild._CONTAINERS) & set(before)  # tensors are vLLM's record, not copied here
    assert before["quant_method"] is not live and before["quant_method"].kernel is not live.kernel
    assert before["quant_method"].kernel.handle is None  # as before the step, whatever the step set
    assert before["config"] is config  # configs are shared
    # a shadow gets its own copies again, so that its step changes neither the engine nor the record
    memo: dict = {}
    shadows = [rebuild.fork_state(rebuild._PRE_STEP_ATTRIBUTES[layer], memo) for layer in model]
    kernel = shadows[0]["quant_method"].kernel
    assert kernel is not before["quant_method"].kernel and kernel is not live.kernel
    assert shadows[1]["quant_method"].kernel is kernel  # shared in the engine, shared in the shadow
    assert shadows[0]["quant_method"].linear_method.__self__ is kernel  # bound methods follow their object
    kernel.handle = "the shadow's"
    assert live.kernel.handle != "the shadow's" and before["quant_method"].kernel.handle is None


def test_a_loader_bound_to_the_live_layer_is_bound_to_its_shadow():
    live, shadow = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    weight.weight_loader = live.extra_repr  # any method of the live layer
    rebound = rebuild._rebind(weight, live, shadow)
    assert rebound.weight_loader.__self__ is shadow


def test_a_large_tensor_held_before_the_step_is_not_kept_alive_and_its_loss_is_named():
    layer = torch.nn.Module()
    layer.small = torch.zeros(4)
    layer.large = torch.zeros(rebuild._MAX_KEPT_TENSOR_BYTES // 4 + 1)  # float32: just over the limit
    layer.nested = [torch.zeros(rebuild._MAX_KEPT_TENSOR_BYTES // 4 + 1)]  # inside a list, likewise
    rebuild.remember_pre_step_attributes(layer)
    before = rebuild._PRE_STEP_ATTRIBUTES[layer]
    assert before["small"] is layer.small
    assert isinstance(before["large"], rebuild._Released) and isinstance(before["nested"][0], rebuild._Released)
    assert rebuild.fork_state(before["large"], {}) is layer.large  # still alive: the same tensor
    layer.nested = None  # the step replaced it: nothing keeps it
    with pytest.raises(NotReproducibleError, match="is gone"):
        rebuild.fork_state(before, {})


def test_a_layer_quantized_online_is_refused_before_anything_is_rebuilt():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].quant_method = type("OnlineMethod", (), {"uses_meta_device": True})()
    with pytest.raises(UnsupportedModelError, match=r"^0: .*online quantization"):
        rebuild._refuse_online_quantization(model)


def test_a_source_shard_gone_after_the_first_weight_is_a_typed_error():
    class Loader:
        def get_all_weights(self, model_config, model):
            yield "model.embed_tokens.weight", torch.zeros(2)
            raise FileNotFoundError("model-00002-of-00002.safetensors")

    config = type("ModelConfig", (), {"model": "/models/m"})()
    weights = rebuild._source_weights(Loader(), config, None)
    assert next(weights)[0] == "model.embed_tokens.weight"
    with pytest.raises(CheckpointNotFoundError, match=r"cannot be read \(model-00002-of-00002"):
        next(weights)


def test_the_tensors_an_attention_impl_keeps_must_be_the_rebuilt_bytes():
    """MLA on AMX computes with ``_w_uk_packed``/``_w_uv_packed`` on its impl, not with kv_b_proj's (released)
    weight: a difference there is a changed engine, refused; equal bytes, or no impl, pass."""

    class Impl:
        pass

    def attention(packed: torch.Tensor) -> torch.nn.Module:
        module = torch.nn.Module()
        module.impl = Impl()
        module.impl._w_uk_packed, module.impl.scale = packed, 1.0
        return module

    live = attention(torch.arange(8, dtype=torch.bfloat16))
    same = rebuild._Layer("model.layers.0.self_attn.attn", live, attention(torch.arange(8, dtype=torch.bfloat16)))
    rebuild.Rebuilder._compare_impl_tensors(same)
    rebuild.Rebuilder._compare_impl_tensors(rebuild._Layer("x", torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    changed = attention(torch.arange(8, dtype=torch.bfloat16))
    changed.impl._w_uk_packed[3] = 100
    with pytest.raises(NotReproducibleError, match=r"self_attn\.attn: the attention kernel's _w_uk_packed differs"):
        rebuild.Rebuilder._compare_impl_tensors(rebuild._Layer("model.layers.0.self_attn.attn", live, changed))
    missing = attention(torch.arange(8, dtype=torch.bfloat16))
    del missing.impl._w_uk_packed
    with pytest.raises(NotReproducibleError, match="_w_uk_packed"):
        rebuild.Rebuilder._compare_impl_tensors(rebuild._Layer("a", live, missing))
