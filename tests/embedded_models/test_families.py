"""The family kinds of the architecture matrix are their transformers architectures, with their feature on
(fast: no vLLM engine; the e2e matrix is tests/e2e/test_e2e_families.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tensorizer_manifest.embedded_models import tiny
from tensorizer_manifest.embedded_models.families import FAMILIES


def build(tmp_path: Path, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    out = tiny.build_tiny_model(tmp_path / kind, kind)
    config = json.loads((out / "config.json").read_text())
    return config, load_file(str(out / "model.safetensors"))


#: The feature each family kind exists for, read back from its config.json (what vLLM reads).
FAMILY_FEATURES = {
    "llama3-128k": ("LlamaForCausalLM", lambda c: c["max_position_embeddings"] == 131072
                    and c["rope_parameters"]["rope_type"] == "llama3"),
    "mistral": ("MistralForCausalLM", lambda c: c["sliding_window"] == 64),
    "mixtral": ("MixtralForCausalLM", lambda c: (c["num_local_experts"], c["num_experts_per_tok"]) == (4, 2)),
    "gemma3": ("Gemma3ForCausalLM", lambda c: c["layer_types"] == ["sliding_attention", "full_attention"]),
    "phi3": ("Phi3ForCausalLM", lambda c: c["rope_parameters"]["rope_type"] == "longrope"
             and c["original_max_position_embeddings"] < c["max_position_embeddings"]),
    "granite": ("GraniteForCausalLM", lambda c: c["embedding_multiplier"] != 1 and c["logits_scaling"] != 1),
    "olmo2": ("Olmo2ForCausalLM", lambda c: c["model_type"] == "olmo2"),
    "stablelm": ("StableLmForCausalLM", lambda c: c["partial_rotary_factor"] == 0.25 and c["use_qkv_bias"]),
    "opt": ("OPTForCausalLM", lambda c: c["word_embed_proj_dim"] == c["hidden_size"]),
    "deepseek-v2": ("DeepseekV2ForCausalLM", lambda c: c["kv_lora_rank"] + c["qk_rope_head_dim"] == 576
                    and c["first_k_dense_replace"] == c["num_hidden_layers"]),
}  # fmt: skip


def test_every_family_kind_has_its_feature_test_here():
    assert set(FAMILY_FEATURES) == set(FAMILIES)


@pytest.mark.parametrize("kind", sorted(FAMILY_FEATURES))
def test_a_family_kind_is_its_transformers_architecture_with_its_feature_on(tmp_path, kind):
    architecture, has_feature = FAMILY_FEATURES[kind]
    config, state = build(tmp_path, kind)
    assert config["architectures"] == [architecture]
    assert has_feature(config), config
    assert config["hidden_size"] % 32 == 0 and config["pad_token_id"] < config["vocab_size"]
    matrices = [t for t in state.values() if t.ndim >= 2]
    assert matrices and all(0.03 < t.float().std().item() < 0.07 for t in matrices)  # normal(0, 0.05)


def test_phi3_checkpoint_holds_fused_qkv_and_gate_up_as_hub_phi3_does(tmp_path):
    config, state = build(tmp_path, "phi3")
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    qkv = state["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == ((heads + 2 * kv_heads) * head_dim, hidden)
    assert state["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * config["intermediate_size"], hidden)
    assert not any(".q_proj." in name or ".gate_proj." in name for name in state)


def test_mixtral_experts_are_written_with_the_hub_names(tmp_path):
    """Hub Mixtral: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{i}.w1/w3/w2`` (gate, up, down)."""
    config, state = build(tmp_path, "mixtral")
    original = tiny.unquantized_state_dict("mixtral")
    experts, inter = config["num_local_experts"], config["intermediate_size"]
    assert not any(".mlp." in name for name in state)
    for layer in range(config["num_hidden_layers"]):
        fused_gate_up = original[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        fused_down = original[f"model.layers.{layer}.mlp.experts.down_proj"]
        moe = f"model.layers.{layer}.block_sparse_moe."
        assert torch.equal(state[moe + "gate.weight"], original[f"model.layers.{layer}.mlp.gate.weight"])
        for e in range(experts):
            assert torch.equal(state[f"{moe}experts.{e}.w1.weight"], fused_gate_up[e, :inter])
            assert torch.equal(state[f"{moe}experts.{e}.w3.weight"], fused_gate_up[e, inter:])
            assert torch.equal(state[f"{moe}experts.{e}.w2.weight"], fused_down[e])


def test_overrides_have_the_last_word_over_a_family_s_settings():
    """The benchmarks and the real-size test build families at other shapes: a tied head on the long-context
    Llama (Llama-3.2-1B ties it; the family itself does not)."""
    config = tiny._config("llama3-128k", 1024, {"tie_word_embeddings": True, "hidden_size": 512})
    assert config.tie_word_embeddings is True and config.hidden_size == 512
    assert config.max_position_embeddings == 131072  # the family's own setting stays where not overridden
    assert tiny._config("llama3-128k", 1024).tie_word_embeddings is False
