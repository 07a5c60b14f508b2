"""Tensor parallel (TP=2) on CPU: save one tensor file and manifest per rank, load them back.

Then two re-saves that fail on rank 1 only:
- before the ranks vote: a running engine (vLLM's default loader) whose rank 1 has a weight changed in place
  saves itself into the checkpoint; rank 1's rebuild refuses, rank 0 wrote its part but commits nothing, so
  every file of the checkpoint stays byte for byte as it was (the checkpoint that loaded token-exact);
- after the vote, in rank 1's own commit (its lock file cannot be opened: a file system error on one rank),
  after rank 0 committed: the checkpoint's ranks come from two saves, and loading it is refused before any
  tensor is read, naming both.

Format version 2 (one manifest per rank, each committed by its rank after the vote), named explicitly: its
failure between the ranks' commits is what this shows. Version 3 commits every rank at once
(``scenarios/generations.py``: a TP=2 save and load of the default format, and a load racing a re-save).

Usage: python tests/scenarios/tensor_parallel.py WORKDIR. Prints ``TP_RESULT {json}``.
vLLM's CPU workers need their threads bound by hand on a one-NUMA-node machine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/, for helpers


def main() -> None:
    workdir = sys.argv[1]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # each engine's core in its process: half a TP=2 start
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from helpers.errors import error_chain
    from helpers.worker_tools import TEST_WORKER_EXTENSION
    from vllm import LLM

    from tensorizer_manifest.cli.demo import engine_options, generate_tokens, greedy_tokens
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model
    from tensorizer_manifest.save.from_source import save_checkpoint, shutdown
    from tensorizer_manifest.storage.checkpoint import load_manifest

    model_dir = build_tiny_model(os.path.join(workdir, "tiny-qwen3-tied"), "qwen3-tied")
    out = os.path.join(workdir, "ckpt-qwen3-tied-tp2")
    engine = {"distributed_executor_backend": "mp", "tensor_parallel_size": 2}
    # One default-loader engine for the reference tokens and, after them, the running engine's refused save.
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))  # workers
    running = LLM(model=str(model_dir), **engine_options(worker_extension_cls=TEST_WORKER_EXTENSION, **engine))
    reference, _ = greedy_tokens(running)
    saved = save_checkpoint(
        model_dir,
        out,
        dtype="bfloat16",
        max_model_len=128,
        tensor_parallel_size=2,
        engine_args={"distributed_executor_backend": "mp"},
        format_version=2,
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
                "save_id": manifest.save_id,
            }
        )
    result = {"reference": reference, "tokens": tokens, "saved": saved.ranks, "ranks": ranks}

    def files() -> dict[str, bytes | int]:
        """The checkpoint's manifests by content and tensor files by size."""
        return {
            name: (Path(out, name).read_bytes() if name.endswith(".json") else Path(out, name).stat().st_size)
            for name in sorted(os.listdir(out))
            if name.endswith((".manifest.json", ".tensors"))
        }

    before = files()
    llm = running
    try:
        nudge = (1, "layers.0.post_attention_layernorm.weight", 0.5)  # rank 1 only
        result["nudged"] = llm.collective_rpc("tm_test_add_to_weight", args=nudge)
        try:
            llm.collective_rpc("save_tensorizer_manifest", args=(out,), kwargs={"format_version": 2})
            result["voted_down_save"] = None
        except Exception as exc:  # noqa: BLE001
            result["voted_down_save"] = error_chain(exc)
    finally:
        shutdown(llm)
    result["unchanged_by_voted_down_save"] = files() == before
    result["files_before"] = sorted(before)

    blocked = os.path.join(out, ".model-tp1-of-2.manifest.json.lock")
    os.unlink(blocked)
    os.mkdir(blocked)  # rank 1 cannot take its commit lock; rank 0 can
    try:
        save_checkpoint(model_dir, out, dtype="bfloat16", max_model_len=128, tensor_parallel_size=2,
                        engine_args={"distributed_executor_backend": "mp"}, format_version=2)  # fmt: skip
        result["failed_save"] = None
    except Exception as exc:  # noqa: BLE001
        result["failed_save"] = error_chain(exc)
    result["save_ids_after_failure"] = [
        load_manifest(os.path.join(out, f"model-tp{rank}-of-2.manifest.json"))[0].save_id for rank in range(2)
    ]
    try:
        result["mixed_tokens"], _, _ = generate_tokens(out, "tensorizer_manifest", **engine)
    except Exception as exc:  # noqa: BLE001
        result["mixed_tokens"] = None
        result["mixed_error"] = error_chain(exc)
    print("TP_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    os._exit(0)
