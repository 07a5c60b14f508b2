"""Memory of saving from a running engine (the rebuild) against the capture path's save, on one model.

    .venv/bin/python benchmarks/bench_rebuild.py                # the large model (1.07 GB), 3 rounds

``rebuild``: vLLM's default loader loads the model with the worker extension; the engine then saves itself
with ``collective_rpc("save_tensorizer_manifest")``, which rebuilds each layer's pre-step state from the
source weights one layer at a time (``rebuild.py``). ``capture``: ``save_checkpoint``, whose loader observes
the post-load step. Each is a fresh process (``bench_load.py child rebuild-save`` and ``child save``);
the two alternate within a round. Figures: anonymous resident memory at its peak during the save, against
the same before it (the loaded engine), and the largest layer's bytes; the time of the save. The rebuild's
claim is that its extra memory is about one layer, not the model. Figures, never assertions.
Writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from bench_load import spread  # this folder is on sys.path when a script here runs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def fmt(s: dict, unit: str = "MB") -> str:
    return f"{s['median']:.0f} {unit} [{s['min']:.0f}-{s['max']:.0f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="large", choices=("small", "medium", "large"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "rebuild-save.json")
    args = parser.parse_args()

    import bench_load

    model = bench_load.build_model(args.work, args.size)
    runs: dict[str, list[dict]] = {"rebuild": [], "capture": []}
    for round_ in range(args.rounds):
        for path in ("rebuild", "capture") if round_ % 2 == 0 else ("capture", "rebuild"):
            out = args.work / f"rebuild-bench-{path}"
            shutil.rmtree(out, ignore_errors=True)
            result = bench_load.run_child("rebuild-save" if path == "rebuild" else "save", str(model), str(out))
            shutil.rmtree(out, ignore_errors=True)
            runs[path].append(result)
            print(f"round {round_} {path}: {json.dumps(result)}")
    rebuild = runs["rebuild"]
    extra = [r["rss_by_phase_mb"]["save"]["anon"] - r["rss_before_save_mb"]["anon"] for r in rebuild]
    summary = {
        "rebuild": {
            "anon_before_save_mb": spread([r["rss_before_save_mb"]["anon"] for r in rebuild]),
            "anon_peak_during_save_mb": spread([r["rss_by_phase_mb"]["save"]["anon"] for r in rebuild]),
            "anon_extra_during_save_mb": spread(extra),
            "seconds": spread([r["seconds"] for r in rebuild]),
        },
        "capture": {
            "anon_peak_load_mb": spread([r["rss_by_phase_mb"]["load"]["anon"] for r in runs["capture"]]),
            "anon_peak_capture_mb": spread([r["rss_by_phase_mb"]["capture"]["anon"] for r in runs["capture"]]),
            "seconds": spread([r["seconds"] for r in runs["capture"]]),
        },
        "model_mb": rebuild[0]["model_mb"],
        "largest_layer_mb": rebuild[0]["largest_layer_mb"],
        "largest_raw_layer_mb": rebuild[0]["largest_raw_layer_mb"],
        "layers": rebuild[0]["layers"],
        "raw_layers": rebuild[0]["raw_layers"],
    }
    s = summary
    print(f"\n{args.size}: {s['model_mb']:.0f} MiB of tensors in {s['layers']} layers ({s['raw_layers']} raw), ")
    print(f"largest layer {s['largest_layer_mb']:.0f} MiB (largest raw {s['largest_raw_layer_mb']:.0f} MiB)")
    print(f"  rebuild: anon before the save {fmt(s['rebuild']['anon_before_save_mb'])}, peak during it "
          f"{fmt(s['rebuild']['anon_peak_during_save_mb'])}: {fmt(s['rebuild']['anon_extra_during_save_mb'])} "
          f"more, in {fmt(s['rebuild']['seconds'], 's')}")  # fmt: skip
    print(f"  capture: anon peak while vLLM loads {fmt(s['capture']['anon_peak_load_mb'])}, during the capture "
          f"{fmt(s['capture']['anon_peak_capture_mb'])}, in {fmt(s['capture']['seconds'], 's')}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"size": args.size, "summary": summary, "runs": runs}, indent=1) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
