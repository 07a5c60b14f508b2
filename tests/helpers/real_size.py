"""A model of real size: Llama-3.2-1B's shape with random weights.

Built by ``tiny.build_tiny_model`` as the ``llama3-128k`` family kind (128k context, llama3 rope
scaling) at Llama-3.2-1B's sizes: hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV heads
(head_dim 64), vocab 128256, tied embeddings; 1.24 B parameters, 2.47 GB of bf16 safetensors. The
tokenizer is the tiny one (its vocabulary is smaller than the model's; the model can still emit any
id). Used by ``tests/scenarios/real_size.py`` and ``benchmarks/bench_load.py --sizes 1b``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

KIND = "llama3-128k"
#: Llama-3.2-1B's sizes, as ``build_tiny_model`` overrides. The family sets the 128k context and the
#: llama3 rope scaling itself (rope_theta 500000, factor 32, low 1, high 4, original 8192).
LLAMA_3_2_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    tie_word_embeddings=True,
)
#: The engine's dtype for it: the family runs float32 by default (10 GB of weights here); the real model is bf16.
DTYPE = "bfloat16"


def build(out_dir: str | Path, **overrides) -> Path:
    """The model directory (built once: an existing complete one is reused), checked against the shape."""
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    sizes = {**LLAMA_3_2_1B, **overrides}
    out = build_tiny_model(out_dir, KIND, **sizes)
    config = json.loads((Path(out) / "config.json").read_text())
    wanted = {**sizes, "max_position_embeddings": 131072}
    got = {k: config.get(k) for k in wanted}
    assert got == wanted, f"{out}: config differs from the shape asked for: {got} != {wanted}"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    assert {k: rope.get(k) for k in llama3} == llama3, rope
    return Path(out)


def weight_bytes(model_dir: str | Path) -> int:
    """Bytes of tensor data in the directory's safetensors files (from their headers; nothing is read)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(end - begin for key, v in header.items() if key != "__metadata__" for begin, end in
                     [v["data_offsets"]])  # fmt: skip
    return total


class AnonymousPeak:
    """The highest anonymous resident memory (``RssAnon`` + ``RssShmem``) of this process while the block runs,
    sampled every 10 ms by a thread: the memory no reclaim can take back. File-backed pages (the safetensors
    vLLM's loader maps) are left out: clean, and reclaimed under a memory limit before anything is killed."""

    def __init__(self, interval: float = 0.01) -> None:
        import threading

        self.interval = interval
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now_mib() -> float:
        kib = 0
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    kib += int(line.split()[1])
        return kib / 1024

    def _run(self) -> None:
        while True:
            self.peak_mib = max(self.peak_mib, self.now_mib())
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> AnonymousPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mib = max(self.peak_mib, self.now_mib())


def peak_rss_mib() -> float:
    """This process's peak resident memory: ``VmHWM``, the high-water mark of its own address space.

    Not ``ru_maxrss``: Linux carries that across ``execve`` from the address space the new program
    replaces, which for a child started by ``subprocess`` (vfork) is its parent's, so a child reports at
    least its parent's peak (a scenario that built this model first: 3.3 GB, whatever the child did).
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
