"""One end-to-end scenario on real vLLM, run in its own process; prints a JSON result on the last line.

Usage: python tests/scenarios/e2e.py KIND WORKDIR [--fallback] [--multiprocessing] [--portable] [--overlap]
                                                    [--reuse-saved]

Steps: save with a manifest, reference tokens with vLLM's default loader on
the safetensors model, load back with load_format="tensorizer_manifest" while
counting every process_weights_after_loading call per layer, compare tokens,
and compare every processed-layer tensor bitwise with the reference engine.
Counting and tensor comparison need the engine in this process, so they are
skipped (reported as None) with --multiprocessing.

The plain run of a kind also leaves its reference beside its checkpoint (``reference-KIND.json``: tokens,
KV scales, each tensor's stride; ``reference-KIND.safetensors``: the reference engine's tensors after its
post-load step). ``--reuse-saved`` (with ``--overlap`` or ``--multiprocessing``, which change only how the
checkpoint is loaded) loads the plain run's checkpoint and compares with that reference: one engine start,
not three.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys


def kv_scale_floats(model) -> dict[str, list[float]]:
    """The plain floats attention kernels read (``_k_scale_float``, ``_v_scale_float``), per layer."""
    return {
        path: [module._k_scale_float, module._v_scale_float]
        for path, module in model.named_modules()
        if hasattr(module, "_k_scale_float")
    }


def write_reference(stem: str, result: dict, captured: dict) -> None:
    """The reference engine's tokens, KV scales and tensors, for the runs that reuse this one (``--reuse-saved``)."""
    from safetensors.torch import save_file

    tensors = captured["ref"]
    save_file({name: t.contiguous() for name, t in tensors.items()}, stem + ".safetensors")
    reference = {
        "reference_tokens": result["reference_tokens"],
        "prompt_lengths": result["prompt_lengths"],
        "ref_kv_scales": captured["ref_kv_scales"],
        "strides": {name: list(t.stride()) for name, t in tensors.items()},
    }
    with open(stem + ".json", "w") as f:
        json.dump(reference, f)


def read_reference(stem: str, result: dict) -> dict:
    """What ``write_reference`` left: the tokens into ``result``; the tensors, as strided as the reference
    engine's, and the KV scales for ``captured``."""
    import torch
    from safetensors.torch import load_file

    with open(stem + ".json") as f:
        reference = json.load(f)
    result["reference_tokens"], result["prompt_lengths"] = reference["reference_tokens"], reference["prompt_lengths"]
    tensors = {}
    for name, t in load_file(stem + ".safetensors").items():
        strided = torch.empty_strided(t.shape, reference["strides"][name], dtype=t.dtype)
        tensors[name] = strided.copy_(t)
    return {"ref": tensors, "ref_kv_scales": reference["ref_kv_scales"]}


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind")
    parser.add_argument("workdir")
    parser.add_argument("--fallback", action="store_true", help="vLLM's torch CPU GEMM instead of oneDNN")
    parser.add_argument("--multiprocessing", action="store_true")
    parser.add_argument("--portable", action="store_true", help="save with --portable (every layer raw)")
    parser.add_argument("--overlap", action="store_true", help="load with overlap_steps=true (steps while reading)")
    parser.add_argument("--reuse-saved", action="store_true", help="load the plain run's checkpoint, its reference")
    args = parser.parse_args()
    if args.reuse_saved and (args.fallback or args.portable or not (args.overlap or args.multiprocessing)):
        parser.error("--reuse-saved goes with --overlap or --multiprocessing alone (the others change the save)")
    plain = not (args.fallback or args.multiprocessing or args.portable or args.overlap)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocessing else "0"

    import torch

    from tensorizer_manifest.cli.demo import generate_tokens
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model, engine_args
    from tensorizer_manifest.save.from_source import apply_cpu_gemm, save_checkpoint

    if args.fallback:
        apply_cpu_gemm("fallback")
    model_dir = build_tiny_model(os.path.join(args.workdir, f"tiny-{args.kind}"), args.kind)
    suffix = ("-fallback" if args.fallback else "") + ("-portable" if args.portable else "")
    suffix += "-overlap" if args.overlap and not args.reuse_saved else ""
    out_dir = os.path.join(args.workdir, f"ckpt-{args.kind}{suffix}")
    reference_files = os.path.join(args.workdir, f"reference-{args.kind}")
    result: dict = {"kind": args.kind, "checkpoint": out_dir, "model_dir": str(model_dir)}

    # Saved first: the engine that starts first in a process pays vLLM's one-time costs, and the two engines
    # whose load_model is timed below (the default loader's, then ours) should meet the same warm process.
    # No max_model_len: the saving engine's own short default, whatever the model's context (the loads run at 128).
    if not args.reuse_saved:
        save_checkpoint(
            model_dir, out_dir, dtype="bfloat16", portable=args.portable, engine_args=engine_args(args.kind)
        )

    captured: dict[str, dict] = {}
    load_model_seconds: dict[str, float] = {}
    if not args.multiprocessing:
        # Each engine's load_model, timed (one run each: a rough figure for docs/supported-models.md).
        import time

        from vllm.model_executor.model_loader.base_loader import BaseModelLoader

        from tensorizer_manifest.vllm_integration.loaders import ManifestModelLoader

        def timing(cls, label):
            original_load = cls.load_model

            def timed(self, *a, **k):
                started = time.perf_counter()
                try:
                    return original_load(self, *a, **k)
                finally:
                    load_model_seconds.setdefault(label, time.perf_counter() - started)

            cls.load_model = timed

        timing(BaseModelLoader, "default")
        timing(ManifestModelLoader, "manifest")
        # Keep the reference engine's processed tensors to compare bitwise after the manifest load.
        from vllm.model_executor.model_loader import base_loader

        original = base_loader.process_weights_after_loading

        def keep(model, model_config, device):
            original(model, model_config, device)
            captured["ref"] = {
                f"{path}.{name}" if path else name: t.detach().clone()
                for path, module in model.named_modules()
                for name, t in list(module._parameters.items()) + list(module._buffers.items())
                if t is not None
            }
            captured["ref_kv_scales"] = kv_scale_floats(model)

        base_loader.process_weights_after_loading = keep
    if args.reuse_saved:
        captured.update(read_reference(reference_files, result))
    else:
        result["reference_tokens"], result["prompt_lengths"], _ = generate_tokens(
            model_dir, "auto", **engine_args(args.kind)
        )
    if not args.multiprocessing:
        base_loader.process_weights_after_loading = original
    if plain:
        write_reference(reference_files, result, captured)

    counts: collections.Counter = collections.Counter()
    loaded: dict[str, torch.Tensor] = {}
    if not args.multiprocessing:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/, for helpers
        from helpers.post_load import install_post_load_counter

        from tensorizer_manifest.load import replay as replay_module

        counts = install_post_load_counter()
        # Keep every tensor once replay has finished.
        Replayer = replay_module.Replayer
        original_finish = Replayer.finish

        def keeping_finish(self):
            report = original_finish(self)
            for path, module in self.model.named_modules():
                for name, t in list(module._parameters.items()) + list(module._buffers.items()):
                    if t is not None:
                        loaded[f"{path}.{name}" if path else name] = t.detach().clone()
            captured["report"] = report.to_dict()
            captured["overlap_steps"] = {"raw_steps": self.overlap_raw_steps, "restorers": self.overlap_restorers}
            captured["kv_scales"] = kv_scale_floats(self.model)
            return report

        Replayer.finish = keeping_finish
    result["manifest_tokens"], _, _ = generate_tokens(
        out_dir,
        "tensorizer_manifest",
        loader_config={"overlap_steps": True} if args.overlap else None,
        **engine_args(args.kind),
    )

    from tensorizer_manifest.storage.checkpoint import load_manifest

    manifest, _ = load_manifest(out_dir)
    fp = manifest.fingerprint
    result["fingerprint"] = {
        "architectures": fp.architectures,
        "quantization": fp.quantization,
        "dtype": fp.dtype,
        "kv_cache_dtype": fp.kv_cache_dtype,
        "tensor_parallel_size": fp.tensor_parallel_size,
        "pipeline_parallel_size": fp.pipeline_parallel_size,
        "vllm_version": fp.vllm_version,
        "cpu_features": fp.cpu_features,
    }
    result["layers"] = {
        m.path: {"state": m.state, "replay": m.replay, "quant_method": m.quant_method, "form": m.form}
        for m in manifest.modules
    }
    if args.multiprocessing:
        result["post_load_counts"] = None
        result["processed_tensor_mismatches"] = None
    else:
        result["post_load_counts"] = {f"{label}:{path}": n for (label, path), n in counts.items()}
        result["report"] = captured.get("report")
        result["overlap_steps"] = captured.get("overlap_steps")
        result["kv_scales"] = {
            path: {"reference": ref, "loaded": captured["kv_scales"].get(path)}
            for path, ref in captured["ref_kv_scales"].items()
        }
        mismatches = []
        recomputed: list[str] = []
        compared = 0
        for m in manifest.modules:
            if m.state != "processed":
                continue
            for t in m.tensors:
                name = f"{m.path}.{t.name}" if m.path else t.name
                ref, got = captured["ref"].get(name), loaded.get(name)
                compared += 1
                if ref is None or got is None:
                    mismatches.append(f"{name}: missing ({ref is None}, {got is None})")
                elif ref.dtype != got.dtype or ref.shape != got.shape or ref.stride() != got.stride():
                    mismatches.append(
                        f"{name}: {ref.dtype}{tuple(ref.shape)}{ref.stride()} "
                        f"vs {got.dtype}{tuple(got.shape)}{got.stride()}"
                    )
                elif not torch.equal(
                    ref.view(torch.uint8) if ref.numel() and ref.dim() else ref,
                    got.view(torch.uint8) if got.numel() and got.dim() else got,
                ):
                    # A non-persistent buffer (a rotary cos/sin cache) is computed by each engine when it
                    # builds the model, not loaded: the checkpoint holds the saving engine's, which can
                    # differ from the reference engine's in the last bit. Weights and scales never may.
                    ulp = torch.finfo(ref.dtype).eps if ref.is_floating_point() else 0.0
                    if not t.persistent and torch.allclose(ref.float(), got.float(), rtol=0.0, atol=2 * ulp):
                        recomputed.append(name)
                    else:
                        mismatches.append(f"{name}: values differ")
        result["load_model_seconds"] = load_model_seconds
        result["processed_tensors_compared"] = compared
        result["processed_tensor_mismatches"] = mismatches
        result["recomputed_buffers_within_rounding"] = recomputed
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/, for helpers
    from helpers.scenario import run_scenario

    run_scenario("E2E_RESULT", main)
