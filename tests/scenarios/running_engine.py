"""Saving an engine started as people start one (vLLM's default loader), on real vLLM; JSON on the last line.

Usage: python tests/scenarios/running_engine.py KIND WORKDIR

KIND's tiny model is saved twice: by the capture path (``save_checkpoint``), and by an engine vLLM's
default loader loaded, with ``worker_extension_cls=tm.WORKER_EXTENSION``, through
``collective_rpc("save_tensorizer_manifest")`` (its pre-step state rebuilt from its source weights). The two
manifests' layer records and tensor files are compared; the rebuilt checkpoint is loaded back and its tokens
compared with the engine's. Then, in that same engine, the save is refused with its source weights moved
away, and after one of its weights is changed in place (as a LoRA merge or an RLHF update would).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    kind, workdir = sys.argv[1], sys.argv[2]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import msgspec
    import torch
    from helpers.errors import error_chain
    from vllm import LLM, SamplingParams

    from tensorizer_manifest import WORKER_EXTENSION
    from tensorizer_manifest.checkpoint import load_manifest
    from tensorizer_manifest.demo import engine_options, generate_tokens
    from tensorizer_manifest.save import save_checkpoint, shutdown
    from tensorizer_manifest.tiny import DEMO_PROMPTS, build_tiny_model, engine_args

    model_dir = str(build_tiny_model(os.path.join(workdir, f"tiny-{kind}"), kind))
    engine = engine_args(kind)
    captured_dir = os.path.join(workdir, f"ckpt-{kind}-captured-for-rebuild")
    save_checkpoint(model_dir, captured_dir, dtype="bfloat16", max_model_len=128, engine_args=engine)
    rebuilt_dir = os.path.join(workdir, f"ckpt-{kind}-rebuilt")
    result: dict = {"kind": kind}

    llm = LLM(model=model_dir, **engine_options(worker_extension_cls=WORKER_EXTENSION, **engine))
    try:
        outputs = llm.generate(DEMO_PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        result["reference_tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
        result["saved"] = llm.collective_rpc("save_tensorizer_manifest", args=(rebuilt_dir,))[0]

        # the source moved away: nothing to rebuild from
        moved = []
        for name in os.listdir(model_dir):
            if name.endswith(".safetensors"):
                os.rename(os.path.join(model_dir, name), os.path.join(model_dir, name + ".away"))
                moved.append(name)
        try:
            llm.collective_rpc("save_tensorizer_manifest", args=(os.path.join(workdir, f"ckpt-{kind}-no-source"),))
            result["no_source"] = None
        except Exception as exc:
            result["no_source"] = error_chain(exc)
        finally:
            for name in moved:
                os.rename(os.path.join(model_dir, name + ".away"), os.path.join(model_dir, name))
        result["no_source_wrote"] = os.path.exists(
            os.path.join(workdir, f"ckpt-{kind}-no-source", "model.manifest.json")
        )

        # one weight changed in place after loading (what merging a LoRA does to the engine)
        def nudge(worker) -> str:
            model = worker.model_runner.get_model()
            for name, param in model.named_parameters():
                if name.endswith("layers.0.post_attention_layernorm.weight"):
                    with torch.no_grad():
                        param.add_(0.5)
                    return name
            return ""

        result["nudged"] = llm.collective_rpc(nudge)[0]
        changed_dir = os.path.join(workdir, f"ckpt-{kind}-changed")
        try:
            llm.collective_rpc("save_tensorizer_manifest", args=(changed_dir,))
            result["changed"] = None
        except Exception as exc:
            result["changed"] = error_chain(exc)
        result["changed_wrote"] = os.path.exists(os.path.join(changed_dir, "model.manifest.json"))
    finally:
        shutdown(llm)

    captured, _ = load_manifest(captured_dir)
    rebuilt, _ = load_manifest(rebuilt_dir)
    as_dicts = msgspec.to_builtins
    result["same_modules"] = as_dicts(captured.modules) == as_dicts(rebuilt.modules)
    if not result["same_modules"]:
        a = {m["path"]: m for m in as_dicts(captured.modules)}
        b = {m["path"]: m for m in as_dicts(rebuilt.modules)}
        result["module_differences"] = {
            path: {k: [a.get(path, {}).get(k), b.get(path, {}).get(k)]
                   for k in set(a.get(path, {})) | set(b.get(path, {}))
                   if a.get(path, {}).get(k) != b.get(path, {}).get(k)}
            for path in sorted(set(a) | set(b))
            if a.get(path) != b.get(path)
        }  # fmt: skip
    result["same_tensor_digest"] = captured.tensor_file.digest == rebuilt.tensor_file.digest
    result["same_fingerprint"] = as_dicts(captured.fingerprint) == as_dicts(rebuilt.fingerprint)
    if not result["same_fingerprint"]:
        fa, fb = as_dicts(captured.fingerprint), as_dicts(rebuilt.fingerprint)
        result["fingerprint_differences"] = {
            k: [fa.get(k), fb.get(k)] for k in set(fa) | set(fb) if fa.get(k) != fb.get(k)
        }
    result["raw_layers"] = sum(1 for m in rebuilt.modules if m.state == "raw")
    result["processed_layers"] = sum(1 for m in rebuilt.modules if m.state == "processed" and m.replay != "none")
    result["rebuilt_tokens"], _, _ = generate_tokens(rebuilt_dir, "tensorizer_manifest", **engine)
    print("REBUILD_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
