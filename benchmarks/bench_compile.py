"""Time to ready: a cold compiling engine against one started with the checkpoint's compile form.

    .venv/bin/python benchmarks/bench_compile.py                        # tiny and real size, 3 rounds
    .venv/bin/python benchmarks/bench_compile.py --sizes tiny --rounds 5

Per size (``tiny``: the demo's Llama; ``1b``: Llama-3.2-1B's shape, ``tests/helpers/real_size.py``), the whole
``LLM()`` of an engine with torch.compile on and the demo's serving settings (context 128, one sequence), each in a
fresh process with an empty ``VLLM_CACHE_ROOT``: ``cold`` (vLLM's default loader from the source, vLLM's defaults:
the baseline of every ratio), ``warm`` (the same again, with the cache ``cold`` left: vLLM's own warm restart on the
machine that compiled), ``form`` (the checkpoint, after ``add-form --compile`` with the same settings; its
compile form used under ``trust_compile_forms``) and ``eager`` (the checkpoint, ``enforce_eager``: no compile at
all, the floor). Paths alternate within a round, ratios are taken per round, then median, min and max. Figures,
never assertions. Writes ``--out`` (JSON) and, with matplotlib, ``--plot`` (PNG).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_load import machine, paired_run_arguments, spread  # this folder is on sys.path when a script here runs

ROOT = Path(__file__).resolve().parent.parent
MARK = "BENCH_COMPILE "
PATHS = ("cold", "warm", "form", "eager")
#: The order of a round, reversed every other round: ``warm`` reuses the cache its round's ``cold`` left.
BLOCKS = (("cold", "warm"), ("form",), ("eager",))
SERVING = {"max_model_len": 128, "max_num_seqs": 1, "kv_cache_memory_bytes": 64 << 20}


def prepare(work: Path, size: str) -> dict:
    """The source model, its checkpoint and the checkpoint's compile form for the serving settings."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import real_size

    from tensorizer_manifest.embedded_models.tiny import build_tiny_model
    from tensorizer_manifest.save.add_form import add_form
    from tensorizer_manifest.save.from_source import save_checkpoint
    from tensorizer_manifest.storage.checkpoint import load_generation

    model_dir = build_tiny_model(work / "tiny-llama", "llama") if size == "tiny" else real_size.build(work / "1b")
    checkpoint = work / f"{size}-ckpt"
    found = load_generation(checkpoint) if (checkpoint / "tensorizer-manifest.json").exists() else None
    seconds = None
    if found is None or not found[0].compile_forms:
        shutil.rmtree(checkpoint, ignore_errors=True)
        save_checkpoint(model_dir, checkpoint, dtype="bfloat16")
        with tempfile.TemporaryDirectory() as cache:
            os.environ["VLLM_CACHE_ROOT"] = cache
            started = time.perf_counter()
            add_form(checkpoint, compile=True, engine_args={"dtype": "bfloat16", **SERVING})
            seconds = time.perf_counter() - started
        found = load_generation(checkpoint)
    (form,) = found[0].compile_forms
    return {"model_dir": str(model_dir), "checkpoint": str(checkpoint), "form_bytes": form.archive.size,
            "form_files": len(form.files), "add_form_seconds": seconds}  # fmt: skip


def child(model: str, path: str) -> None:
    """One engine's ``LLM()`` on ``path``, timed, in this process (an empty vLLM cache: ``run_child``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from tensorizer_manifest.save.from_source import shutdown

    options = dict(dtype="bfloat16", seed=0, enforce_eager=path == "eager", **SERVING)
    if path != "cold":
        from tensorizer_manifest._constants import WORKER_EXTENSION

        options.update(load_format="tensorizer_manifest", worker_extension_cls=WORKER_EXTENSION,
                       model_loader_extra_config={"trust_compile_forms": True})  # fmt: skip
    started = time.perf_counter()
    llm = LLM(model=model, **options)
    seconds = time.perf_counter() - started
    report = llm.collective_rpc("tensorizer_manifest_report")[0] if path == "form" else None
    shutdown(llm)
    used = None if report is None else report.get("compile_form") is not None
    print(MARK + json.dumps({"llm_seconds": seconds, "form_used": used}), flush=True)


def run_child(model: str, path: str, cache: str | None = None) -> float:
    """``path`` in a fresh process; its vLLM cache ``cache`` (kept), else an empty one (removed after)."""
    with tempfile.TemporaryDirectory(prefix="bench-compile-cache-") as empty:
        env = {**os.environ, "VLLM_CACHE_ROOT": cache or empty}
        env.pop("VLLM_USE_AOT_COMPILE", None)  # vLLM's default in every child; the loader sets it where a form is used
        proc = subprocess.run(
            [sys.executable, __file__, "child", model, "cold" if path == "warm" else path],
            capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env,
        )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{path} on {model} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len(MARK) :])
    if path == "form" and not result["form_used"]:
        raise RuntimeError(f"the compile form of {model} was not used:\n{proc.stderr[-3000:]}")
    return result["llm_seconds"]


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; `make bench` installs it)")
        return
    sizes = list(result["load"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        summary = result["load"][size]
        med = [summary[p]["median"] for p in PATHS]
        low = [m - summary[p]["min"] for m, p in zip(med, PATHS, strict=True)]
        high = [summary[p]["max"] - m for m, p in zip(med, PATHS, strict=True)]
        ax.bar(PATHS, med, yerr=[low, high], capsize=4)
        ratio = summary["form_vs_cold"]
        ax.set_title(f"{size}: form / cold {ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}]", fontsize=9)
        ax.set_ylabel("LLM() seconds (median, min-max)")
    fig.suptitle(f"time to ready, compile on, {result['machine']['cores']} cores", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,1b")
    paired_run_arguments(parser, "compile")
    args = parser.parse_args()

    import torch

    from tensorizer_manifest import _vllm_compat
    from tensorizer_manifest.load.compile_placement import machine_kind

    args.work.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "machine": {**machine(), "kind": machine_kind()},
        "vllm": _vllm_compat.vllm_version(),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "forms": {},
        "load": {},
        "runs": {},
    }
    for size in args.sizes.split(","):
        prepared = prepare(args.work, size)
        result["forms"][size] = {k: prepared[k] for k in ("form_bytes", "form_files", "add_form_seconds")}
        print(size, json.dumps(result["forms"][size]), flush=True)
        targets = {"cold": prepared["model_dir"], "warm": prepared["model_dir"], "form": prepared["checkpoint"],
                   "eager": prepared["checkpoint"]}  # fmt: skip
        runs = []
        for round_ in range(args.rounds):
            order = [p for block in (BLOCKS if round_ % 2 == 0 else reversed(BLOCKS)) for p in block]
            seconds = {}
            with tempfile.TemporaryDirectory(prefix="bench-compile-round-") as kept:
                for path in order:
                    cache = kept if path in ("cold", "warm") else None
                    seconds[path] = run_child(targets[path], path, cache)
            runs.append(seconds)
            print(size, round_, json.dumps(seconds), flush=True)
        result["runs"][size] = runs
        result["load"][size] = {
            **{path: spread([r[path] for r in runs]) for path in PATHS},
            "form_vs_cold": spread([r["form"] / r["cold"] for r in runs]),
            "warm_vs_cold": spread([r["warm"] / r["cold"] for r in runs]),
            "form_vs_warm": spread([r["form"] / r["warm"] for r in runs]),
            "eager_vs_cold": spread([r["eager"] / r["cold"] for r in runs]),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    plot(result, args.plot)


if __name__ == "__main__":
    main()
