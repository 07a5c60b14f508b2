"""Attention layers: host copies of the q/k/v/prob scales.

The step turns the scale buffers into plain floats and CPU copies (and may drop
the checkpoint-facing ``k_scale`` placeholders). The buffers are saved
processed; replay derives the floats from them. Running vLLM's step again
instead would reset calibrated scales to 1.0.
"""

from __future__ import annotations

from typing import ClassVar

from ..live_model.layers import has_attention_step
from .base import Restorer, register, state_beyond


class AttentionScalesRestorer(Restorer):
    name = "attention_scales"
    kernel_independent = True
    writes_tensors = False
    handles: ClassVar[tuple[str, ...]] = (
        "vllm.model_executor.layers.attention.attention.Attention",
        "vllm.model_executor.layers.quantization.kv_cache.BaseKVCacheMethod",
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors.CompressedTensorsKVCacheMethod",
    )
    verified_on = frozenset({"cpu"})
    rebuilds = "the float and host copies of the q/k/v/prob scales (calibrated KV scales kept, not reset)"
    _FLOATS = {
        "_q_scale_float": "_q_scale",
        "_k_scale_float": "_k_scale",
        "_v_scale_float": "_v_scale",
        "_prob_scale_float": "_prob_scale",
    }
    _CPU_COPIES = {"_k_scale_cpu": "_k_scale", "_v_scale_cpu": "_v_scale"}
    _SCALE_BUFFERS = {"_q_scale", "_k_scale", "_v_scale", "_prob_scale"}
    _PLACEHOLDERS = {"q_scale", "k_scale", "v_scale", "prob_scale", "q_zero_point", "k_zero_point", "v_zero_point"}

    def applies_to(self, module):
        return has_attention_step(module)

    def covers(self, module, diff):
        if diff.added_tensors:
            return f"the step added tensors {sorted(diff.added_tensors)}"
        if diff.removed_tensors - self._PLACEHOLDERS:
            return f"the step removed tensors {sorted(diff.removed_tensors - self._PLACEHOLDERS)}"
        if diff.changed_tensors - self._SCALE_BUFFERS:
            return f"the step changed tensors {sorted(diff.changed_tensors - self._SCALE_BUFFERS)}"
        allowed = {("layer", n) for n in (*self._FLOATS, *self._CPU_COPIES)}
        why_not = state_beyond(diff, allowed)
        if why_not is not None:
            return why_not
        return None

    def replay(self, module, model_config):
        for attr, buffer in self._FLOATS.items():
            if hasattr(module, buffer):
                setattr(module, attr, getattr(module, buffer).item())
        for attr, buffer in self._CPU_COPIES.items():
            if hasattr(module, buffer):
                setattr(module, attr, getattr(module, buffer).detach().to("cpu", copy=True))


register(AttentionScalesRestorer())
