"""Tiny models built locally, for the demo and the tests.

No hub: a transformers config with random weights (fixed seed) saved as
safetensors, plus a byte-level BPE tokenizer trained on a few sentences. The
weights are drawn from normal(0, 0.05) so that greedy decoding is not
degenerate and different loaders would visibly disagree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

TinyKind = Literal["llama", "qwen3-tied", "w8a8-int8", "qwen2-bias"]
TINY_KINDS: tuple[TinyKind, ...] = ("llama", "qwen3-tied", "w8a8-int8", "qwen2-bias")

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
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        bos_token="<|endoftext|>",
    )
    fast.save_pretrained(out)


def _config(kind: TinyKind, vocab_size: int):
    common = dict(
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
    if kind == "qwen3-tied":
        from transformers import Qwen3Config

        return Qwen3Config(head_dim=64, tie_word_embeddings=True, **common)
    if kind == "qwen2-bias":  # q/k/v projections with biases
        from transformers import Qwen2Config

        return Qwen2Config(tie_word_embeddings=False, **common)
    from transformers import LlamaConfig

    return LlamaConfig(tie_word_embeddings=False, **common)


def _quantize_w8a8(state: dict) -> tuple[dict, dict]:
    """Per-channel symmetric int8 weights for every decoder linear layer.

    Returns the new state dict and the compressed-tensors quantization config
    that vLLM reads (dynamic per-token int8 activations).
    """
    import torch

    linear_suffixes = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    out = {}
    for name, tensor in state.items():
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if name.endswith(".weight") and module in linear_suffixes:
            w = tensor.float()
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
            out[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            out[name[: -len("weight")] + "weight_scale"] = scale.to(torch.float32)
        else:
            out[name] = tensor
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
                "input_activations": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
        "ignore": ["lm_head"],
    }
    return out, quant_config


def build_tiny_model(out_dir: str | Path, kind: TinyKind = "llama", seed: int = 0) -> Path:
    """Write a tiny Hugging Face model directory vLLM can load with no network.

    Idempotent: an existing complete directory is reused, so tests and the
    demo can cache it.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if kind not in TINY_KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(TINY_KINDS)}")
    out = Path(out_dir)
    done_marker = out / ".tiny-model-complete"
    if done_marker.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = 1024
    _build_tokenizer(out, vocab_size)
    config = _config(kind, vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.05)
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    if kind == "w8a8-int8":
        state, quant_config = _quantize_w8a8(state)
        config_path = out / "config.json"
        config_json = json.loads(config_path.read_text())
        config_json["quantization_config"] = quant_config
        config_path.write_text(json.dumps(config_json, indent=2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    done_marker.write_text(kind + "\n")
    return out
