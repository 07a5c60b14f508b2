"""Where the mixed path's time goes: every oneDNN weight packing of one engine start, call by call.

    export VLLM_ENABLE_V1_MULTIPROCESSING=0
    .venv/bin/python benchmarks/trace_packing.py default .cache/bench/model-large
    .venv/bin/python benchmarks/trace_packing.py manifest-mixed .cache/bench/ckpt-large-mixed

The path and directory are those of ``bench_load.py`` (run it first: it builds the models and checkpoints).
For each call of vLLM's ``create_onednn_mm`` (the raw linear layers' post-load step on CPU, and the
embedding/LM-head dispatch) it records the wall time, the process's user and system CPU time and its minor
page faults, and prints one JSON line (``TRACE {...}``). The same weights packed in both loaders should
cost the same; where they do not, the system time per fault shows whether the kernel, not the work, differs.
Figures, never assertions.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_load  # noqa: E402  (standard library only at its top: --help stays fast)

#: bench_load's paths that load a model directory alone (``tensorizer`` also needs its native file).
TRACEABLE = tuple(p for p in (*bench_load.PATHS, *bench_load.EXTRA_PATHS) if p != "tensorizer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "path", choices=TRACEABLE, metavar="PATH", help=f"the bench_load.py path to load with: {', '.join(TRACEABLE)}"
    )
    parser.add_argument(
        "model_dir", type=Path, metavar="DIR", help="the model or checkpoint directory bench_load.py built"
    )
    args = parser.parse_args()
    from vllm import _custom_ops as ops

    calls: list[dict] = []
    create = ops.create_onednn_mm

    def traced(weight, cache_size):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        handler = create(weight, cache_size)
        seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        calls.append(
            {
                "shape": list(weight.shape),
                "seconds": round(seconds, 4),
                "user_s": round(after.ru_utime - before.ru_utime, 4),
                "system_s": round(after.ru_stime - before.ru_stime, 4),
                "minor_faults": after.ru_minflt - before.ru_minflt,
            }
        )
        return handler

    ops.create_onednn_mm = traced  # vLLM calls it through the module: every packing passes here
    result = bench_load.load(args.path, str(args.model_dir), "")
    layers = [c for c in calls if max(c["shape"]) < 32000]  # the raw linears; the vocab-sized ones apart
    summary = {
        "path": args.path,
        "load_model": result["seconds"].get("load_model"),
        "tokens": result.get("tokens"),
        "error": result.get("error"),
        "calls": calls,
        "layers": {
            key: round(sum(c[key] for c in layers), 4) for key in ("seconds", "user_s", "system_s", "minor_faults")
        },
    }
    print("TRACE " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
