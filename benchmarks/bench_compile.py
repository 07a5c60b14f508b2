"""Time to ready, phase by phase: vLLM's cold and warm compiling starts, a start with the checkpoint's compile form,
and eager starts through this package and through vLLM's default loader.

    .venv/bin/python benchmarks/bench_compile.py                        # tiny and real size, 3 rounds
    .venv/bin/python benchmarks/bench_compile.py --sizes trained --rounds 3 --out docs/benchmarks/compile-trained.json

Per size (``tiny``: the demo's Llama; ``1b``: Llama-3.2-1B's shape, ``tests/helpers/real_size.py``; ``trained``:
SmolLM2-135M's shape trained here on the repository's docs, ``tests/helpers/trained.py``), an engine with the demo's
serving settings (context 128, one sequence), each start a fresh process with an empty ``VLLM_CACHE_ROOT``, timed
from the process's spawn to its first answer (8 greedy tokens), split into phases (``start_phases.py``: the
interpreter, torch's and vLLM's imports, the engine's set-up, the model's load, dynamo's trace, inductor, the
warm-up forward, the KV cache, the first answer). Paths: ``cold`` (vLLM's default loader from the source, torch.compile
on: vLLM's defaults), ``warm`` (the same again, with the cache ``cold`` left: vLLM's own warm restart on the machine
that compiled), ``form`` (the checkpoint, after ``add-form --compile`` with the same settings; its compile form used
under ``trust_compile_forms``), ``eager`` (the checkpoint, ``enforce_eager``, under the same trust) and
``default-eager`` (vLLM's default loader from the source, ``enforce_eager``: the eager baseline). Under that trust
both checkpoint paths place vLLM's record of the model's class that the checkpoint carries, so neither inspects
the class in a fresh interpreter, as vLLM's own paths do in their empty caches (``warm`` finds ``cold``'s record).
Paths alternate within a round, ratios are taken per round (the whole start and ``LLM()`` alone), then median, min
and max; every path's first answer is compared with vLLM's default loader's in the same mode (``cold`` for the
compiled paths, ``default-eager`` for ``eager``).
Figures, never assertions. Writes ``--out`` (JSON) and, with matplotlib, ``--plot`` (PNG).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_load import machine, paired_run_arguments, spread  # this folder is on sys.path when a script here runs

ROOT = Path(__file__).resolve().parent.parent
MARK = "BENCH_COMPILE "
PATHS = ("cold", "warm", "form", "eager", "default-eager")
#: The order of a round, reversed every other round: ``warm`` reuses the cache its round's ``cold`` left.
BLOCKS = (("cold", "warm"), ("form",), ("eager",), ("default-eager",))
#: The ratios taken per round (numerator, denominator), on the whole start and on ``LLM()`` alone.
RATIOS = (("form", "cold"), ("form", "warm"), ("form", "eager"), ("warm", "cold"), ("eager", "default-eager"))
SERVING = {"max_model_len": 128, "max_num_seqs": 1, "kv_cache_memory_bytes": 64 << 20}


def prepare(work: Path, size: str) -> dict:
    """The source model, its checkpoint and the checkpoint's compile form for the serving settings."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import real_size

    from tensorizer_manifest.embedded_models.tiny import build_tiny_model
    from tensorizer_manifest.save.add_form import add_form
    from tensorizer_manifest.save.from_source import save_checkpoint
    from tensorizer_manifest.storage.checkpoint import load_generation

    if size == "tiny":
        model_dir = build_tiny_model(work / "tiny-llama", "llama")
    elif size == "trained":
        from helpers import trained

        model_dir = trained.build(work / "trained")
    else:
        model_dir = real_size.build(work / "1b")
    checkpoint = work / f"{size}-ckpt"
    found = load_generation(checkpoint) if (checkpoint / "tensorizer-manifest.json").exists() else None
    seconds = None
    if found is None or not found[0].compile_forms:
        shutil.rmtree(checkpoint, ignore_errors=True)
        save_checkpoint(model_dir, checkpoint, dtype="bfloat16")
        before = os.environ.get("VLLM_CACHE_ROOT")
        with tempfile.TemporaryDirectory() as cache:
            os.environ["VLLM_CACHE_ROOT"] = cache  # compiles cold, whatever this machine's vLLM cache holds
            started = time.perf_counter()
            try:
                add_form(checkpoint, compile=True, engine_args={"dtype": "bfloat16", **SERVING})
            finally:  # the next size's save finds vLLM's record of its class where vLLM keeps it
                if before is None:
                    os.environ.pop("VLLM_CACHE_ROOT", None)
                else:
                    os.environ["VLLM_CACHE_ROOT"] = before
            seconds = time.perf_counter() - started
        found = load_generation(checkpoint)
    (form,) = found[0].compile_forms
    return {"model_dir": str(model_dir), "checkpoint": str(checkpoint), "form_bytes": form.archive.size,
            "form_files": len(form.files), "add_form_seconds": seconds}  # fmt: skip


def child(model: str, path: str) -> None:
    """One engine's start on ``path`` in this process (an empty vLLM cache: ``run_child``), to its first answer,
    timed phase by phase (``start_phases``)."""
    from start_phases import StartClock

    clock = StartClock()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with clock.phase("import torch"):
        import torch  # noqa: F401
    with clock.phase("import vllm"):
        from vllm import LLM, SamplingParams
    clock.watch_vllm()

    from tensorizer_manifest.save.from_source import shutdown

    eager = path in ("eager", "default-eager")
    options = dict(dtype="bfloat16", seed=0, enforce_eager=eager, **SERVING)
    if path in ("form", "eager"):
        from tensorizer_manifest._constants import WORKER_EXTENSION

        options.update(load_format="tensorizer_manifest", worker_extension_cls=WORKER_EXTENSION,
                       model_loader_extra_config={"trust_compile_forms": True})  # fmt: skip
    with clock.llm():
        llm = LLM(model=model, **options)
    with clock.phase("first answer"):
        (answer,) = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
    result = clock.result()
    report = llm.collective_rpc("tensorizer_manifest_report")[0] if path == "form" else None
    shutdown(llm)
    used = None if report is None else report.get("compile_form") is not None
    print(MARK + json.dumps({**result, "form_used": used, "tokens": list(answer.outputs[0].token_ids)}), flush=True)


def run_child(model: str, path: str, cache: str | None = None) -> dict:
    """``path`` in a fresh process; its vLLM cache ``cache`` (kept), else an empty one (removed after)."""
    from start_phases import SPAWNED_AT_ENV

    with tempfile.TemporaryDirectory(prefix="bench-compile-cache-") as empty:
        env = {**os.environ, "VLLM_CACHE_ROOT": cache or empty, SPAWNED_AT_ENV: repr(time.time())}
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
    return result


def plot(result: dict, path: Path) -> None:
    """Per size, each path's median start as stacked phases (``start_phases.PHASES``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; `make bench` installs it)")
        return
    from start_phases import PHASES

    sizes = list(result["load"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        summary = result["load"][size]
        bottom = [0.0] * len(PATHS)
        for phase, color in zip(PHASES, plt.get_cmap("tab20").colors, strict=False):
            heights = [summary[p]["phases"][phase] for p in PATHS]
            ax.bar(PATHS, heights, bottom=bottom, label=phase, color=color)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        said = [
            f"{name} {r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"
            for name, r in (("form/cold", summary["whole:form/cold"]), ("form/eager", summary["whole:form/eager"]))
        ]
        ax.set_title(f"{size}: " + ", ".join(said), fontsize=8)
        ax.set_ylabel("seconds from spawn to first answer (median phases)")
        ax.tick_params(axis="x", labelsize=8)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"time to ready, {result['machine']['cores']} cores, vLLM {result['vllm']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def phase_table(result: dict, size: str) -> str:
    """One size's median phases per path as a Markdown table (``docs/performance.md`` prints these)."""
    from start_phases import PHASES

    summary = result["load"][size]
    rows = [f"| phase | {' | '.join(PATHS)} |", "| --- |" + " --- |" * len(PATHS)]
    for phase in PHASES:
        rows.append(f"| {phase} | " + " | ".join(f"{summary[p]['phases'][phase]:.1f}" for p in PATHS) + " |")
    rows.append("| **whole, spawn to first answer** | " + " | ".join(
        f"**{summary[p]['whole']['median']:.1f}** [{summary[p]['whole']['min']:.1f}-{summary[p]['whole']['max']:.1f}]"
        for p in PATHS) + " |")  # fmt: skip
    return "\n".join(rows)


def summarise(runs: list[dict]) -> dict:
    """Per path: the whole start, ``LLM()`` and each phase (median, min, max); the ratios, taken per round."""
    from start_phases import PHASES

    summary: dict = {}
    for path in PATHS:
        summary[path] = {
            "whole": spread([r[path]["whole"] for r in runs]),
            "llm_seconds": spread([r[path]["llm_seconds"] for r in runs]),
            "phases": {ph: statistics.median(r[path]["phases"][ph] for r in runs) for ph in PHASES},
        }
    for top, bottom in RATIOS:
        for measure in ("whole", "llm_seconds"):
            name = f"{'whole' if measure == 'whole' else 'llm'}:{top}/{bottom}"
            summary[name] = spread([r[top][measure] / r[bottom][measure] for r in runs])
    # like with like: a compiled engine's bf16 numerics are not an eager one's (a weakly trained model's near ties
    # can break differently), so each path is compared with vLLM's default loader in its own mode, every round
    summary["same_tokens_as_vllms_default"] = {
        path: all(r[path]["tokens"] == r["default-eager" if path == "eager" else "cold"]["tokens"] for r in runs)
        for path in ("warm", "form", "eager")
    }
    return summary


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
                   "eager": prepared["checkpoint"], "default-eager": prepared["model_dir"]}  # fmt: skip
        runs = []
        for round_ in range(args.rounds):
            order = [p for block in (BLOCKS if round_ % 2 == 0 else reversed(BLOCKS)) for p in block]
            measured = {}
            with tempfile.TemporaryDirectory(prefix="bench-compile-round-") as kept:
                for path in order:
                    cache = kept if path in ("cold", "warm") else None
                    measured[path] = run_child(targets[path], path, cache)
            runs.append(measured)
            print(size, round_, json.dumps({p: round(m["whole"], 2) for p, m in measured.items()}), flush=True)
        result["runs"][size] = runs
        result["load"][size] = summarise(runs)
        print(size, json.dumps({k: v for k, v in result["load"][size].items() if ":" in k}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    for size in result["load"]:
        print(f"\n{size}, seconds (median of {args.rounds} rounds):\n{phase_table(result, size)}")
    plot(result, args.plot)


if __name__ == "__main__":
    main()
