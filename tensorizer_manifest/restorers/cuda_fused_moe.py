"""CUDA fused-MoE experts, unquantized and FP8 (``UnquantizedFusedMoEMethod``, ``Fp8MoEMethod``). Unverified.

The step converts the expert weights to the backend's format (FP8: requantize
w1/w3 to one scale, DeepGEMM's layout; Triton: contiguous) and builds the MoE
kernel. The weights are
saved processed; replay is vLLM's own pre-processed branch (the step under
``weights_already_processed()``: ``_init_moe_kernel`` only), which rebuilds
``moe_kernel`` and ``moe_quant_config`` from them.

That branch skips the experts' own ``process_weights_after_loading``, so this
restorer only covers experts whose step is the base no-op (``FlashInferExperts``
has one, a no-op without NVFP4, which this restorer does not try to prove), and
only the backends whose conversion leaves nothing but tensors. FlashInfer
TRT-LLM (both methods) and FlashInfer CUTLASS for FP8 are left raw as well:
their conversion pads the intermediate size and writes it into the shared
``moe_config`` in place, which a diff of attributes cannot see, so a restorer
could not prove it rebuilt it.
Marlin, Humming, AITER, MoonEP and CPU backends are not handled here (the CPU
ones are ``cpu_unquantized_moe`` and ``cpu_fp8_moe``). The method, backend, experts class and device
capability are the layer's ``form``. ``verified_on`` is empty.
"""

from __future__ import annotations

from .. import _vllm_compat
from ..format.schema import qualified_class
from .base import Restorer, device_capability, only_state_and_tensors_in_place, register

_UNQUANTIZED = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod"
_FP8 = "vllm.model_executor.layers.quantization.fp8.Fp8MoEMethod"
#: Backend enum names (``UnquantizedMoeBackend`` / ``Fp8MoeBackend``) whose conversion changes tensors only.
BACKENDS = {
    _UNQUANTIZED: ("unquantized_backend", {"TRITON", "BATCHED_TRITON"}),
    _FP8: (
        "fp8_backend",
        {"TRITON", "BATCHED_TRITON", "DEEPGEMM", "BATCHED_DEEPGEMM", "VLLM_CUTLASS", "BATCHED_VLLM_CUTLASS"},
    ),
}
_KERNEL_STATE = {
    ("quant_method", "moe_kernel"),
    ("quant_method", "moe_quant_config"),
    ("quant_method.moe_kernel", "impl"),
}
_BASE_EXPERTS_STEP = "vllm.model_executor.layers.fused_moe.modular_kernel.FusedMoEExperts.process_weights_after_loading"


def _backend(module) -> str | None:
    """The layer's backend enum name when this restorer handles its method and backend, else None."""
    quant_method = getattr(module, "quant_method", None)
    method = qualified_class(quant_method)
    if method not in BACKENDS:
        return None
    attr, allowed = BACKENDS[method]
    backend = getattr(getattr(quant_method, attr, None), "name", None)
    return backend if backend in allowed else None


def _experts_step_is_a_no_op(experts_cls) -> bool:
    step = getattr(experts_cls, "process_weights_after_loading", None)
    return step is not None and f"{step.__module__}.{step.__qualname__}" == _BASE_EXPERTS_STEP


class CudaMoeRestorer(Restorer):
    name = "cuda_fused_moe"
    writes_tensors = False
    handles = (_UNQUANTIZED, _FP8)
    verified_on = frozenset()
    asked_after = {
        "cpu_unquantized_moe": "both handle UnquantizedFusedMoEMethod; that one applies on a CPU platform to CPU "
        "experts, this one to the Triton backends, which vLLM does not pair with CPU experts",
    }
    rebuilds = "the fused-MoE kernel and quant config (vLLM's pre-processed branch, _init_moe_kernel)"

    def applies_to(self, module):
        return _backend(module) is not None

    def form(self, module):
        quant_method = module.quant_method
        return {
            "method": qualified_class(quant_method),
            "backend": _backend(module),
            "experts_class": qualified_class(quant_method.experts_cls),
            "capability": device_capability(),
        }

    def covers(self, module, diff):
        why_not = only_state_and_tensors_in_place(diff, _KERNEL_STATE)
        if why_not is not None:
            return why_not
        if not _experts_step_is_a_no_op(module.quant_method.experts_cls):
            return (
                f"{qualified_class(module.quant_method.experts_cls)} has a post-load step of its own, "
                "which vLLM's pre-processed branch skips"
            )
        return None

    def replay(self, module, model_config):
        _vllm_compat.run_pre_processed_step(module.quant_method, module)


register(CudaMoeRestorer())
