"""CPU mixture-of-experts layers, unquantized, block FP8 and int8: the fused-MoE kernel over prepacked experts.

vLLM's step for ``UnquantizedFusedMoEMethod`` on CPU pads the intermediate
dimension and prepacks every expert's weights for the grouped GEMM of its
experts class (``CPUUnquantizedExperts``, ISA "vec"; ``X86CPUUnquantizedExperts``,
"amx"): a full copy of most of the model's bytes. The packed weights are saved
processed; replay is vLLM's own pre-processed branch (``_init_moe_kernel``),
which builds the kernel without packing again. The experts class (chosen by
the machine) and the zentorch switch are the layer's recorded ``form``.

Block-scaled FP8 experts (``Fp8MoEMethod`` with the "CPU" backend, AMX only:
``CPUExpertsFp8``, W8A16) are the same story: the step VNNI-prepacks
``w13_weight``/``w2_weight`` (``convert_weight_packed``), re-registers the block
scales unchanged and builds the kernel; vLLM's pre-processed branch of
``Fp8MoEMethod`` is ``_init_moe_kernel`` alone. ``CPUExpertsFp8`` has no step
of its own. The native AMX-FP8 backend ("CPU_W8A8", which packs the scales too)
is not covered: never run here, its layers save raw.

W8A8-int8 experts (compressed-tensors' ``CompressedTensorsW8A8Int8MoEMethod``
with ``CPUExpertsInt8``, AMX only): the method's step builds the kernel and the
experts' own step VNNI-prepacks ``w13_weight``/``w2_weight``; the scales are
left as loaded. vLLM has no pre-processed branch for this method; replay makes
the kernel-building calls of its step (``_vllm_compat.build_int8_moe_kernel``)
and skips the experts' step. ZenDNN's int8 experts (another layout, a reorder
of w13 first) are not covered.

One module for three restorers (``cpu_unquantized_moe``, ``cpu_fp8_moe``,
``cpu_int8_moe``), named after their family rather than one of them: they are
one story, vLLM's CPU fused-MoE experts packed by the step and a kernel built
over them, and share what they rebuild (``_KERNEL_STATE``) and, for the two
quantized ones, the whole check (``_PackedExpertsRestorer``).
"""

from __future__ import annotations

from typing import ClassVar

from .. import _vllm_compat
from ..format.schema import qualified_class
from .base import Restorer, only_state_and_tensors_in_place, register

_METHOD = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod"
_EXPERTS_BASE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts"
_FP8_METHOD = "vllm.model_executor.layers.quantization.fp8.Fp8MoEMethod"
_FP8_EXPERTS = "vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUExpertsFp8"
_INT8_METHOD = (
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
    "compressed_tensors_moe_w8a8_int8.CompressedTensorsW8A8Int8MoEMethod"
)
_INT8_EXPERTS = "vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUExpertsInt8"
_KERNEL_STATE = {
    ("quant_method", "moe_kernel"),
    ("quant_method", "moe_quant_config"),
    ("quant_method.moe_kernel", "impl"),
}


def _cpu_experts_class(quant_method) -> type | None:
    experts_cls = getattr(quant_method, "experts_cls", None)
    if not isinstance(experts_cls, type):
        return None
    if not any(qualified_class(base) == _EXPERTS_BASE for base in experts_cls.__mro__):
        return None
    return experts_cls


class CpuUnquantizedMoeRestorer(Restorer):
    name = "cpu_unquantized_moe"
    handles = (_METHOD, _EXPERTS_BASE, "vllm.model_executor.layers.fused_moe.experts.cpu_moe.X86CPUUnquantizedExperts")
    verified_on = frozenset({"cpu"})
    rebuilds = "the fused-MoE kernel (vLLM's _init_moe_kernel) over the saved prepacked experts"

    def applies_to(self, module):
        quant_method = getattr(module, "quant_method", None)
        return (
            _vllm_compat.on_cpu()
            and qualified_class(quant_method) == _METHOD
            and _cpu_experts_class(quant_method) is not None
        )

    def form(self, module):
        experts_cls = _cpu_experts_class(module.quant_method)
        return {
            "experts_class": qualified_class(experts_cls),
            "isa": experts_cls.isa,
            "zentorch": _vllm_compat.zentorch_moe_supported(module),
        }

    def covers(self, module, diff):
        why_not = only_state_and_tensors_in_place(diff, _KERNEL_STATE)
        if why_not is not None:
            return why_not
        if self.form(module)["zentorch"]:
            return "zentorch runs this layer's experts from unpacked weights: nothing processed to save"
        experts = getattr(module.quant_method.moe_kernel, "fused_experts", None)
        if type(experts) is not _cpu_experts_class(module.quant_method) or _vllm_compat.experts_use_zentorch(experts):
            return f"the step built {type(experts).__name__} experts, not the prepacked grouped GEMM expected"
        return None

    def replay(self, module, model_config):
        quant_method = module.quant_method
        _vllm_compat.init_moe_kernel(quant_method, module)
        # The experts' own step would decide zentorch and pack; the form says packed, without zentorch.
        _vllm_compat.stop_experts_using_zentorch(quant_method.moe_kernel.fused_experts)


register(CpuUnquantizedMoeRestorer())


class _PackedExpertsRestorer(Restorer):
    """A quantized MoE method on CPU whose step only packs ``w13_weight``/``w2_weight`` for one experts class and
    builds the kernel: covered when the step did exactly that."""

    method: ClassVar[str]
    experts: ClassVar[str]
    #: The tensors the step may change: the packed experts, and what it re-registers beside them.
    changes: ClassVar[frozenset[str]] = frozenset({"w13_weight", "w2_weight"})

    def applies_to(self, module):
        quant_method = getattr(module, "quant_method", None)
        return (
            _vllm_compat.on_cpu()
            and qualified_class(quant_method) == self.method
            and qualified_class(getattr(quant_method, "experts_cls", None)) == self.experts
        )

    def form(self, module):
        return {"experts_class": self.experts}

    def covers(self, module, diff):
        why_not = only_state_and_tensors_in_place(diff, _KERNEL_STATE)
        if why_not is not None:
            return why_not
        if diff.changed_tensors - self.changes:
            return (
                f"the step changed tensors {sorted(diff.changed_tensors - self.changes)}, not only the packed experts"
            )
        experts = getattr(module.quant_method.moe_kernel, "fused_experts", None)
        if qualified_class(experts) != self.experts:
            return f"the step built {type(experts).__name__} experts, not {self.experts.rsplit('.', 1)[-1]}"
        return None


class CpuFp8MoeRestorer(_PackedExpertsRestorer):
    name = "cpu_fp8_moe"
    method = _FP8_METHOD
    experts = _FP8_EXPERTS
    # its step re-registers the block scales as plain Parameters (same values, another Parameter class)
    changes = frozenset({"w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"})
    handles = (_FP8_EXPERTS,)  # the method row stays cuda_fused_moe's: the experts are what is CPU-specific
    verified_on = frozenset({"cpu"})
    rebuilds = "the fused-MoE kernel (vLLM's _init_moe_kernel) over the saved AMX-packed FP8 experts"

    def applies_to(self, module):
        backend = getattr(getattr(getattr(module, "quant_method", None), "fp8_backend", None), "name", None)
        return backend == "CPU" and super().applies_to(module)

    def replay(self, module, model_config):
        _vllm_compat.init_moe_kernel(module.quant_method, module)


class CpuInt8MoeRestorer(_PackedExpertsRestorer):
    name = "cpu_int8_moe"
    method = _INT8_METHOD
    experts = _INT8_EXPERTS
    handles = (_INT8_METHOD, _INT8_EXPERTS)
    verified_on = frozenset({"cpu"})
    rebuilds = "the quant config and fused-MoE kernel over the saved AMX-packed int8 experts (their step not rerun)"

    def replay(self, module, model_config):
        _vllm_compat.build_int8_moe_kernel(module.quant_method, module)


register(CpuFp8MoeRestorer())
register(CpuInt8MoeRestorer())
