"""Load time against the number of engines loading one S3 checkpoint at once (1, 2 and 4), on this machine.

    .venv/bin/python benchmarks/bench_fleet.py                 # the large model (1.07 GB), 3 rounds
    .venv/bin/python benchmarks/bench_fleet.py --size small --rounds 2

The checkpoint is ``bench_load.py``'s ``mixed`` one for ``--size`` (built and saved there when missing),
uploaded once to moto's S3 server on 127.0.0.1, which runs on the same cores as the engines (``--server
http``: served by a plain HTTP server with ranges instead; moto reads a whole object for each ranged GET, about
0.7 s for a 330 MB one here, so the checks' ranged reads cost it what they would not cost S3). Each fleet is
``helpers.fleet.run_fleet``: one process per engine, released together once each has imported vLLM, each
loading with ``load_format="tensorizer_manifest"`` from s3:// (its own access key id) and answering the demo
prompts. Figures per engine: ``load_model`` (reading, checking and restoring the weights, replay included)
and the time from the release to the first answers (fetching the config, the whole ``LLM()``, generation).
Rounds alternate the order of the fleet sizes (1, 2, 4, then 4, 2, 1), and each fleet's figures are also
taken relative to the one-engine fleet of the same round; medians with min and max. Figures, never
assertions. Writes ``--out`` (JSON) and, with matplotlib, ``--plot`` (PNG).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import uuid
from pathlib import Path

from bench_load import spread  # this folder is on sys.path when a script here runs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # helpers: moto's server and the fleet runner
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_load: the models and their checkpoints

FLEETS = (1, 2, 4)
SECRET = "bench-fleet-secret"


def fmt(s: dict, unit: str = "s") -> str:
    return f"{s['median']:.2f} {unit} [{s['min']:.2f}-{s['max']:.2f}]"


def summarise(runs: list[dict]) -> dict:
    """Per fleet size: each engine's load_model and start-to-answer seconds; the fleet's slowest engine; and
    both relative to the same round's single engine."""
    by_round = {(r["round"], r["engines"]): r for r in runs}
    out = {}
    for n in FLEETS:
        mine = [r for r in runs if r["engines"] == n]
        load = [s for r in mine for s in r["load_model"]]
        answer = [s for r in mine for s in r["start_to_answer"]]
        slowest = [max(r["load_model"]) for r in mine]
        ratio = [max(r["load_model"]) / max(by_round[(r["round"], 1)]["load_model"]) for r in mine]
        out[str(n)] = {
            "load_model": spread(load),
            "start_to_answer": spread(answer),
            "slowest_load_model": spread(slowest),
            "slowest_vs_one_engine": spread(ratio),
            "failed": sum(r["failed"] for r in mine),
        }
    return out


def plot(summary: dict, title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; `make bench` installs it)")
        return
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for key, label, color in (
        ("load_model", "load_model, each engine", "#2a7"),
        ("slowest_load_model", "load_model, the fleet's slowest engine", "#c44"),
    ):
        med = [summary[str(n)][key]["median"] for n in FLEETS]
        low = [m - summary[str(n)][key]["min"] for m, n in zip(med, FLEETS, strict=True)]
        high = [summary[str(n)][key]["max"] - m for m, n in zip(med, FLEETS, strict=True)]
        ax.errorbar(FLEETS, med, yerr=[low, high], marker="o", capsize=4, label=label, color=color)
    ax.set_xticks(FLEETS)
    ax.set_xlabel("engines loading one checkpoint at once")
    ax.set_ylabel("seconds (median, min-max)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="large", choices=("small", "medium", "large"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--server", default="s3", choices=("s3", "http"), help="moto's S3 server, or a plain HTTP server with ranges"
    )
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "fleet.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "benchmarks" / "fleet.png")
    args = parser.parse_args()

    import bench_load
    import torch
    from helpers.fleet import Engine, engine_key_id, run_fleet
    from helpers.servers import BUCKET, MotoS3, RangeHTTPServer

    from tensorizer_manifest import _vllm_compat
    from tensorizer_manifest.storage.remote import RemoteOptions
    from tensorizer_manifest.storage.remote_checkpoint import upload_checkpoint

    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "amx": _vllm_compat.has_amx(),
    }
    print(f"machine: {machine}")
    checkpoint = Path(bench_load.prepare(args.work, args.size)["mixed"])
    tensor_bytes = bench_load.tensor_file_of(str(checkpoint)).stat().st_size
    runs = []
    with contextlib.ExitStack() as stack:
        if args.server == "s3":
            s3 = stack.enter_context(MotoS3())
            uri, endpoint = f"s3://{BUCKET}/fleet-bench-{args.size}", s3.endpoint
            upload_checkpoint(checkpoint, uri, RemoteOptions(s3.key_id, s3.secret, s3.endpoint))
        else:
            server = stack.enter_context(RangeHTTPServer(checkpoint.parent))
            uri, endpoint = f"{server.url}/{checkpoint.name}", server.url
        for round_ in range(args.rounds):
            for n in FLEETS if round_ % 2 == 0 else FLEETS[::-1]:  # alternate the order between rounds
                engines = [Engine(endpoint, engine_key_id(i)) for i in range(n)]
                results = run_fleet(uri, engines, SECRET, args.work / f"fleet-{uuid.uuid4().hex[:6]}", timeout=1800)
                failed = [r for r in results if not r.get("engine_started")]
                for r in failed:
                    print(f"  an engine failed: {(r.get('chain') or [r['_output'][-2000:]])[0]}")
                ok = [r for r in results if r.get("engine_started")]
                run = {
                    "round": round_,
                    "engines": n,
                    "failed": len(failed),
                    "load_model": [r["load_model_seconds"] for r in ok],
                    "start_to_answer": [r["start_to_answer_seconds"] for r in ok],
                }
                runs.append(run)
                print(f"round {round_} engines {n}: load_model {[round(s, 2) for s in run['load_model']]}")
    summary = summarise(runs)
    where = "moto's S3 server" if args.server == "s3" else "a plain HTTP server (ranges)"
    print(f"\n{args.size} mixed checkpoint, {tensor_bytes / 1e9:.2f} GB of tensors, from {where} on 127.0.0.1:")
    for n in FLEETS:
        s = summary[str(n)]
        print(
            f"  {n} engine(s): load_model {fmt(s['load_model'])}, slowest {fmt(s['slowest_load_model'])} "
            f"({fmt(s['slowest_vs_one_engine'], 'x')} one engine), start to answers {fmt(s['start_to_answer'])}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": machine,
                "size": args.size,
                "server": args.server,
                "tensor_bytes": tensor_bytes,
                "summary": summary,
                "runs": runs,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"results: {args.out}")
    title = f"{args.size} checkpoint ({tensor_bytes / 1e9:.2f} GB), one {args.server} server, {machine['cores']} cores"
    plot(summary, title, args.plot)


if __name__ == "__main__":
    main()
