"""Checkpoints crossing vLLM releases through their base: run in each release's environment.

Usage: python tests/scenarios/release_crossing.py WORKDIR [--save [--without-base-too]] [--load OTHER_RELEASE_DIR]

``WORKDIR/models`` holds the tiny models (built by the first run; the other release reads the same files).
``--save``: for this vLLM release, ``WORKDIR/by-<version>/<kind>``, a checkpoint with its base of each kind (a
Llama in bf16, W8A8 int8, Qwen3-MoE), with ``--without-base-too`` also ``qwen3-moe-no-base``, a checkpoint
without one (its experts' raw fallbacks only); and this release's default loader's tokens and whole state of
each model (``WORKDIR/reference-<version>.json``). ``--load DIR``: each checkpoint in DIR (another release saved
them; a name starts with its kind) loaded here by the manifest loader, with its tokens, state and load report,
beside this release's reference.

Prints ``CROSSING_RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers and scenarios

KINDS = ("llama", "w8a8-int8", "qwen3-moe")


def _models(workdir: Path) -> dict[str, str]:
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    return {kind: str(build_tiny_model(workdir / "models" / kind, kind)) for kind in KINDS}  # type: ignore[arg-type]


def save(workdir: Path, version: str, without_base: bool) -> dict:
    """This release's checkpoints of every model (``without_base``: the MoE without a base too), and its default
    loader's run of each."""
    from scenarios.base_layouts import engine_run
    from tensorizer_manifest.save.from_source import save_checkpoint

    models = _models(workdir)
    out = workdir / f"by-{version}"
    for kind, model_dir in models.items():
        save_checkpoint(model_dir, str(out / kind), dtype="bfloat16", max_model_len=128, base="inside")
    if without_base:
        save_checkpoint(models["qwen3-moe"], str(out / "qwen3-moe-no-base"), dtype="bfloat16", max_model_len=128,
                        base="none")  # fmt: skip
    reference = {kind: engine_run(model_dir, "auto") for kind, model_dir in models.items()}
    (workdir / f"reference-{version}.json").write_text(json.dumps(reference))
    return {"saved": sorted(p.name for p in out.iterdir())}


def load(workdir: Path, version: str, other: Path) -> dict:
    """Every checkpoint the other release saved, loaded here, beside this release's default loader's run."""
    from helpers.errors import error_summary

    from scenarios.base_layouts import engine_run

    reference = json.loads((workdir / f"reference-{version}.json").read_text())
    loads = {}
    for checkpoint in sorted(other.iterdir()):
        try:
            loaded = engine_run(str(checkpoint), "tensorizer_manifest")
        except Exception as exc:  # noqa: BLE001
            loaded = {"error": error_summary(exc)}
        kind = next(k for k in sorted(KINDS, key=len, reverse=True) if checkpoint.name.startswith(k))
        loads[checkpoint.name] = {"reference": reference[kind], "loaded": loaded, "checkpoint": str(checkpoint)}
    return loads


def main() -> dict:
    import vllm
    from helpers.preloaded import freeze_the_imported_heap

    freeze_the_imported_heap()  # another release's Python runs this as a fresh process: vLLM's collections skip it
    workdir = Path(sys.argv[1])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # each engine's core in this process
    version = str(vllm.__version__)
    result: dict = {"vllm": version}
    if "--save" in sys.argv:
        result["save"] = save(workdir, version, without_base="--without-base-too" in sys.argv)
    if "--load" in sys.argv:
        result["load"] = load(workdir, version, Path(sys.argv[sys.argv.index("--load") + 1]))
    return result


if __name__ == "__main__":
    from helpers.scenario import run_scenario

    run_scenario("CROSSING_RESULT", main)
