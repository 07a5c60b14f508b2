"""One compiling engine (torch.compile on, no enforce_eager) on real vLLM, in a process of its own: what a cold
machine's start is. Prints ``COMPILED_RESULT {json}``: greedy tokens of the demo prompts, seconds until ``LLM()``
returned, the manifest loader's report (None for vLLM's default loader) and inductor's cache counters: a graph
compiled is an ``fxgraph_cache_miss``, one loaded from a cache an ``fxgraph_cache_hit`` (on CPU vLLM runs
torch.compile with inductor directly, and its own log says neither).

Usage: python tests/scenarios/compiled_engine.py MODEL LOAD_FORMAT [LOADER_CONFIG_JSON] [--eager] [--tp N]

At ``--tp 2`` the ranks compile in processes of their own (threads bound one core each): inductor's counters are
theirs, and the log (each rank's line of the loader) says what was compiled.

Run each with its own ``VLLM_CACHE_ROOT`` (an empty directory): vLLM's own compile cache of a run before would
make the start warm without any compile form.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> dict:
    argv = sys.argv[1:]
    tp = int(argv.pop(argv.index("--tp") + 1)) if "--tp" in argv else 1
    args = [a for a in argv if a not in ("--eager", "--tp")]
    model, load_format = args[0], args[1]
    loader_config = json.loads(args[2]) if len(args) > 2 else None
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in range(tp))  # one NUMA node here
    from tensorizer_manifest.cli.demo import generate_tokens

    report: dict | None = {} if load_format != "auto" else None
    tokens, _, startup = generate_tokens(
        model, load_format, max_tokens=8, report=report, loader_config=loader_config,
        enforce_eager="--eager" in sys.argv, tensor_parallel_size=tp,
    )  # fmt: skip
    from torch._dynamo.utils import counters

    inductor = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    return {"tokens": tokens, "startup": startup, "report": report, "inductor": inductor}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers
    from helpers.scenario import run_scenario

    run_scenario("COMPILED_RESULT", main)
