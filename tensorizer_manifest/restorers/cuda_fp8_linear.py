"""CUDA FP8 linear layers (``Fp8LinearMethod``): per-tensor/per-channel scaled-mm and block-scaled kernels. Unverified.

vLLM's step requantizes fused shards to one scale, transposes the weight to
``(K, N)`` (padded for CUTLASS to multiples of 16; DeepGEMM rewrites weight and
block scales into its own layout, UE8M0 scales on some GPUs): tensors, saved
processed. Replay is vLLM's own pre-processed branch (the step under
``weights_already_processed()``), which sets ``input_scale = None`` for
dynamic activations and nothing else, because it skips the kernel's own step.
This restorer fills the gaps that leaves:

- CUTLASS per-tensor/per-channel: ``logical_output_size`` on the kernel (the
  unpadded output width its forward slices back to; without it the forward
  asserts). It is ``layer.output_size_per_partition``, and capture checks that
  is the value the step set.
- DeepGEMM block (alone or as the fallback of the FlashInfer/DeepGEMM dynamic
  kernel): ``layer.deep_gemm_warmup_provider``, the kernel vLLM's warm-up asks
  for its weights (without it, warm-up skips the layer).

Kernels whose step leaves other state (Marlin FP8, B12x, Humming) are not
handled: their layers save raw. The kernel class, the DeepGEMM UE8M0 switch and
the device capability are the layer's ``form``. ``verified_on`` is empty.
"""

from __future__ import annotations

from .. import _vllm_compat
from ..format.schema import qualified_class
from .base import Restorer, device_capability, layer_kernel, register, state_beyond

_METHOD = "vllm.model_executor.layers.quantization.fp8.Fp8LinearMethod"
_SCALED_MM = "vllm.model_executor.kernels.linear.scaled_mm"
CUTLASS = f"{_SCALED_MM}.cutlass.CutlassFP8ScaledMMLinearKernel"
DEEP_GEMM = f"{_SCALED_MM}.deep_gemm.DeepGemmFp8BlockScaledMMKernel"
FLASHINFER_DEEP_GEMM = f"{_SCALED_MM}.flashinfer.FlashInferFp8DeepGEMMDynamicBlockScaledKernel"
#: Kernels whose own step changes tensors only (``FP8ScaledMMLinearKernel``'s is a no-op; the block base
#: requantizes), plus the two with state this restorer rebuilds.
KERNELS = {
    CUTLASS,
    f"{_SCALED_MM}.pytorch.PerTensorTorchFP8ScaledMMLinearKernel",
    f"{_SCALED_MM}.pytorch.RowWiseTorchFP8ScaledMMLinearKernel",
    f"{_SCALED_MM}.pytorch.ChannelWiseTorchFP8ScaledMMLinearKernel",
    f"{_SCALED_MM}.pytorch.BlockWiseTorchFP8ScaledMMLinearKernel",
    f"{_SCALED_MM}.flashinfer.FlashInferFP8ScaledMMLinearKernel",
    f"{_SCALED_MM}.flashinfer.FlashInferFp8BlockScaledMMKernel",
    f"{_SCALED_MM}.triton.TritonFP8ScaledMMLinearKernel",
    f"{_SCALED_MM}.triton.TritonFp8BlockScaledMMKernel",
    f"{_SCALED_MM}.cutlass.CutlassFp8BlockScaledMMKernel",
    DEEP_GEMM,
    FLASHINFER_DEEP_GEMM,
}


def _kernel(module):
    if qualified_class(getattr(module, "quant_method", None)) != _METHOD:
        return None
    return layer_kernel(module, "fp8_linear", KERNELS)


def _warmup_provider(kernel):
    """The kernel object vLLM's DeepGEMM step puts on the layer for warm-up, or None."""
    name = qualified_class(kernel)
    if name == DEEP_GEMM:
        return kernel
    if name == FLASHINFER_DEEP_GEMM:
        return kernel.fallback
    return None


class CudaFp8LinearRestorer(Restorer):
    name = "cuda_fp8_linear"
    writes_tensors = False
    handles = (_METHOD, *sorted(KERNELS))
    verified_on = frozenset()
    rebuilds = (
        "vLLM's pre-processed branch (input_scale=None), plus CUTLASS's logical_output_size and "
        "DeepGEMM's deep_gemm_warmup_provider, which that branch leaves out"
    )

    def applies_to(self, module):
        return _kernel(module) is not None

    def form(self, module):
        _, kernel = _kernel(module)
        provider = _warmup_provider(kernel)
        return {
            "kernel": qualified_class(kernel),
            "deep_gemm_e8m0": None if provider is None else bool(provider.use_deep_gemm_e8m0),
            "capability": device_capability(),
        }

    def expected_state(self, module):
        """(owner, attribute) -> the value vLLM's step sets, for the state beyond tensors it may create."""
        owner, kernel = _kernel(module)
        expected = {}
        if not module.quant_method.act_q_static:
            expected[("layer", "input_scale")] = None
        if qualified_class(kernel) == CUTLASS:
            expected[(owner, "logical_output_size")] = module.output_size_per_partition
        provider = _warmup_provider(kernel)
        if provider is not None and not getattr(module, "is_bmm", False):
            expected[("layer", "deep_gemm_warmup_provider")] = provider
        return expected

    def covers(self, module, diff):
        expected = self.expected_state(module)
        why_not = state_beyond(diff, expected)
        if why_not is not None:
            return why_not
        for key, value in diff.changed_attrs.items():
            if value is not expected[key] and value != expected[key]:
                return f"the step set {key} to {value!r}, not {expected[key]!r} as this restorer rebuilds it"
        if diff.added_tensors or diff.removed_tensors:
            return f"the step added or removed tensors {sorted(diff.added_tensors | diff.removed_tensors)}"
        owned = {"weight", "weight_scale", "weight_scale_inv", "input_scale"}
        if diff.changed_tensors - owned:
            return f"the step changed tensors {sorted(diff.changed_tensors - owned)}"
        return None

    def replay(self, module, model_config):
        _vllm_compat.run_pre_processed_step(module.quant_method, module)
        for (owner, attr), value in self.expected_state(module).items():
            target = module if owner == "layer" else _kernel(module)[1]
            setattr(target, attr, value)


register(CudaFp8LinearRestorer())
