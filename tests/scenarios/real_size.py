"""A model of real size end to end (Llama-3.2-1B's shape, 2.47 GB of bf16, 128k context); prints
``REAL_SIZE_RESULT {json}`` on the last line.

Usage: python tests/scenarios/real_size.py WORKDIR [--max-tokens N]
       python tests/scenarios/real_size.py save MODEL_DIR OUT_DIR   (the save alone, in a fresh process)
       python tests/scenarios/real_size.py load-base CHECKPOINT MAX_TOKENS   (a load through the base alone)
       python tests/scenarios/real_size.py load-default MODEL_DIR MAX_TOKENS   (vLLM's default loader alone)

Steps: build the model once in WORKDIR (``helpers.real_size``); in fresh processes that only save (each
beside other work of this scenario, to keep its wall time down: peak RSS does not depend on CPU time),
``save_checkpoint`` with no context, KV-cache or engine flags (dtype bfloat16 and ``base="inside"`` only),
each measuring its own peak anonymous memory (``helpers.real_size.AnonymousPeak``) and peak RSS (``VmHWM``; not
``ru_maxrss``, which a child inherits from its parent): once for this model, once for the tests' tiny Llama
(3.4 MB of weights: the baseline, everything a save costs but the weights); greedy tokens with vLLM's default
loader on the safetensors and with ``load_format="tensorizer_manifest"`` on the checkpoint, in this process;
and, in fresh processes measured as the save is, the checkpoint loaded with every layer through its base
(``source: base``) and the source loaded by vLLM's default loader (the two at once: neither figure depends on
the CPU time each gets).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers

ALONE_MARK = "REAL_SIZE_ALONE "


def save_alone(model_dir: str, out_dir: str) -> None:
    """The save and nothing else; its peak memory is this process's."""
    from helpers.real_size import DTYPE, AnonymousPeak, peak_rss_mib

    from tensorizer_manifest.save.from_source import save_checkpoint

    start = time.perf_counter()
    with AnonymousPeak() as anonymous:
        save_checkpoint(model_dir, out_dir, dtype=DTYPE, base="inside")
    seconds = time.perf_counter() - start
    peak_mb = peak_rss_mib()
    ru_maxrss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # includes the parent's peak
    figures = {"seconds": seconds, "peak_anon_mb": anonymous.peak_mib, "peak_rss_mb": peak_mb}
    print(ALONE_MARK + json.dumps({**figures, "ru_maxrss_mb": ru_maxrss_mb}))


def load_alone(model: str, max_tokens: int, through_base: bool) -> None:
    """A load and nothing else, its peak memory this process's, with its tokens and report: the checkpoint with
    every layer through its base (``source: base``), or the source with vLLM's default loader."""
    from helpers.real_size import DTYPE, AnonymousPeak, peak_rss_mib

    from tensorizer_manifest.cli.demo import generate_tokens

    report: dict = {}
    load = {"load_format": "tensorizer_manifest", "report": report, "loader_config": {"source": "base"}}
    with AnonymousPeak() as anonymous:
        tokens, _, seconds = generate_tokens(model, max_tokens=max_tokens, dtype=DTYPE, max_num_seqs=3,
                                             **(load if through_base else {}))  # fmt: skip
    figures = {"seconds": seconds, "peak_anon_mb": anonymous.peak_mib, "peak_rss_mb": peak_rss_mib()}
    keep = ("source", "why", "tensors_read", "tensors_in_base", "bytes_read", "post_load")
    print(ALONE_MARK + json.dumps({**figures, "tokens": tokens, "report": {k: report.get(k) for k in keep}}))


def start_alone(*args: str) -> subprocess.Popen:
    """This script again, in a fresh process that does one thing (``save``, ``load-base``, ``load-default``) and
    measures it; ``finish_alone`` reads its figures."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def start_save(model_dir: Path, out_dir: Path) -> subprocess.Popen:
    shutil.rmtree(out_dir, ignore_errors=True)
    return start_alone("save", str(model_dir), str(out_dir))


def finish_alone(proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=1800)
    for line in reversed(stdout.splitlines()):
        if line.startswith(ALONE_MARK):
            return json.loads(line[len(ALONE_MARK) :])
    raise RuntimeError(f"the save printed no result (exit {proc.returncode}):\n{stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    laps: dict[str, float] = {}
    started = time.perf_counter()

    def lap(name: str) -> None:
        laps[name] = round(time.perf_counter() - started - sum(laps.values()), 2)

    from helpers.checkpoints import manifest_file
    from helpers.real_size import DTYPE, build, weight_bytes

    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    # The baseline's save of the tiny Llama runs while the model is built: peak RSS does not depend on
    # the CPU time it gets, and the build spends much of its time on one core, writing.
    tiny = build_tiny_model(args.workdir / "tiny-llama", "llama")
    baseline_out = args.workdir / "ckpt-real-size-baseline"
    baseline_proc = start_save(tiny, baseline_out)
    model_dir = build(args.workdir / "llama-3.2-1b-shaped")
    lap("build")
    baseline = finish_alone(baseline_proc)
    shutil.rmtree(baseline_out, ignore_errors=True)
    lap("baseline_save")
    model_bytes, tiny_bytes = weight_bytes(model_dir), weight_bytes(tiny)

    # The save runs alone in its process (its peak RSS is the figure) while this one takes the reference
    # tokens: neither figure depends on the CPU time each gets (the save's seconds here do: the benchmark
    # times it alone, `bench_load.py --sizes 1b`).
    out_dir = args.workdir / "ckpt-llama-3.2-1b-shaped"
    save_proc = start_save(model_dir, out_dir)

    from tensorizer_manifest.cli.demo import generate_tokens

    # The three prompts in one batch: 8 decoding steps instead of 24 (the same engine settings on both sides).
    engine = dict(dtype=DTYPE, max_num_seqs=3)
    reference, prompt_lengths, reference_start = generate_tokens(model_dir, "auto", args.max_tokens, **engine)
    lap("reference")
    save = finish_alone(save_proc)
    lap("save")
    # every layer through the base, in a process of its own (its peak memory), beside the load from the forms here
    base_proc = start_alone("load-base", str(out_dir), str(args.max_tokens))
    default_proc = start_alone("load-default", str(model_dir), str(args.max_tokens))  # the same, measured so
    report: dict = {}
    tokens, _, manifest_start = generate_tokens(
        out_dir, "tensorizer_manifest", args.max_tokens, report=report, **engine
    )
    lap("manifest_load")
    base_load, default_load = finish_alone(base_proc), finish_alone(default_proc)
    lap("base_and_default_loads")
    manifest = json.loads(manifest_file(out_dir).read_text())
    result = {
        "model_dir": str(model_dir),
        "checkpoint": str(out_dir),
        "model_bytes": model_bytes,
        "tiny_model_bytes": tiny_bytes,
        "save": save,
        "base_load": base_load,
        "default_load": default_load,
        "baseline_save": baseline,
        "baseline_mb": baseline["peak_rss_mb"] - tiny_bytes / 2**20,
        "baseline_anon_mb": baseline["peak_anon_mb"] - tiny_bytes / 2**20,
        "reference_tokens": reference,
        "manifest_tokens": tokens,
        "prompt_lengths": prompt_lengths,
        "engine_start_seconds": {"reference": reference_start, "manifest": manifest_start},
        "load_seconds": report.get("seconds"),
        "fingerprint_dtype": manifest["fingerprint"]["dtype"],
        "layer_states": {m["path"]: m["state"] for m in manifest["modules"]},
        "laps_seconds": laps,
    }
    print("REAL_SIZE_RESULT " + json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("save", "load-base", "load-default"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if sys.argv[1] == "save":
            save_alone(sys.argv[2], sys.argv[3])
        else:
            load_alone(sys.argv[2], int(sys.argv[3]), through_base=sys.argv[1] == "load-base")
    else:
        main()
    sys.stdout.flush()
    os._exit(0)
