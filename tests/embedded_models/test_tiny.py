"""The quantized and MoE tiny models hold what vLLM 0.32 expects (fast: no vLLM engine).

Each test builds one kind into tmp_path and reads its config.json and
safetensors back. Packed 4-bit weights are unpacked here independently of
tiny.py (with the bit orders vLLM's loaders assume) and compared with the
unquantized weights the kind starts from, so a packing or layout mistake fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tensorizer_manifest.embedded_models import tiny

GROUP = tiny.INT4_GROUP_SIZE
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
#: vLLM's auto_awq._REVERSE_AWQ_PACK_ORDER: value j of 8 sits at nibble REVERSE[j].
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)


def build(tmp_path: Path, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    out = tiny.build_tiny_model(tmp_path / kind, kind)
    config = json.loads((out / "config.json").read_text())
    return config, load_file(str(out / "model.safetensors"))


def nibbles(packed: torch.Tensor, dim: int, order=tuple(range(8)), bits: int = 4) -> torch.Tensor:
    """Unpack int32 along ``dim`` into ``bits``-bit values; value j of each 32 / bits is at position order[j]."""
    x = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    values = (x.unsqueeze(-1) >> torch.arange(0, 32, bits)) & (2**bits - 1)
    values = values[..., list(order)[: 32 // bits]]
    return values.reshape(*x.shape[:-1], -1).movedim(-1, dim)


def assert_close_to_original(name: str, deq: torch.Tensor, orig: torch.Tensor, scale_per_column: torch.Tensor):
    """Round-to-nearest: every weight within half a step of its group's scale (clamped ends included)."""
    err = (deq - orig.float()).abs()
    bound = 0.5 * scale_per_column * (1 + 1e-3) + 1e-6
    assert bool((err <= bound).all()), f"{name}: max error {err.max():.4g} over half a step"
    rel = (err.pow(2).mean() / orig.float().pow(2).mean()).sqrt()
    assert rel < 0.15, f"{name}: relative RMS error {rel:.3f}"


def assert_dense_tensors_kept(state: dict, original: dict):
    for name, tensor in original.items():
        if name.rsplit(".", 2)[-2] not in {linear.split(".")[1] for linear in LINEARS}:
            assert torch.equal(state[name], tensor), name


def linear_prefixes(config: dict) -> list[str]:
    return [f"model.layers.{i}.{linear}." for i in range(config["num_hidden_layers"]) for linear in LINEARS]


def test_kinds_are_listed_and_unknown_kinds_refused(tmp_path):
    for kind in ("gptq-w4", "awq-w4", "ct-w4a16", "qwen3-moe", "kv-fp8-calibrated"):
        assert kind in tiny.TINY_KINDS
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        tiny.build_tiny_model(tmp_path / "x", "gptq-w3")  # type: ignore[arg-type]


def test_gptq_w4_is_a_gptq_v1_checkpoint_that_dequantizes_to_the_weights(tmp_path):
    config, state = build(tmp_path, "gptq-w4")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["quantization_config"] == {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": False,
        "sym": True,
        "static_groups": False,
        "true_sequential": True,
        "damp_percent": 0.01,
        "lm_head": False,
        "checkpoint_format": "gptq",
    }
    original = tiny.unquantized_state_dict("gptq-w4")
    for prefix in linear_prefixes(config):
        w = original[prefix + "weight"]
        n, k = w.shape
        assert n % 32 == 0 and k % 32 == 0, prefix  # CPUWNA16LinearKernel.can_implement
        assert prefix + "weight" not in state
        qweight, scales = state[prefix + "qweight"], state[prefix + "scales"]
        qzeros, g_idx = state[prefix + "qzeros"], state[prefix + "g_idx"]
        assert (qweight.dtype, tuple(qweight.shape)) == (torch.int32, (k // 8, n))
        assert (scales.dtype, tuple(scales.shape)) == (torch.float16, (k // GROUP, n))
        assert (qzeros.dtype, tuple(qzeros.shape)) == (torch.int32, (k // GROUP, n // 8))
        assert (g_idx.dtype, g_idx.tolist()) == (torch.int32, [i // GROUP for i in range(k)])
        assert bool((nibbles(qzeros, 1) == 7).all()), prefix  # v1: zero - 1, uint4b8's zero is 8
        codes = nibbles(qweight, 0)  # [K, N], packed along K (input)
        assert codes.min() == 0 and codes.max() == 15, prefix
        step = scales.float().repeat_interleave(GROUP, 0)
        deq = ((codes - 8).float() * step).t()
        assert_close_to_original(prefix, deq, w, step.t())
    assert_dense_tensors_kept(state, original)


@pytest.mark.parametrize(
    ("kind", "bits", "group", "act_order"),
    [("gptq-w4-actorder", 4, -1, True), ("gptq-w4-actorder-grouped", 4, GROUP, True), ("gptq-w8", 8, GROUP, False)],
)
def test_gptq_act_order_and_8_bit_checkpoints_dequantize_to_the_weights_through_their_g_idx(
    tmp_path, kind, bits, group, act_order
):
    """Act-order quantizes the input columns in a permuted order: each column's group is read from ``g_idx``
    (a real permutation with groups, all zeros with one group per channel), never from ``k // group``."""
    config, state = build(tmp_path, kind)
    quant = config["quantization_config"]
    assert (quant["bits"], quant["group_size"], quant["desc_act"], quant["sym"]) == (bits, group, act_order, True)
    original = tiny.unquantized_state_dict(kind)
    per_int, zero = 32 // bits, 2 ** (bits - 1)
    for prefix in linear_prefixes(config):
        w = original[prefix + "weight"]
        n, k = w.shape
        groups = 1 if group == -1 else k // group
        qweight, scales = state[prefix + "qweight"], state[prefix + "scales"]
        qzeros, g_idx = state[prefix + "qzeros"], state[prefix + "g_idx"]
        assert (qweight.dtype, tuple(qweight.shape)) == (torch.int32, (k // per_int, n))
        assert (scales.dtype, tuple(scales.shape)) == (torch.float16, (groups, n))
        assert (qzeros.dtype, tuple(qzeros.shape)) == (torch.int32, (groups, n // per_int))
        assert bool((nibbles(qzeros, 1, bits=bits) == zero - 1).all()), prefix  # v1: zero - 1
        assert g_idx.dtype == torch.int32 and torch.bincount(g_idx).tolist() == [k // groups] * groups
        in_order = g_idx.tolist() == [i * groups // k for i in range(k)]
        assert in_order == (not act_order or groups == 1), prefix  # with act-order and groups: a permutation
        codes = nibbles(qweight, 0, bits=bits)  # [K, N], packed along K (input)
        assert codes.max() - codes.min() >= 2**bits - 2, prefix  # the whole range is used
        step = scales.float()[g_idx.long()]  # [K, N]: each input column's scale, through g_idx
        assert_close_to_original(prefix, ((codes - zero).float() * step).t(), w, step.t())
    assert_dense_tensors_kept(state, original)


def test_awq_w4_is_an_autoawq_gemm_checkpoint_that_dequantizes_to_the_weights(tmp_path):
    config, state = build(tmp_path, "awq-w4")
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 64 and config["tie_word_embeddings"] is False
    quant = config["quantization_config"]
    assert {k: quant[k] for k in ("quant_method", "bits", "group_size", "zero_point", "version")} == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
    }
    original = tiny.unquantized_state_dict("awq-w4")
    asymmetric = False
    for prefix in linear_prefixes(config):
        w = original[prefix + "weight"]
        n, k = w.shape
        assert n % 32 == 0 and k % 32 == 0, prefix
        assert prefix + "weight" not in state
        qweight, qzeros, scales = state[prefix + "qweight"], state[prefix + "qzeros"], state[prefix + "scales"]
        assert (qweight.dtype, tuple(qweight.shape)) == (torch.int32, (k, n // 8))
        assert (qzeros.dtype, tuple(qzeros.shape)) == (torch.int32, (k // GROUP, n // 8))
        assert (scales.dtype, tuple(scales.shape)) == (torch.float16, (k // GROUP, n))
        codes = nibbles(qweight, 1, AWQ_REVERSE)  # [K, N], packed along N (output) in AWQ order
        zeros = nibbles(qzeros, 1, AWQ_REVERSE)  # [K/g, N]
        asymmetric |= bool((zeros != 8).any())
        step = scales.float().repeat_interleave(GROUP, 0)
        deq = ((codes - zeros.repeat_interleave(GROUP, 0)).float() * step).t()
        assert_close_to_original(prefix, deq, w, step.t())
        # the plain nibble order must not also fit: the test tells AWQ order from GPTQ order
        plain = ((nibbles(qweight, 1) - nibbles(qzeros, 1).repeat_interleave(GROUP, 0)).float() * step).t()
        assert not torch.allclose(plain, w.float(), atol=float(step.max()))
    assert asymmetric, "AWQ zero points should vary with each group's min and max"
    assert "model.layers.0.self_attn.q_norm.weight" in state
    assert_dense_tensors_kept(state, original)


def test_ct_w4a16_is_pack_quantized_and_dequantizes_to_the_weights(tmp_path):
    config, state = build(tmp_path, "ct-w4a16")
    assert config["architectures"] == ["LlamaForCausalLM"]
    quant = config["quantization_config"]
    assert (quant["quant_method"], quant["format"]) == ("compressed-tensors", "pack-quantized")
    assert quant["ignore"] == ["lm_head"]
    group = quant["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    weights = group["weights"]
    assert {k: weights[k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic")} == {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": GROUP,
        "dynamic": False,
    }
    original = tiny.unquantized_state_dict("ct-w4a16")
    for prefix in linear_prefixes(config):
        w = original[prefix + "weight"]
        n, k = w.shape
        assert prefix + "weight" not in state
        packed, scale = state[prefix + "weight_packed"], state[prefix + "weight_scale"]
        shape = state[prefix + "weight_shape"]
        assert (packed.dtype, tuple(packed.shape)) == (torch.int32, (n, k // 8))
        assert (scale.dtype, tuple(scale.shape)) == (torch.bfloat16, (n, k // GROUP))
        assert (shape.dtype, shape.tolist()) == (torch.int64, [n, k])
        signed = nibbles(packed, 1) - 8  # [N, K], packed along K with a +8 offset
        step = scale.float().repeat_interleave(GROUP, 1)
        assert_close_to_original(prefix, signed.float() * step, w, step)
    assert_dense_tensors_kept(state, original)


def test_ct_w4a16_channel_has_one_scale_per_output_channel(tmp_path):
    config, state = build(tmp_path, "ct-w4a16-channel")
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["strategy"], weights["group_size"]) == (4, "channel", None)
    original = tiny.unquantized_state_dict("ct-w4a16-channel")
    for prefix in linear_prefixes(config):
        w = original[prefix + "weight"]
        n, k = w.shape
        packed, scale = state[prefix + "weight_packed"], state[prefix + "weight_scale"]
        assert (packed.dtype, tuple(packed.shape)) == (torch.int32, (n, k // 8))
        assert (scale.dtype, tuple(scale.shape)) == (torch.bfloat16, (n, 1))
        step = scale.float().expand(n, k)
        assert_close_to_original(prefix, (nibbles(packed, 1) - 8).float() * step, w, step)
    assert_dense_tensors_kept(state, original)


def test_ct_w4a16_packing_matches_compressed_tensors_own_unpacker(tmp_path):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    _, state = build(tmp_path, "ct-w4a16")
    packed = state["model.layers.1.mlp.down_proj.weight_packed"]
    shape = torch.Size(state["model.layers.1.mlp.down_proj.weight_shape"].tolist())
    theirs = helpers.unpack_from_int32(packed, 4, shape)
    assert torch.equal(theirs.to(torch.int64), nibbles(packed, 1) - 8)


def test_qwen3_moe_has_per_expert_tensors_vllm_maps(tmp_path):
    from transformers import AutoConfig

    config, state = build(tmp_path, "qwen3-moe")
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and "quantization_config" not in config
    hf = AutoConfig.from_pretrained(tmp_path / "qwen3-moe")
    experts, hidden, inter = hf.num_experts, hf.hidden_size, hf.moe_intermediate_size
    assert (experts, hf.num_experts_per_tok, hf.head_dim) == (4, 2, 64)
    assert hidden % 32 == 0 and inter % 32 == 0  # CPU MoE kernels
    assert hf.decoder_sparse_step == 1 and hf.mlp_only_layers == []
    original = tiny.unquantized_state_dict("qwen3-moe")
    for layer in range(hf.num_hidden_layers):
        mlp = f"model.layers.{layer}.mlp."
        assert mlp + "experts.gate_up_proj" not in state and mlp + "experts.down_proj" not in state
        gate = state[mlp + "gate.weight"]
        assert (gate.dtype, tuple(gate.shape)) == (torch.bfloat16, (experts, hidden))
        fused_gate_up, fused_down = original[mlp + "experts.gate_up_proj"], original[mlp + "experts.down_proj"]
        for e in range(experts):
            names = {p: f"{mlp}experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
            shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
            for proj, shape in shapes.items():
                t = state[names[proj]]
                assert (t.dtype, tuple(t.shape)) == (torch.bfloat16, shape), names[proj]
            # transformers runs gate, up = (x @ gate_up_proj[e].T).chunk(2): gate rows come first
            assert torch.equal(state[names["gate_proj"]], fused_gate_up[e, :inter])
            assert torch.equal(state[names["up_proj"]], fused_gate_up[e, inter:])
            assert torch.equal(state[names["down_proj"]], fused_down[e])
        assert not torch.equal(state[mlp + "experts.0.up_proj.weight"], state[mlp + "experts.1.up_proj.weight"])
    assert len(state) == len(original) - 2 * hf.num_hidden_layers + 3 * experts * hf.num_hidden_layers


def test_kv_fp8_calibrated_has_kv_cache_scheme_and_calibrated_scales(tmp_path):
    from transformers import PreTrainedTokenizerFast

    config, state = build(tmp_path, "kv-fp8-calibrated")
    assert config["architectures"] == ["LlamaForCausalLM"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert head_dim % 32 == 0  # CPU fp8 KV cache
    quant = config["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["config_groups"] == {}
    assert quant["kv_cache_scheme"] == {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor",
        "dynamic": False,
    }
    original = tiny.unquantized_state_dict("kv-fp8-calibrated")
    scale_names = {n for n in state if n.endswith(("k_scale", "v_scale"))}
    layers = config["num_hidden_layers"]
    assert scale_names == {f"model.layers.{i}.self_attn.{kv}_scale" for i in range(layers) for kv in "kv"}
    assert set(state) - scale_names == set(original)
    for name in original:  # weights stay bf16, untouched
        assert torch.equal(state[name], original[name]), name
    values = []
    for name in sorted(scale_names):
        assert (state[name].dtype, tuple(state[name].shape)) == (torch.float32, (1,)), name
        values.append(state[name].item())
    assert all(0.001 < v < 0.5 for v in values), values  # far from the 1.0 placeholder vLLM starts with
    assert len(set(values)) == len(values), "each scale comes from its own layer's keys and values"

    # Layer 0 sees the embeddings through its input RMSNorm only, so its calibration can be redone here.
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "kv-fp8-calibrated")
    ids = torch.cat([tok(text, return_tensors="pt").input_ids[0] for text in tiny._CORPUS + tiny.DEMO_PROMPTS])
    x = original["model.embed_tokens.weight"][ids].float()
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])
    h = h * original["model.layers.0.input_layernorm.weight"].float()
    k = (h @ original["model.layers.0.self_attn.k_proj.weight"].float().t()).reshape(len(ids), -1, head_dim)
    v = h @ original["model.layers.0.self_attn.v_proj.weight"].float().t()
    k_bound = torch.hypot(k[..., : head_dim // 2], k[..., head_dim // 2 :]).max().item()  # |RoPE(k)| <= pair norm
    for observed, name in ((k_bound, "k_scale"), (v.abs().max().item(), "v_scale")):
        scale = state[f"model.layers.0.self_attn.{name}"].item()
        assert scale * tiny.FP8_E4M3_MAX == pytest.approx(observed, rel=0.05), name


@pytest.mark.parametrize(
    ("kind", "architecture", "embedding"),
    [
        ("gpt2", "GPT2LMHeadModel", "transformer.wte.weight"),
        ("gemma2", "Gemma2ForCausalLM", "model.embed_tokens.weight"),
    ],
)
def test_other_architectures_are_tied_bf16_checkpoints_without_a_head_copy(tmp_path, kind, architecture, embedding):
    config, state = build(tmp_path, kind)
    assert config["architectures"] == [architecture]
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in state
    assert state[embedding].shape == (config["vocab_size"], 256)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_w8a8_static_has_calibrated_input_scales_shared_by_fused_inputs(tmp_path):
    config, state = build(tmp_path, "w8a8-int8-static")
    activations = config["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    assert (activations["strategy"], activations["dynamic"], activations["symmetric"]) == ("tensor", False, True)
    for prefix in linear_prefixes(config):
        scale = state[prefix + "input_scale"]
        assert (scale.dtype, tuple(scale.shape)) == (torch.float32, (1,)), prefix
        assert 1e-4 < scale.item() < 1.0, (prefix, scale.item())  # an observed amax / 127, not a placeholder
        assert state[prefix + "weight"].dtype == torch.int8
    for i in range(config["num_hidden_layers"]):  # one input each: vLLM fuses them into one per-tensor scale
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        assert (
            state[attn + "q_proj.input_scale"]
            == state[attn + "k_proj.input_scale"]
            == state[attn + "v_proj.input_scale"]
        )
        assert state[mlp + "gate_proj.input_scale"] == state[mlp + "up_proj.input_scale"]
        assert state[attn + "q_proj.input_scale"] != state[attn + "o_proj.input_scale"]


def test_fp8_block_kind_is_block_scaled_fp8_within_a_step_of_the_original(tmp_path):
    """The Qwen3-0.6B-FP8 layout: float8_e4m3fn weights, one float32 weight_scale_inv per 128 x 128 block."""
    config, state = build(tmp_path, "fp8-block")
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    original = tiny.unquantized_state_dict("fp8-block")
    assert_dense_tensors_kept(state, original)
    for prefix in linear_prefixes(config):
        weight, scale = state[prefix + "weight"], state[prefix + "weight_scale_inv"]
        n, k = weight.shape
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert scale.shape == (n // 128, k // 128), prefix
        deq = weight.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        orig = original[prefix + "weight"].float()
        # e4m3 has 3 mantissa bits: within 1/16 relative of each value, plus the block's smallest step
        step = scale.repeat_interleave(128, 0).repeat_interleave(128, 1) * 2.0**-9
        assert bool(((deq - orig).abs() <= orig.abs() / 16 + step).all()), prefix
        assert (scale * tiny.FP8_E4M3_MAX).max() == pytest.approx(orig.abs().max().item(), rel=1e-6)


def test_qwen3_moe_fp8_quantizes_every_expert_and_projection_in_blocks_and_leaves_the_gates(tmp_path):
    """The Qwen3-30B-A3B-FP8 layout: per-expert fp8 weights with 128 x 128 block scales; the router gates
    (their output is the 4 experts: no 128-row block) are named in modules_to_not_convert and stay bf16."""
    config, state = build(tmp_path, "qwen3-moe-fp8")
    layers = config["num_hidden_layers"]
    assert config["quantization_config"]["modules_to_not_convert"] == [
        f"model.layers.{i}.mlp.gate" for i in range(layers)
    ]
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    plain = {name: t for name, t in state.items() if t.dtype != torch.float8_e4m3fn}
    quantized = {name for name, t in state.items() if t.dtype == torch.float8_e4m3fn}
    experts = {n for n in quantized if ".mlp.experts." in n}
    assert len(experts) == 3 * config["num_local_experts"] * layers
    assert len(quantized) == len(experts) + 4 * layers  # q, k, v, o
    for name in quantized:
        scale = state[name[: -len("weight")] + "weight_scale_inv"]
        assert scale.shape == (state[name].shape[0] // 128, state[name].shape[1] // 128), name
    for i in range(layers):
        assert plain[f"model.layers.{i}.mlp.gate.weight"].dtype == torch.bfloat16


def test_qwen3_moe_w8a8_quantizes_every_expert_per_channel_and_leaves_the_gates(tmp_path):
    """compressed-tensors int8: per-expert int8 weights with one float32 scale per output channel; the router
    gates are in the config's ignore list and stay bf16."""
    config, state = build(tmp_path, "qwen3-moe-w8a8")
    layers, experts = config["num_hidden_layers"], config["num_local_experts"]
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["quantization_config"]["ignore"] == [
        "lm_head",
        *(f"model.layers.{i}.mlp.gate" for i in range(layers)),
    ]
    quantized = {name for name, t in state.items() if t.dtype == torch.int8}
    assert len({n for n in quantized if ".mlp.experts." in n}) == 3 * experts * layers
    original = tiny.unquantized_state_dict("qwen3-moe-w8a8")
    for name in quantized:
        scale = state[name[: -len("weight")] + "weight_scale"]
        assert scale.shape == (state[name].shape[0], 1) and scale.dtype == torch.float32, name
    for i in range(layers):
        assert state[f"model.layers.{i}.mlp.gate.weight"].dtype == torch.bfloat16
    assert len(state) == len(original) - 2 * layers + 3 * experts * layers + len(quantized)


def test_fp8_tensor_kind_has_one_scale_per_tensor(tmp_path):
    """Per-tensor FP8 (vLLM 0.32's CPU build cannot load it: a refused kind): a scalar weight_scale per linear."""
    config, state = build(tmp_path, "fp8-tensor")
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    original = tiny.unquantized_state_dict("fp8-tensor")
    for prefix in linear_prefixes(config):
        weight, scale = state[prefix + "weight"], state[prefix + "weight_scale"]
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == ()
        orig = original[prefix + "weight"].float()
        assert (scale * tiny.FP8_E4M3_MAX).item() == pytest.approx(orig.abs().max().item(), rel=1e-6)
        assert bool(((weight.float() * scale - orig).abs() <= orig.abs() / 16 + scale * 2.0**-9).all()), prefix


def _build_in_child(out: str) -> str:
    return str(tiny.build_tiny_model(out, "llama"))


def test_processes_building_one_kind_at_once_get_one_complete_model_and_keep_other_files(tmp_path):
    """Test workers build a kind at once: each build is renamed into place whole, so no process reads another's
    half-written files; building into a directory that holds other files keeps them."""
    import multiprocessing

    out = tmp_path / "tiny-llama"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        built = pool.map(_build_in_child, [str(out)] * 2)
    assert built == [str(out)] * 2
    assert (out / ".tiny-model-complete").read_text() == "llama\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]  # no build left beside it
    reference = load_file(out / "model.safetensors")
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    tiny.build_tiny_model(other, "llama")
    assert (other / "notes.txt").read_text() == "keep me"
    again = load_file(other / "model.safetensors")
    assert reference.keys() == again.keys() and all(torch.equal(reference[k], again[k]) for k in reference)
