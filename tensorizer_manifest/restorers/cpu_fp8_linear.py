"""CPU block-scaled FP8 linear layers (``Fp8LinearMethod`` with ``CPUFp8BlockScaledMMKernel``, AMX).

The format of Qwen3-FP8 and DeepSeek-V3: fp8 weights with one scale per
128 x 128 block. vLLM's CPU kernel for it needs AMX (W8A16: activations stay
bf16). Its step VNNI-prepacks the ``[N, K]`` weight for AMX
(``convert_weight_packed``, same shape and dtype, other byte order) and
re-wraps ``weight_scale_inv`` as a plain contiguous Parameter (e8m0 scales
upcast to float32): plain tensors, saved processed. The method's part of the
step sets ``input_scale = None`` (dynamic activations), and replay sets it
again: what vLLM's own pre-processed branch of ``Fp8LinearMethod`` does on CPU,
without calling the post-load step to get there. This kernel keeps no state of
its own.

Not covered, so saved raw: the W8A8 block kernel (native AMX-FP8, packs the
scales too; never run here) and the per-tensor kernel, whose step keeps
``_block_size_n`` on itself and which vLLM 0.32's CPU build cannot load
(``scaled_fp8_quant`` is missing from it). The kernel class and whether the
weight is packed (MLA's ``kv_b_proj`` is not) are the layer's ``form``.
"""

from __future__ import annotations

from .. import _vllm_compat
from ..format.schema import qualified_class
from .base import Restorer, layer_kernel, only_state_and_tensors_in_place, register

_METHOD = "vllm.model_executor.layers.quantization.fp8.Fp8LinearMethod"
_KERNEL = "vllm.model_executor.kernels.linear.scaled_mm.cpu.CPUFp8BlockScaledMMKernel"
#: What the step may change: the packed weight and the re-wrapped (or upcast) scale.
_CHANGES = {"weight", "weight_scale_inv", "weight_scale"}


def _kernel(module):
    if qualified_class(getattr(module, "quant_method", None)) != _METHOD:
        return None
    return layer_kernel(module, "fp8_linear", {_KERNEL})


class CpuFp8LinearRestorer(Restorer):
    name = "cpu_fp8_linear"
    writes_tensors = False
    handles = (_KERNEL,)  # the method row stays cuda_fp8_linear's: the kernel is what is CPU-specific
    verified_on = frozenset({"cpu"})
    rebuilds = "input_scale=None (dynamic activations) beside the saved AMX-packed weights and plain scales"

    def applies_to(self, module):
        return _kernel(module) is not None

    def form(self, module):
        return {
            "kernel": _KERNEL,
            "packed": not _vllm_compat.skips_cpu_gemm_dispatch(module),
        }

    def covers(self, module, diff):
        why_not = only_state_and_tensors_in_place(diff, {("layer", "input_scale")})
        if why_not is not None:
            return why_not
        if diff.changed_attrs.get(("layer", "input_scale")) is not None:
            return "the step set input_scale to a value (static activations), which this restorer does not rebuild"
        if diff.changed_tensors - _CHANGES:
            return f"the step changed tensors {sorted(diff.changed_tensors - _CHANGES)}"
        return None

    def replay(self, module, model_config):
        module.input_scale = None


register(CpuFp8LinearRestorer())
