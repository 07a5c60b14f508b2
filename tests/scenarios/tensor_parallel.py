"""Tensor parallel (TP=2) on CPU: save one tensor file and manifest per rank, load them back.

Usage: python tests/scenarios/tensor_parallel.py WORKDIR. Prints ``TP_RESULT {json}``.
vLLM's CPU workers need their threads bound by hand on a one-NUMA-node machine.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    workdir = sys.argv[1]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from tensorizer_manifest.checkpoint import load_manifest
    from tensorizer_manifest.demo import generate_tokens
    from tensorizer_manifest.save import save_checkpoint
    from tensorizer_manifest.tiny import build_tiny_model

    model_dir = build_tiny_model(os.path.join(workdir, "tiny-qwen3-tied"), "qwen3-tied")
    out = os.path.join(workdir, "ckpt-qwen3-tied-tp2")
    engine = {"distributed_executor_backend": "mp", "tensor_parallel_size": 2}
    reference, _, _ = generate_tokens(model_dir, "auto", **engine)
    saved = save_checkpoint(
        model_dir,
        out,
        dtype="bfloat16",
        max_model_len=128,
        tensor_parallel_size=2,
        engine_args={"distributed_executor_backend": "mp"},
    )
    tokens, _, _ = generate_tokens(out, "tensorizer_manifest", **engine)
    ranks = []
    for rank in range(2):
        manifest, _ = load_manifest(os.path.join(out, f"model-tp{rank}-of-2.manifest.json"))
        ranks.append(
            {
                "rank": manifest.fingerprint.tensor_parallel_rank,
                "size": manifest.fingerprint.tensor_parallel_size,
                "digest": manifest.tensor_file.digest,
            }
        )
    print(
        "TP_RESULT " + json.dumps({"reference": reference, "tokens": tokens, "saved": saved.ranks, "ranks": ranks}),
        flush=True,
    )


if __name__ == "__main__":
    main()
    os._exit(0)
