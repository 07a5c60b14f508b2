"""Does the hand-written safetensors reader pay? A save read through it, against vLLM's own (mmap) reader.

    .venv/bin/python benchmarks/bench_source_weights.py               # the large model (1.07 GB), 5 rounds

A capture save (``save_checkpoint``, ``bench_load.py child save``) reads the source model's safetensors
through vLLM's default loader. ``unmapped``: as shipped, vLLM's lazy iterator replaced by
``storage/source_weights.iter_safetensors`` (positional reads into fresh memory, one tensor at a time).
``mapped``: vLLM's own iterator (``safe_open``, which maps the file). Each save is a fresh process; the two
alternate within a round (one starts the odd rounds, the other the even ones), on a model whose file is in
the page cache after the first round. Figures per reader, median [min-max]: the whole save's time; peak
resident memory while vLLM loads (all of it, ``VmRSS``, and the part backed by files, ``RssFile``: mapped
pages) and over the whole save (``VmHWM``). Figures, never assertions. Writes ``--out`` (JSON) and ``--plot``.

Mapped pages are clean and can be reclaimed, so RSS alone does not say whether a reader needs more memory.
``--limits 2300,1900`` (root, a writable cgroup v1 memory controller) also runs one save per reader under
each memory limit, in a memory cgroup of its own, the page cache dropped first (a page cached before is
charged to whoever read it first): whether it completes, its time, how often it hit the limit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from bench_load import spread  # this folder is on sys.path when a script here runs

ROOT = Path(__file__).resolve().parent.parent
READERS = ("unmapped", "mapped")


def fmt(s: dict, unit: str) -> str:
    return f"{s['median']:.1f} {unit} [{s['min']:.1f}-{s['max']:.1f}]"


def summarise(runs: dict[str, list[dict]]) -> dict:
    return {
        reader: {
            "seconds": spread([r["seconds"] for r in rs]),
            "load_rss_mb": spread([r["rss_by_phase_mb"]["load"]["rss"] for r in rs]),
            "load_file_mb": spread([r["rss_by_phase_mb"]["load"]["file"] for r in rs]),
            "load_anon_mb": spread([r["rss_by_phase_mb"]["load"]["anon"] for r in rs]),
            "peak_rss_mb": spread([r["peak_rss_mb"] for r in rs]),
        }
        for reader, rs in runs.items()
    }


def ratios(runs: dict[str, list[dict]], key) -> dict:
    """mapped / unmapped, round by round (the two ran back to back)."""
    return spread([key(m) / key(u) for u, m in zip(runs["unmapped"], runs["mapped"], strict=True)])


def own_memory_cgroup() -> Path:
    """This process's cgroup v1 memory controller directory (where a child cgroup can be made)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "memory":
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    raise SystemExit("--limits needs a cgroup v1 memory controller")


def save_under_limit(model: Path, out: Path, reader: str, limit_mb: int) -> dict:
    """One save in a memory cgroup limited to ``limit_mb``, the page cache dropped first."""
    import os
    import subprocess
    import time

    group = own_memory_cgroup() / f"bench-source-weights-{os.getpid()}"
    group.mkdir(exist_ok=True)
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1")
        (group / "memory.limit_in_bytes").write_text(str(limit_mb << 20))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
               "HF_HUB_OFFLINE": "1", "BENCH_SOURCE_READER": reader}  # fmt: skip
        script = ROOT / "benchmarks" / "bench_load.py"
        start = time.perf_counter()
        proc = subprocess.run(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs; exec "$0" "$@"', sys.executable, str(script),
             "child", "save", str(model), str(out)],
            capture_output=True, text=True, env=env, timeout=1800,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        oom = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
        return {"reader": reader, "limit_mb": limit_mb, "completed": proc.returncode == 0, "seconds": seconds,
                "hit_limit": int((group / "memory.failcnt").read_text()), "oom_kill": int(oom.get("oom_kill", 0)),
                "max_usage_mb": int((group / "memory.max_usage_in_bytes").read_text()) >> 20}  # fmt: skip
    finally:
        shutil.rmtree(out, ignore_errors=True)
        group.rmdir()


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    metrics = (("load_rss_mb", "RSS while\nvLLM loads"), ("load_file_mb", "of it,\nfile-backed"),
               ("peak_rss_mb", "peak RSS,\nwhole save"))  # fmt: skip
    width = 0.38
    for i, reader in enumerate(READERS):
        rows = [summary[reader][m] for m, _ in metrics]
        xs = [j + (i - 0.5) * width for j in range(len(metrics))]
        medians = [r["median"] for r in rows]
        errors = [[r["median"] - r["min"] for r in rows], [r["max"] - r["median"] for r in rows]]
        left.bar(xs, medians, width, yerr=errors, capsize=3, label=reader)
        t = summary[reader]["seconds"]
        right.bar([i], [t["median"]], 0.6, yerr=[[t["median"] - t["min"]], [t["max"] - t["median"]]], capsize=3)
    left.set_xticks(range(len(metrics)), [label for _, label in metrics])
    left.set_ylabel("MB")
    left.legend()
    right.set_xticks(range(len(READERS)), READERS)
    right.set_ylabel("seconds (whole save)")
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="large", choices=("small", "medium", "large", "1b"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "source-weights.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "benchmarks" / "source-weights.png")
    parser.add_argument("--limits", default="", help="memory limits in MB, comma-separated (root, cgroup v1)")
    parser.add_argument("--limits-only", action="store_true", help="only the runs under --limits")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_load

    model = bench_load.build_model(args.work, args.size)
    model_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e6
    limited = []
    for limit in [int(x) for x in args.limits.split(",") if x]:
        for reader in READERS:
            limited.append(save_under_limit(model, args.work / f"source-weights-{reader}", reader, limit))
            print(f"under {limit} MB, {reader}: {json.dumps(limited[-1])}", flush=True)
    if args.limits_only:
        document = json.loads(args.out.read_text()) if args.out.exists() else {}
        args.out.write_text(json.dumps({**document, "under_limits": limited}, indent=1) + "\n")
        return
    runs: dict[str, list[dict]] = {reader: [] for reader in READERS}
    for round_ in range(args.rounds):
        for reader in READERS if round_ % 2 == 0 else READERS[::-1]:
            out = args.work / f"source-weights-{reader}"
            shutil.rmtree(out, ignore_errors=True)
            result = bench_load.run_child("save", str(model), str(out), env={"BENCH_SOURCE_READER": reader})
            shutil.rmtree(out, ignore_errors=True)
            runs[reader].append(result)
            print(f"round {round_} {reader}: {json.dumps(result)}", flush=True)
    summary = summarise(runs)
    paired = {
        "seconds": ratios(runs, lambda r: r["seconds"]),
        "load_rss": ratios(runs, lambda r: r["rss_by_phase_mb"]["load"]["rss"]),
        "peak_rss": ratios(runs, lambda r: r["peak_rss_mb"]),
    }
    print(f"\n{args.size}: {model_mb:.0f} MB of safetensors, {args.rounds} rounds")
    for reader in READERS:
        s = summary[reader]
        print(f"  {reader:9s} save {fmt(s['seconds'], 's')}; while vLLM loads: RSS {fmt(s['load_rss_mb'], 'MB')}, "
              f"file-backed {fmt(s['load_file_mb'], 'MB')}; whole save peak {fmt(s['peak_rss_mb'], 'MB')}")  # fmt: skip
    for name, r in paired.items():
        print(f"  mapped / unmapped, paired: {name} {r['median']:.2f} x [{r['min']:.2f}-{r['max']:.2f}]")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    document = {"size": args.size, "model_mb": model_mb, "summary": summary, "paired": paired, "runs": runs,
                "under_limits": limited}  # fmt: skip
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    plot(summary, args.plot, f"{args.size} model ({model_mb:.0f} MB): save with each safetensors reader")
    print(f"results: {args.out}, plot: {args.plot}")


if __name__ == "__main__":
    main()
