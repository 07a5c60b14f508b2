"""ModelOpt NVFP4 linear layers (``ModelOptLinearMethod``, W4A4 and W4A16) on CUDA kernels. Unverified.

vLLM's step folds the per-shard global scales into one (``weight_scale_2`` ->
``weight_global_scale``; W4A4 also ``input_scale`` -> ``input_global_scale``,
``input_global_scale_inv`` and ``alpha``), then the kernel swizzles the block
scales and pads or shuffles the weight (CUTLASS, FlashInfer, Marlin, torch):
tensors, saved processed, including the ones a freshly built layer lacks.
Replay is vLLM's own pre-processed branch (the step under
``weights_already_processed()``), which returns before anything else, so this
restorer fills its gaps: ``layer.is_w4a16_nvfp4`` (read by models that gather
the projection), and ``layer.weights_padding_cols`` for the kernels that set it
(torch, FlashInfer CuTe-DSL W4A16), from the processed weight's width as vLLM's
``nvfp4_weight_padding_bytes`` computes it; capture checks both against what the
step set. Layers with a format scheme, B12x kernels (a warm-up provider and a
packed weight outside the parameters) and layers vLLM keeps gather copies for
are left raw. Kernel class and device capability are the ``form``.
``verified_on`` is empty.
"""

from __future__ import annotations

from typing import Any

from .. import _vllm_compat
from ..format.schema import qualified_class
from .base import Restorer, device_capability, layer_kernel, register, state_beyond

_METHOD = "vllm.model_executor.layers.quantization.modelopt.ModelOptLinearMethod"
_FORMAT_SCHEME = "vllm.model_executor.layers.quantization.modelopt.FormatScheme"
_NVFP4 = "vllm.model_executor.kernels.linear.nvfp4"
#: Kernels whose own step leaves ``weights_padding_cols`` on the layer.
PADDING_KERNELS = {
    f"{_NVFP4}.pytorch.TorchNvFp4LinearKernel",
    f"{_NVFP4}.flashinfer.FlashInferCuteDslNvFp4W4A16LinearKernel",
}
KERNELS = PADDING_KERNELS | {
    f"{_NVFP4}.cutlass.CutlassNvFp4LinearKernel",
    f"{_NVFP4}.marlin.MarlinNvFp4LinearKernel",
    f"{_NVFP4}.fbgemm.FbgemmNvFp4LinearKernel",
    f"{_NVFP4}.flashinfer.FlashInferCutlassNvFp4LinearKernel",
    f"{_NVFP4}.flashinfer.FlashInferTrtllmNvFp4LinearKernel",
    f"{_NVFP4}.flashinfer.FlashInferCudnnNvFp4LinearKernel",
    f"{_NVFP4}.flashinfer.FlashInferB12xNvFp4LinearKernel",
    f"{_NVFP4}.flashinfer.FlashInferCuteDslNvFp4LinearKernel",
}
_W4A4_CREATED = {"input_global_scale", "input_global_scale_inv", "alpha"}


def _nvfp4(module) -> tuple[object, bool] | None:
    """(kernel, is W4A16) for a ModelOpt NVFP4 linear layer on a handled kernel, else None."""
    quant_method: Any = getattr(module, "quant_method", None)  # vLLM's; not None once its class matches
    if qualified_class(quant_method) != _METHOD:
        return None
    static, dynamic = _vllm_compat.nvfp4_specs()
    spec = quant_method.spec
    if spec.weight != static or spec.activation not in (None, dynamic):
        return None
    found = layer_kernel(module, "kernel", KERNELS)
    return None if found is None else (found[1], spec.activation is None)


def _padding_cols(module) -> int:
    """vLLM's ``nvfp4_weight_padding_bytes``: the processed weight's width less the unpadded packed width."""
    return module.weight.shape[1] - module.input_size_per_partition // 2


class ModelOptNvfp4Restorer(Restorer):
    name = "modelopt_nvfp4_linear"
    writes_tensors = False
    handles = (_METHOD, *sorted(KERNELS))
    verified_on = frozenset()
    rebuilds = "vLLM's pre-processed branch, plus is_w4a16_nvfp4 and weights_padding_cols, which that branch leaves out"

    def applies_to(self, module):
        return _nvfp4(module) is not None

    def form(self, module):
        kernel, w4a16 = _nvfp4(module)
        return {"kernel": qualified_class(kernel), "w4a16": w4a16, "capability": device_capability()}

    def creates_tensors(self, module):
        _, w4a16 = _nvfp4(module)
        return {"weight_global_scale"} | (set() if w4a16 else _W4A4_CREATED)

    def expected_state(self, module):
        kernel, w4a16 = _nvfp4(module)
        expected = {("layer", "is_w4a16_nvfp4"): w4a16}
        if qualified_class(kernel) in PADDING_KERNELS:
            expected[("layer", "weights_padding_cols")] = _padding_cols(module)
        return expected

    def covers(self, module, diff):
        if qualified_class(module.quant_method.fmt) != _FORMAT_SCHEME:
            return f"the format scheme {type(module.quant_method.fmt).__name__} has steps of its own"
        if _vllm_compat.retains_nvfp4_weight_for_gather(module):
            return "vLLM keeps gather copies of this layer's weights (aliases made by the step)"
        expected = self.expected_state(module)
        why_not = state_beyond(diff, expected)
        if why_not is not None:
            return why_not
        for key, value in diff.changed_attrs.items():
            if value != expected[key]:
                return f"the step set {key} to {value!r}, not {expected[key]!r} as this restorer rebuilds it"
        if diff.added_tensors - self.creates_tensors(module):
            return f"the step added tensors {sorted(diff.added_tensors - self.creates_tensors(module))}"
        removable = {"weight_scale_2", "input_scale"}
        if diff.removed_tensors - removable:
            return f"the step removed tensors {sorted(diff.removed_tensors - removable)}"
        if diff.changed_tensors - {"weight", "weight_scale", "bias"}:
            return f"the step changed tensors {sorted(diff.changed_tensors - {'weight', 'weight_scale', 'bias'})}"
        return None

    def replay(self, module, model_config):
        _vllm_compat.run_pre_processed_step(module.quant_method, module)
        for (_, attr), value in self.expected_state(module).items():
            setattr(module, attr, value)


register(ModelOptNvfp4Restorer())
