"""A trained model built here: SmolLM2-135M's shape, its weights trained on this repository's docs.

The machines that run the tests reach no model hub, and the random weights of the other built models say nothing
of a real model's values (their logits are flat, every token as likely). This one is trained, briefly, by real
gradient steps: SmolLM2-135M's architecture (Llama: hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV
heads, tied embeddings, rope theta 100000, 8k context) with a byte-level BPE tokenizer of 8192 tokens, both
trained on ``docs/*.md`` and ``README.md``; AdamW, bf16 autocast, ``STEPS`` steps of 4 x 128 tokens. The loss it
reached is in ``training.json`` beside the weights. 111 M parameters, 222 MB of bf16 safetensors. Used by
``benchmarks/bench_compile.py --sizes trained``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: SmolLM2-135M's shape (its ``config.json``), the vocabulary this tokenizer's.
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    vocab_size=8192,
)
STEPS = 24
BATCH, CONTEXT = 4, 128
_DONE = "training.json"


def corpus() -> list[str]:
    """The text it learns: this repository's docs, a paragraph a sample."""
    texts = [path.read_text() for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]]
    return [part.strip() for text in texts for part in text.split("\n\n") if part.strip()]


def build(out_dir: str | Path, steps: int = STEPS, seed: int = 0) -> Path:
    """The model directory (an existing complete one is reused), trained ``steps`` steps."""
    out = Path(out_dir)
    if (out / _DONE).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        _train(building, steps, seed)
        shutil.rmtree(out, ignore_errors=True)
        building.rename(out)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return out


def _tokenizer(out: Path, texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SMOLLM2_135M["vocab_size"],
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>", bos_token="<|endoftext|>"
    )
    fast.save_pretrained(out)
    return fast


def _train(out: Path, steps: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = corpus()
    tokenizer = _tokenizer(out, texts)
    eos = tokenizer.eos_token_id
    ids = torch.tensor([t for text in texts for t in [*tokenizer(text)["input_ids"], eos]], dtype=torch.long)

    torch.manual_seed(seed)
    config = LlamaConfig(**SMOLLM2_135M, bos_token_id=eos, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    started = time.perf_counter()
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - CONTEXT - 1, (BATCH,), generator=generator)
        batch = torch.stack([ids[s : s + CONTEXT] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))

    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied: the embedding is the head
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    record = {"steps": steps, "batch": BATCH, "context": CONTEXT, "corpus_tokens": len(ids), "seed": seed,
              "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
              "seconds": round(time.perf_counter() - started, 1), "threads": torch.get_num_threads()}  # fmt: skip
    (out / _DONE).write_text(json.dumps(record, indent=1) + "\n")
