"""The restorer registry: the declared asking order, module names, restorer names, and why none covers a layer.

Also the logic of the GPU restorers (``cuda_wna16``, ``cuda_fp8_linear``, ``cuda_fused_moe``,
``modelopt_nvfp4_linear``) on CPU: ``covers`` accepting exactly the expected diff and refusing extras,
``form`` values, ``replay`` setting attributes. Their layers are doubles (``torch.nn.Module``) holding
real vLLM quant-method and kernel objects made with ``object.__new__`` (their constructors need a
GPU), with the attributes vLLM's constructors would set. None of this runs a GPU kernel, a real
post-load step or a real pre-processed branch (that is stubbed): it proves the bookkeeping, not that a
layer restored this way computes what vLLM's own step gives. Those restorers stay unverified
(``verified_on`` empty; see docs/kernels.md).
"""

from __future__ import annotations

import pkgutil

import pytest
import torch

import tensorizer_manifest.restorers as restorers
from tensorizer_manifest.format.schema import qualified_class
from tensorizer_manifest.live_model.layers import LayerDiff
from tensorizer_manifest.restorers import (
    BUILT_IN_MODULES,
    RESTORERS,
    Restorer,
    find_restorer,
    known_replays,
    register,
    undeclared_overlaps,
)

pytest.importorskip("vllm")

#: (asked first, asked after it): the built-ins that may apply to one layer, each pair declared by the later. The
#: first restorer that covers a layer wins, so this is the part of the order that decides a choice: turning a
#: pair round changes behaviour (and fails the import, ``undeclared_overlaps``).
PRIORITY = {
    ("attention_scales", "mla_attention"),
    ("cpu_unquantized_moe", "cuda_fused_moe"),
    ("cpu_wna16", "cuda_wna16"),
}


def _built_ins() -> list[Restorer]:
    return [r for r in RESTORERS.values() if type(r).__module__.startswith(f"{restorers.__name__}.")]


def test_built_ins_are_asked_in_the_declared_order_and_declare_every_overlap():
    modules = [type(r).__module__.rsplit(".", 1)[-1] for r in _built_ins()]
    assert list(dict.fromkeys(modules)) == list(BUILT_IN_MODULES)  # registered in that order, nothing scanned
    assert list(RESTORERS)[: len(modules)] == [r.name for r in _built_ins()]  # and asked before any added one
    order = list(RESTORERS)
    assert all(order.index(first) < order.index(then) for first, then in PRIORITY)
    assert {(earlier, r.name) for r in RESTORERS.values() for earlier in r.asked_after} == PRIORITY
    assert all(r.asked_after[earlier] for r in RESTORERS.values() for earlier in r.asked_after)  # with the rule
    assert undeclared_overlaps(RESTORERS.values()) == []


def test_every_module_is_listed_and_named_after_the_restorer_it_registers():
    modules = {m.name for m in pkgutil.iter_modules(restorers.__path__)} - {"base", "inventory"}
    assert modules == set(BUILT_IN_MODULES)
    by_module: dict[str, list[str]] = {}
    for restorer in RESTORERS.values():
        by_module.setdefault(type(restorer).__module__.rsplit(".", 1)[-1], []).append(restorer.name)
    families = {"cpu_moe": ["cpu_unquantized_moe", "cpu_fp8_moe", "cpu_int8_moe"]}  # one story, see its docstring
    assert {module: by_module[module] for module in BUILT_IN_MODULES} == {
        module: families.get(module, [module]) for module in BUILT_IN_MODULES
    }


def test_an_overlap_without_a_declared_order_is_refused():
    class Early(Restorer):
        name = "early"
        handles = ("vllm.A", "vllm.B")

    class Late(Restorer):
        name = "late"
        handles = ("vllm.B",)

    class Declared(Late):
        asked_after = {"early": "the kernel tells them apart"}

    (problem,) = undeclared_overlaps([Early(), Late()])
    assert "early and late both handle ['vllm.B']" in problem
    assert undeclared_overlaps([Early(), Declared()]) == []
    turned_round = undeclared_overlaps([Declared(), Early()])  # the declared order no longer holds
    assert "late is declared to be asked after early, which is not asked before it" in turned_round[0]
    assert "early does not declare" in turned_round[1]
    swapped = _built_ins()
    cpu, cuda = swapped.index(RESTORERS["cpu_wna16"]), swapped.index(RESTORERS["cuda_wna16"])
    swapped[cpu], swapped[cuda] = swapped[cuda], swapped[cpu]
    assert len(undeclared_overlaps(swapped)) == 2  # cuda_wna16's rule names a later one; cpu_wna16 declares none


def test_an_added_restorer_is_asked_after_every_built_in():
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    class EveryLinear(Restorer):
        name = "test_every_linear"
        handles = ("vllm.model_executor.layers.linear.UnquantizedLinearMethod",)  # cpu_unquantized_gemm's too

        def applies_to(self, module):
            return isinstance(module, torch.nn.Linear)

        def covers(self, module, diff):
            return None

    added = register(EveryLinear())
    try:
        assert list(RESTORERS)[-1] == "test_every_linear"
        layer = torch.nn.Linear(2, 2)
        layer.quant_method = UnquantizedLinearMethod()
        dispatch = LayerDiff(changed_attrs={("layer", "cpu_linear"): print})
        assert find_restorer(layer, dispatch)[0] is RESTORERS["cpu_unquantized_gemm"]  # a built-in that covers wins
        assert find_restorer(layer, LayerDiff(changed_tensors={"weight"}))[0] is added  # else the added one
    finally:
        del RESTORERS["test_every_linear"]


def test_names_are_unique_and_cannot_shadow_replay_values():
    class Again(Restorer):
        name = "cpu_unquantized_gemm"

    class PostLoad(Restorer):
        name = "post_load"

    for cls in (Again, PostLoad):
        with pytest.raises(ValueError, match="is taken"):
            register(cls())
    assert known_replays() == {"post_load", "none", *RESTORERS}


def test_a_layer_no_restorer_applies_to_gets_a_reason():
    restorer, why = find_restorer(torch.nn.Linear(2, 2), LayerDiff(changed_tensors={"weight"}))
    assert restorer is None and "no restorer for Linear" in why


def test_cpu_gemm_restorer_refuses_a_packed_weight_and_covers_the_dispatch_alone():
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    cpu_gemm = RESTORERS["cpu_unquantized_gemm"]
    layer = torch.nn.Linear(2, 2)
    layer.quant_method = UnquantizedLinearMethod()
    assert cpu_gemm.applies_to(layer)
    packed = LayerDiff(changed_tensors={"weight"}, changed_attrs={("layer", "cpu_linear"): print})
    assert "oneDNN" in cpu_gemm.covers(layer, packed)
    assert cpu_gemm.covers(layer, LayerDiff(changed_attrs={("layer", "cpu_linear"): print})) is None
    extra = LayerDiff(changed_attrs={("layer", "cpu_linear"): print, ("layer", "handle"): object()})
    assert "handle" in cpu_gemm.covers(layer, extra)


def test_attention_restorer_derives_floats_from_the_saved_buffers():
    attention = RESTORERS["attention_scales"]
    layer = torch.nn.Module()
    layer.register_buffer("_k_scale", torch.tensor(0.125))
    layer.register_buffer("_v_scale", torch.tensor(0.5))
    attention.replay(layer, None)
    assert layer._k_scale_float == 0.125 and layer._v_scale_float == 0.5
    assert torch.equal(layer._k_scale_cpu, torch.tensor(0.125))
    assert "added tensors" in attention.covers(layer, LayerDiff(added_tensors={"azp_adj"}))


# --- GPU restorers, on doubles ------------------------------------------------------------------


def _bare(cls, **attrs):
    """A real vLLM object without its constructor (which needs a GPU), with the attributes it would set."""
    obj = object.__new__(cls)
    for key, value in attrs.items():
        setattr(obj, key, value)
    return obj


@pytest.fixture
def pre_processed_calls(monkeypatch):
    """Stub vLLM's pre-processed branch (a real one would need the layer's GPU kernel); record the calls."""
    from tensorizer_manifest import _vllm_compat

    calls = []
    monkeypatch.setattr(_vllm_compat, "run_pre_processed_step", lambda qm, layer: calls.append((qm, layer)))
    return calls


def _mp_layer(kernel_cls, *, act_type=torch.bfloat16, zero_points=False, group_size=128, w_zp_name=None):
    from vllm.model_executor.kernels.linear.mixed_precision import MPLinearLayerConfig
    from vllm.scalar_type import scalar_types

    config = MPLinearLayerConfig((256, 64), (256, 64), scalar_types.uint4b8, act_type, group_size, zero_points)
    kernel = _bare(kernel_cls, config=config, w_q_name="weight_packed", w_s_name="weight_scale", w_zp_name=w_zp_name)
    layer = torch.nn.Module()
    layer.quant_method = type("Method", (), {})()
    layer.quant_method.kernel = kernel
    return layer, kernel


def test_cuda_wna16_marlin_covers_its_flags_and_the_empty_zero_points():
    from vllm.model_executor.kernels.linear.mixed_precision import MarlinLinearKernel

    restorer = RESTORERS["cuda_wna16"]
    layer, kernel = _mp_layer(MarlinLinearKernel)
    assert restorer.applies_to(layer)
    assert restorer.form(layer) == {
        "kernel": "vllm.model_executor.kernels.linear.mixed_precision.marlin.MarlinLinearKernel",
        "act_type": "torch.bfloat16",
        "capability": None,  # no GPU here
    }
    assert restorer.creates_tensors(layer) == {"w_zp"}
    kernel.w_zp_name = "w_zp"  # what the step set
    step = LayerDiff(
        changed_tensors={"weight_packed", "weight_scale"},
        added_tensors={"w_zp"},
        changed_attrs={("quant_method.kernel", "w_zp_name"): "w_zp", ("layer", "input_global_scale"): None},
    )
    assert restorer.covers(layer, step) is None
    extra = LayerDiff(changed_attrs={**step.changed_attrs, ("layer", "workspace"): torch.zeros(1)})
    assert "workspace" in restorer.covers(layer, extra)
    assert "added tensors" in restorer.covers(layer, LayerDiff(added_tensors={"w_zp", "g_idx_sort_indices"}))
    assert "does not own" in restorer.covers(layer, LayerDiff(changed_tensors={"weight_packed", "g_idx"}))
    wrong = LayerDiff(changed_attrs={("layer", "input_global_scale"): torch.ones(1)})
    assert "not None" in restorer.covers(layer, wrong)

    fresh, fresh_kernel = _mp_layer(MarlinLinearKernel)
    restorer.replay(fresh, None)
    assert fresh_kernel.w_zp_name == "w_zp" and fresh.input_global_scale is None


def test_cuda_wna16_marlin_int8_activations_keep_their_global_scale_tensor():
    from vllm.model_executor.kernels.linear.mixed_precision import MarlinLinearKernel

    restorer = RESTORERS["cuda_wna16"]
    layer, _ = _mp_layer(MarlinLinearKernel, act_type=torch.int8, zero_points=True, w_zp_name="qzeros")
    assert restorer.creates_tensors(layer) == {"input_global_scale"}
    assert restorer.covers(layer, LayerDiff(added_tensors={"input_global_scale"}, changed_tensors={"qzeros"})) is None
    assert "input_global_scale" in restorer.covers(
        layer, LayerDiff(changed_attrs={("layer", "input_global_scale"): None})
    )
    restorer.replay(layer, None)
    assert "input_global_scale" not in vars(layer)  # the saved tensor stays; replay sets no None over it


def test_cuda_wna16_machete_rebuilds_nothing_and_refuses_any_state():
    from vllm.model_executor.kernels.linear.mixed_precision import MacheteLinearKernel

    restorer = RESTORERS["cuda_wna16"]
    layer, _ = _mp_layer(MacheteLinearKernel)
    assert restorer.form(layer)["kernel"].endswith("machete.MacheteLinearKernel")
    assert restorer.creates_tensors(layer) == set()
    assert restorer.covers(layer, LayerDiff(changed_tensors={"weight_packed", "weight_scale"})) is None
    assert "w_zp_name" in restorer.covers(
        layer, LayerDiff(changed_attrs={("quant_method.kernel", "w_zp_name"): "w_zp"})
    )
    before = dict(vars(layer))
    restorer.replay(layer, None)
    assert vars(layer) == before


def _fp8_layer(kernel, *, act_q_static=False, output_size=96):
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    layer = torch.nn.Module()
    layer.quant_method = _bare(Fp8LinearMethod, act_q_static=act_q_static, fp8_linear=kernel)
    layer.output_size_per_partition = output_size
    return layer


def test_cuda_fp8_linear_fills_cutlass_logical_output_size(pre_processed_calls):
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFP8ScaledMMLinearKernel

    restorer = RESTORERS["cuda_fp8_linear"]
    kernel = _bare(CutlassFP8ScaledMMLinearKernel, logical_output_size=None)
    layer = _fp8_layer(kernel)
    assert restorer.applies_to(layer)
    assert restorer.form(layer) == {
        "kernel": "vllm.model_executor.kernels.linear.scaled_mm.cutlass.CutlassFP8ScaledMMLinearKernel",
        "deep_gemm_e8m0": None,
        "capability": None,
    }
    step = LayerDiff(
        changed_tensors={"weight", "weight_scale"},
        changed_attrs={("layer", "input_scale"): None, ("quant_method.fp8_linear", "logical_output_size"): 96},
    )
    assert restorer.covers(layer, step) is None
    padded = LayerDiff(changed_attrs={("quant_method.fp8_linear", "logical_output_size"): 112})
    assert "not 96" in restorer.covers(layer, padded)
    assert "azp_adj" in restorer.covers(layer, LayerDiff(added_tensors={"azp_adj"}))
    assert "handle" in restorer.covers(layer, LayerDiff(changed_attrs={("layer", "handle"): object()}))

    restorer.replay(layer, None)
    assert pre_processed_calls == [(layer.quant_method, layer)]  # vLLM's own branch first
    assert kernel.logical_output_size == 96 and layer.input_scale is None


def test_cuda_fp8_linear_static_activations_set_no_input_scale(pre_processed_calls):
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import PerTensorTorchFP8ScaledMMLinearKernel

    restorer = RESTORERS["cuda_fp8_linear"]
    layer = _fp8_layer(_bare(PerTensorTorchFP8ScaledMMLinearKernel), act_q_static=True)
    assert restorer.covers(layer, LayerDiff(changed_tensors={"weight", "weight_scale", "input_scale"})) is None
    assert "input_scale" in restorer.covers(layer, LayerDiff(changed_attrs={("layer", "input_scale"): None}))
    restorer.replay(layer, None)
    assert "input_scale" not in vars(layer)


def test_cuda_fp8_linear_fills_deep_gemm_warmup_provider(pre_processed_calls):
    from vllm.model_executor.kernels.linear.scaled_mm.deep_gemm import DeepGemmFp8BlockScaledMMKernel

    restorer = RESTORERS["cuda_fp8_linear"]
    kernel = _bare(DeepGemmFp8BlockScaledMMKernel, use_deep_gemm_e8m0=True)
    layer = _fp8_layer(kernel)
    assert restorer.form(layer)["deep_gemm_e8m0"] is True
    step = LayerDiff(
        changed_tensors={"weight", "weight_scale_inv"},
        changed_attrs={("layer", "input_scale"): None, ("layer", "deep_gemm_warmup_provider"): kernel},
    )
    assert restorer.covers(layer, step) is None
    other = LayerDiff(changed_attrs={("layer", "deep_gemm_warmup_provider"): object()})
    assert "deep_gemm_warmup_provider" in restorer.covers(layer, other)
    restorer.replay(layer, None)
    assert layer.deep_gemm_warmup_provider is kernel


def test_cuda_fp8_linear_leaves_cpu_and_stateful_kernels_alone():
    from vllm.model_executor.kernels.linear.scaled_mm.marlin import MarlinFP8ScaledMMLinearKernel

    restorer = RESTORERS["cuda_fp8_linear"]
    assert not restorer.applies_to(_fp8_layer(_bare(MarlinFP8ScaledMMLinearKernel)))
    assert not restorer.applies_to(torch.nn.Linear(2, 2))


def test_cpu_fp8_linear_covers_the_packed_block_kernel_alone():
    """The bookkeeping; ``test_e2e_families`` (kind fp8-block, AMX) proves the layers token-exact and bitwise."""
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import (
        CPUFp8BlockScaledMMKernel,
        CPUFp8PerTensorScaledMMLinearKernel,
        CPUFp8W8A8BlockScaledMMKernel,
    )

    restorer = RESTORERS["cpu_fp8_linear"]
    layer = _fp8_layer(_bare(CPUFp8BlockScaledMMKernel))
    assert restorer.applies_to(layer) and restorer.verified_for("cpu")
    assert restorer.form(layer) == {"kernel": qualified_class(CPUFp8BlockScaledMMKernel), "packed": True}
    layer._cpu_skip_gemm_dispatch = True  # MLA's kv_b_proj: the step leaves it unpacked
    assert restorer.form(layer)["packed"] is False
    step = LayerDiff(changed_tensors={"weight", "weight_scale_inv"}, changed_attrs={("layer", "input_scale"): None})
    assert restorer.covers(layer, step) is None
    assert "input_scale" in restorer.covers(layer, LayerDiff(changed_attrs={("layer", "input_scale"): 1.0}))
    assert "bias_fp32" in restorer.covers(layer, LayerDiff(added_tensors={"bias_fp32"}))
    assert "_block_size_n" in restorer.covers(
        layer, LayerDiff(changed_attrs={("quant_method.fp8_linear", "_block_size_n"): 512})
    )
    restorer.replay(layer, None)
    assert layer.input_scale is None
    # kept state on the kernel (_block_size_n), or packed scales never run here: those layers save raw
    for other in (CPUFp8PerTensorScaledMMLinearKernel, CPUFp8W8A8BlockScaledMMKernel):
        assert not restorer.applies_to(_fp8_layer(_bare(other)))
    assert not RESTORERS["cuda_fp8_linear"].applies_to(layer)


def test_cpu_fp8_moe_covers_the_amx_backend_and_its_experts_alone():
    """The bookkeeping; ``test_e2e_families`` (kind qwen3-moe-fp8, AMX) proves the experts token-exact and bitwise."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsFp8, CPUExpertsFp8W8A8
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    restorer = RESTORERS["cpu_fp8_moe"]
    layer = _moe_layer(Fp8MoEMethod, "fp8_backend", Fp8MoeBackend.CPU, CPUExpertsFp8)
    assert restorer.applies_to(layer)
    layer.quant_method.moe_kernel = type("Kernel", (), {"fused_experts": _bare(CPUExpertsFp8)})()
    step = LayerDiff(
        changed_tensors={"w13_weight", "w2_weight"},
        changed_attrs={("quant_method", "moe_kernel"): object(), ("quant_method", "moe_quant_config"): object()},
    )
    assert restorer.covers(layer, step) is None
    assert "state no restorer rebuilds" in restorer.covers(layer, LayerDiff(changed_attrs={("layer", "x"): 1}))
    assert "added or removed" in restorer.covers(layer, LayerDiff(added_tensors={"w13_scale_packed"}))
    assert restorer.covers(layer, LayerDiff(changed_tensors={"w13_weight", "w13_weight_scale_inv"})) is None
    assert "changed tensors ['w13_bias']" in restorer.covers(layer, LayerDiff(changed_tensors={"w13_bias"}))
    layer.quant_method.moe_kernel.fused_experts = object()
    assert "not CPUExpertsFp8" in restorer.covers(layer, step)
    assert not restorer.applies_to(_moe_layer(Fp8MoEMethod, "fp8_backend", Fp8MoeBackend.CPU_W8A8, CPUExpertsFp8W8A8))
    assert not restorer.applies_to(_moe_layer(Fp8MoEMethod, "fp8_backend", Fp8MoeBackend.TRITON, CPUExpertsFp8))


def test_cpu_int8_moe_covers_the_amx_experts_and_builds_the_kernel_without_their_step(monkeypatch):
    """The bookkeeping; ``test_e2e_families`` (kind qwen3-moe-w8a8, AMX) proves the experts token-exact and bitwise."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt8, ZenCPUExpertsInt8
    from vllm.model_executor.layers.fused_moe.oracle.int8 import Int8MoeBackend
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w8a8_int8 as int8,
    )

    from tensorizer_manifest import _vllm_compat

    restorer = RESTORERS["cpu_int8_moe"]
    method = int8.CompressedTensorsW8A8Int8MoEMethod
    layer = _moe_layer(method, "int8_backend", Int8MoeBackend.CPU, CPUExpertsInt8)
    assert restorer.applies_to(layer) and restorer.form(layer) == {"experts_class": qualified_class(CPUExpertsInt8)}
    assert not restorer.applies_to(_moe_layer(method, "int8_backend", Int8MoeBackend.CPU, ZenCPUExpertsInt8))
    layer.quant_method.moe_kernel = type("Kernel", (), {"fused_experts": _bare(CPUExpertsInt8)})()
    step = LayerDiff(
        changed_tensors={"w13_weight", "w2_weight"},
        changed_attrs={("quant_method", "moe_kernel"): object(), ("quant_method", "moe_quant_config"): object()},
    )
    assert restorer.covers(layer, step) is None
    assert "w13_weight_scale" in restorer.covers(layer, LayerDiff(changed_tensors={"w13_weight_scale"}))
    calls = []
    monkeypatch.setattr(_vllm_compat, "build_int8_moe_kernel", lambda qm, module: calls.append((qm, module)))
    restorer.replay(layer, None)
    assert calls == [(layer.quant_method, layer)]


def _moe_layer(method_cls, backend_attr, backend, experts_cls):
    layer = torch.nn.Module()
    layer.quant_method = _bare(method_cls, experts_cls=experts_cls, **{backend_attr: backend})
    return layer


def test_cuda_fused_moe_covers_the_kernel_on_triton_and_deep_gemm(pre_processed_calls):
    from vllm.model_executor.layers.fused_moe.experts.deep_gemm_moe import DeepGemmExperts
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    restorer = RESTORERS["cuda_fused_moe"]
    unquantized = _moe_layer(
        UnquantizedFusedMoEMethod, "unquantized_backend", UnquantizedMoeBackend.TRITON, TritonExperts
    )
    fp8 = _moe_layer(Fp8MoEMethod, "fp8_backend", Fp8MoeBackend.DEEPGEMM, DeepGemmExperts)
    step = LayerDiff(
        changed_tensors={"w13_weight", "w2_weight"},
        changed_attrs={
            ("quant_method", "moe_kernel"): object(),
            ("quant_method", "moe_quant_config"): object(),
            ("quant_method.moe_kernel", "impl"): object(),
        },
    )
    for layer in (unquantized, fp8):
        assert restorer.applies_to(layer)
        assert restorer.covers(layer, step) is None
        assert "w13_input_scale" in restorer.covers(layer, LayerDiff(added_tensors={"w13_input_scale"}))
        extra = LayerDiff(changed_attrs={**step.changed_attrs, ("layer", "workspace"): object()})
        assert "workspace" in restorer.covers(layer, extra)
        restorer.replay(layer, None)
    assert pre_processed_calls == [(unquantized.quant_method, unquantized), (fp8.quant_method, fp8)]
    assert restorer.form(fp8) == {
        "method": "vllm.model_executor.layers.quantization.fp8.Fp8MoEMethod",
        "backend": "DEEPGEMM",
        "experts_class": "vllm.model_executor.layers.fused_moe.experts.deep_gemm_moe.DeepGemmExperts",
        "capability": None,
    }


def test_cuda_fused_moe_leaves_other_backends_and_experts_with_a_step_raw():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import CutlassExpertsFp8
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_cutlass_moe import FlashInferExperts
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    restorer = RESTORERS["cuda_fused_moe"]
    for backend in (UnquantizedMoeBackend.CPU, UnquantizedMoeBackend.FLASHINFER_TRTLLM):
        layer = _moe_layer(UnquantizedFusedMoEMethod, "unquantized_backend", backend, CPUUnquantizedExperts)
        assert not restorer.applies_to(layer)
    assert not restorer.applies_to(_moe_layer(Fp8MoEMethod, "fp8_backend", Fp8MoeBackend.FLASHINFER_CUTLASS, None))
    assert (
        restorer.covers(
            _moe_layer(Fp8MoEMethod, "fp8_backend", Fp8MoeBackend.VLLM_CUTLASS, CutlassExpertsFp8), LayerDiff()
        )
        is None
    )
    with_step = _moe_layer(Fp8MoEMethod, "fp8_backend", Fp8MoeBackend.VLLM_CUTLASS, FlashInferExperts)  # a double
    assert "post-load step of its own" in restorer.covers(with_step, LayerDiff())


def _nvfp4_layer(kernel_cls, *, w4a16, weight_width=40, input_size=64):
    from vllm.config.quantization import QuantSpec
    from vllm.model_executor.layers.quantization.modelopt import FormatScheme, ModelOptLinearMethod
    from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Dynamic, kNvfp4Static

    spec = QuantSpec(weight=kNvfp4Static, activation=None if w4a16 else kNvfp4Dynamic)
    layer = torch.nn.Module()
    layer.quant_method = _bare(ModelOptLinearMethod, spec=spec, fmt=FormatScheme(), kernel=_bare(kernel_cls))
    layer.register_parameter("weight", torch.nn.Parameter(torch.zeros(8, weight_width, dtype=torch.uint8), False))
    layer.input_size_per_partition = input_size
    return layer


def test_modelopt_nvfp4_fills_is_w4a16_and_the_padding_width(pre_processed_calls):
    from vllm.model_executor.kernels.linear.nvfp4.pytorch import TorchNvFp4LinearKernel

    restorer = RESTORERS["modelopt_nvfp4_linear"]
    layer = _nvfp4_layer(TorchNvFp4LinearKernel, w4a16=True)
    assert restorer.applies_to(layer)
    assert restorer.form(layer) == {
        "kernel": "vllm.model_executor.kernels.linear.nvfp4.pytorch.TorchNvFp4LinearKernel",
        "w4a16": True,
        "capability": None,
    }
    assert restorer.creates_tensors(layer) == {"weight_global_scale"}
    step = LayerDiff(
        changed_tensors={"weight", "weight_scale"},
        added_tensors={"weight_global_scale"},
        removed_tensors={"weight_scale_2"},
        changed_attrs={("layer", "is_w4a16_nvfp4"): True, ("layer", "weights_padding_cols"): 8},  # 40 - 64 // 2
    )
    assert restorer.covers(layer, step) is None
    wrong = LayerDiff(changed_attrs={("layer", "weights_padding_cols"): 0})
    assert "not 8" in restorer.covers(layer, wrong)
    assert "alpha" in restorer.covers(layer, LayerDiff(added_tensors={"alpha"}))
    restorer.replay(layer, None)
    assert pre_processed_calls == [(layer.quant_method, layer)]
    assert layer.is_w4a16_nvfp4 is True and layer.weights_padding_cols == 8


def test_modelopt_nvfp4_w4a4_creates_its_scales_and_sets_no_padding(pre_processed_calls):
    from vllm.model_executor.kernels.linear.nvfp4.cutlass import CutlassNvFp4LinearKernel

    restorer = RESTORERS["modelopt_nvfp4_linear"]
    layer = _nvfp4_layer(CutlassNvFp4LinearKernel, w4a16=False)
    assert restorer.creates_tensors(layer) == {
        "weight_global_scale",
        "input_global_scale",
        "input_global_scale_inv",
        "alpha",
    }
    step = LayerDiff(
        changed_tensors={"weight", "weight_scale"},
        added_tensors=restorer.creates_tensors(layer),
        removed_tensors={"weight_scale_2", "input_scale"},
        changed_attrs={("layer", "is_w4a16_nvfp4"): False},
    )
    assert restorer.covers(layer, step) is None
    assert "weights_padding_cols" in restorer.covers(
        layer, LayerDiff(changed_attrs={("layer", "weights_padding_cols"): 0})
    )
    layer._retain_weight_for_gather = True
    assert "gather" in restorer.covers(layer, step)
    restorer.replay(layer, None)
    assert layer.is_w4a16_nvfp4 is False and not hasattr(layer, "weights_padding_cols")


def test_modelopt_nvfp4_leaves_b12x_alone():
    from vllm.model_executor.kernels.linear.nvfp4.b12x import B12xNvFp4LinearKernel

    assert not RESTORERS["modelopt_nvfp4_linear"].applies_to(_nvfp4_layer(B12xNvFp4LinearKernel, w4a16=False))


def test_gpu_restorers_are_unverified_and_apply_to_nothing_on_a_cpu_model():
    gpu = ("cuda_wna16", "cuda_fp8_linear", "cuda_fused_moe", "modelopt_nvfp4_linear")
    for name in gpu:
        assert RESTORERS[name].verified_on == frozenset()
        assert not RESTORERS[name].verified_for("cpu") and not RESTORERS[name].verified_for("cuda")
        assert RESTORERS[name].handles and RESTORERS[name].rebuilds
        assert not RESTORERS[name].applies_to(torch.nn.Linear(2, 2))


def test_run_pre_processed_step_refuses_a_method_without_the_branch():
    from tensorizer_manifest import _vllm_compat
    from tensorizer_manifest.errors import UnsupportedModelError

    class NoBranch:
        supports_pre_processed_weights = False

    with pytest.raises(UnsupportedModelError, match="supports_pre_processed_weights"):
        _vllm_compat.run_pre_processed_step(NoBranch(), torch.nn.Module())

    seen = []

    class Branch:
        supports_pre_processed_weights = True

        def process_weights_after_loading(self, layer):
            from vllm.model_executor.utils import is_weights_pre_processed

            seen.append(is_weights_pre_processed())

    _vllm_compat.run_pre_processed_step(Branch(), torch.nn.Module())
    assert seen == [True]


def test_each_kind_of_layer_is_claimed_as_declared():
    """The restorers that apply to each kind of layer the doubles here stand for (MLA's: ``test_restorer_mla``),
    in asking order. Where two apply, the later must declare the earlier (``asked_after``): a restorer that starts
    applying to another's layers without a declared rule fails here."""
    from vllm.model_executor.kernels.linear.mixed_precision import MacheteLinearKernel, MarlinLinearKernel
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
    from vllm.model_executor.kernels.linear.nvfp4.pytorch import TorchNvFp4LinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFP8ScaledMMLinearKernel
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        CPUExpertsFp8,
        CPUExpertsInt8,
        CPUUnquantizedExperts,
    )
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.int8 import Int8MoeBackend
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w8a8_int8 as int8,
    )
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    linear, embedding = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    linear.quant_method, embedding.quant_method = UnquantizedLinearMethod(), UnquantizedEmbeddingMethod()
    unquantized_moe = (UnquantizedFusedMoEMethod, "unquantized_backend")
    layers = {
        "attention": (_bare(Attention), ["attention_scales"]),
        "unquantized linear": (linear, ["cpu_unquantized_gemm"]),
        "unquantized embedding": (embedding, ["cpu_unquantized_gemm"]),
        "wna16 on cpu": (_mp_layer(CPUWNA16LinearKernel)[0], ["cpu_wna16"]),
        "wna16 on marlin": (_mp_layer(MarlinLinearKernel)[0], ["cuda_wna16"]),
        "wna16 on machete": (_mp_layer(MacheteLinearKernel)[0], ["cuda_wna16"]),
        "fp8 block on cpu": (_fp8_layer(_bare(CPUFp8BlockScaledMMKernel)), ["cpu_fp8_linear"]),
        "fp8 on cutlass": (_fp8_layer(_bare(CutlassFP8ScaledMMLinearKernel)), ["cuda_fp8_linear"]),
        "moe on cpu": (
            _moe_layer(*unquantized_moe, UnquantizedMoeBackend.CPU, CPUUnquantizedExperts),
            ["cpu_unquantized_moe"],
        ),
        "moe on triton": (
            _moe_layer(*unquantized_moe, UnquantizedMoeBackend.TRITON, TritonExperts),
            ["cuda_fused_moe"],
        ),
        "fp8 moe on cpu": (_moe_layer(Fp8MoEMethod, "fp8_backend", Fp8MoeBackend.CPU, CPUExpertsFp8), ["cpu_fp8_moe"]),
        "int8 moe on cpu": (
            _moe_layer(int8.CompressedTensorsW8A8Int8MoEMethod, "int8_backend", Int8MoeBackend.CPU, CPUExpertsInt8),
            ["cpu_int8_moe"],
        ),
        "nvfp4": (_nvfp4_layer(TorchNvFp4LinearKernel, w4a16=True), ["modelopt_nvfp4_linear"]),
    }
    for what, (layer, expected) in layers.items():
        claimants = [r for r in RESTORERS.values() if r.applies_to(layer)]
        assert [r.name for r in claimants] == expected, what
        for i, later in enumerate(claimants):
            for earlier in claimants[:i]:
                assert earlier.name in later.asked_after, f"{what}: {later.name} may take {earlier.name}'s layers"
