"""CPU weight-only 4-bit linear layers (GPTQ, AWQ, compressed-tensors W4A16): the repacked weights' flags.

vLLM's ``CPUWNA16LinearKernel`` step unpacks every 4-bit weight to int32,
repacks it into 16-column blocks (or, with AMX, into the w4a8 blocked layout
with float32 scales and blocked zero points) and sets ``use_w4a8`` and
``isa_hint`` on the layer: several full passes over every weight. The result
is plain tensors, saved processed; replay sets the two flags again. Which
layout the step writes depends on the machine (AMX, ``VLLM_CPU_INT4_W4A8``),
so the layout is the layer's recorded ``form``, checked before loading.
"""

from __future__ import annotations

from typing import Any

from .. import _vllm_compat
from .base import Restorer, register, state_beyond

_KERNEL = "vllm.model_executor.kernels.linear.mixed_precision.cpu.CPUWNA16LinearKernel"
_FLAGS = ("use_w4a8", "isa_hint")


def wna16_kernel(module: Any) -> Any | None:
    """The layer's ``CPUWNA16LinearKernel``: on its quant method (GPTQ, AWQ) or its scheme (compressed-tensors)."""
    for owner in (getattr(module, "quant_method", None), module.__dict__.get("scheme")):
        kernel = getattr(owner, "kernel", None) if owner is not None else None
        if kernel is not None and f"{type(kernel).__module__}.{type(kernel).__qualname__}" == _KERNEL:
            return kernel
    return None


class CpuWna16Restorer(Restorer):
    name = "cpu_wna16"
    handles = (
        _KERNEL,
        "vllm.model_executor.layers.quantization.auto_gptq.AutoGPTQLinearMethod",
        "vllm.model_executor.layers.quantization.auto_awq.AutoAWQMarlinLinearMethod",
        "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16.CompressedTensorsWNA16",
    )
    verified_on = frozenset({"cpu"})
    rebuilds = (
        "use_w4a8 and isa_hint (the layout the repacked weights are in); zero points left as saved, or unset "
        "(None) as the step leaves them where there are none"
    )

    def applies_to(self, module):
        return wna16_kernel(module) is not None

    def form(self, module):
        kernel = wna16_kernel(module)
        scales = getattr(module, kernel.w_s_name)
        return _vllm_compat.cpu_wna16_layout(kernel.config.act_type, scales.dtype)

    def creates_tensors(self, module):
        # Without zero points the w4a8 layout still needs them: vLLM's step makes a constant one.
        kernel = wna16_kernel(module)
        if kernel.config.zero_points or not kernel.w_zp_name or not self.form(module)["use_w4a8"]:
            return set()
        return {kernel.w_zp_name}

    def covers(self, module, diff):
        allowed = {("layer", flag) for flag in _FLAGS}
        zero_point = _unset_zero_point(module)
        if zero_point is not None:
            if diff.changed_attrs.get(("layer", zero_point), _MISSING) is not None:
                return f"the step set {zero_point} to something other than None"
            allowed.add(("layer", zero_point))
        why_not = state_beyond(diff, allowed)
        if why_not is not None:
            return why_not
        if diff.added_tensors - self.creates_tensors(module):
            return f"the step added tensors {sorted(diff.added_tensors)} that a freshly built layer lacks"
        done = {name: value for (_, name), value in diff.changed_attrs.items() if name != zero_point}
        predicted = self.form(module)
        if done != predicted:
            return f"the step set {done}, not the layout {predicted} this restorer predicts for this machine"
        return None

    def replay(self, module, model_config):
        for flag, value in self.form(module).items():
            setattr(module, flag, value)
        zero_point = _unset_zero_point(module)
        if zero_point is not None:
            setattr(module, zero_point, None)


_MISSING = object()


def _unset_zero_point(module: Any) -> str | None:
    """The attribute vLLM's step sets to None on a layer without zero points whose zero points are not a
    registered tensor (compressed-tensors' symmetric ``weight_zero_point``: a plain attribute, unlike GPTQ's
    ``qzeros`` parameter); None where the step sets no such attribute."""
    kernel = wna16_kernel(module)
    assert kernel is not None  # a layer this restorer applies to (``applies_to``)
    name = kernel.w_zp_name
    if kernel.config.zero_points or not name or name in module._parameters or name in module._buffers:
        return None
    return name


register(CpuWna16Restorer())
