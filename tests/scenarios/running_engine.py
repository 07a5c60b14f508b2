"""Saving an engine started as people start one (vLLM's default loader), on real vLLM; JSON on the last line.

Usage: python tests/scenarios/running_engine.py KIND WORKDIR

KIND's tiny model is saved twice: by the capture path (``save_checkpoint``), and by an engine vLLM's
default loader loaded, with ``worker_extension_cls=tm.WORKER_EXTENSION``, through
``collective_rpc("save_tensorizer_manifest")`` (its pre-step state rebuilt from its source weights). The two
manifests' layer records and tensor files are compared; the rebuilt checkpoint is loaded back and its tokens
compared with the engine's.

The engine's truth: before and after every save, saved or refused, the engine answers the same requests, and
its answers (greedy tokens with the top logprobs of every step, compared exactly) must not move. Refused: a
save with the source weights moved away; with the source changed after loading (one weight element negated,
one scale x 1.5, as a re-export would); after a weight changed in place in the engine (``copy_``, as a LoRA
merge would), and after vLLM's own ``reload_weights`` with one changed weight (an RLHF update).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: Source tensors changed after the engine loaded (``_change_source``): a linear's weight (hidden inside a
#: oneDNN handle on AVX-512 and AMX, and in W8A8's int8 handle everywhere) and its scale where it has one.
CHANGED_WEIGHT = "model.layers.0.self_attn.o_proj.weight"
CHANGED_SCALE = "model.layers.0.self_attn.o_proj.weight_scale"


def _answers(llm) -> list:
    """What the engine serves for the demo prompts: greedy tokens and, per step, the top logprobs exactly."""
    from vllm import SamplingParams

    from tensorizer_manifest.embedded_models.tiny import DEMO_PROMPTS

    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5)
    outputs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
    return [
        [
            [token, sorted((t, p.logprob) for t, p in step.items())]
            for token, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
        ]
        for o in outputs
    ]


def _change_source(model_dir: str, name: str, how: str) -> bool:
    """Rewrite the source file holding ``name`` with one element changed (``negate`` the largest in magnitude,
    or ``scale`` the first by 1.5); False when the source has no such tensor."""
    import torch
    from safetensors.torch import load_file, save_file

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        state = load_file(path)
        if name not in state:
            continue
        flat = state[name].reshape(-1)
        if how == "negate":
            at = int(flat.float().abs().argmax())
            flat[at] = -flat[at]
        else:
            flat[0] = (flat[0].float() * 1.5).to(flat.dtype)
        assert not torch.equal(flat, load_file(path)[name].reshape(-1))
        save_file(state, path, metadata={"format": "pt"})
        return True
    return False


def main() -> None:
    kind, workdir = sys.argv[1], sys.argv[2]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import msgspec
    import torch
    from helpers.errors import error_chain
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    from tensorizer_manifest import WORKER_EXTENSION
    from tensorizer_manifest.cli.demo import engine_options, generate_tokens
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model, engine_args
    from tensorizer_manifest.save.from_source import save_checkpoint, shutdown
    from tensorizer_manifest.storage.checkpoint import load_manifest

    model_dir = str(build_tiny_model(os.path.join(workdir, f"tiny-{kind}"), kind))
    engine = engine_args(kind)
    captured_dir = os.path.join(workdir, f"ckpt-{kind}-captured-for-rebuild")
    # without a base: an engine vLLM's default loader loaded has none to write (it did not observe its source)
    save_checkpoint(model_dir, captured_dir, dtype="bfloat16", max_model_len=128, engine_args=engine, base="none")
    rebuilt_dir = os.path.join(workdir, f"ckpt-{kind}-rebuilt")
    # the engine's own copy of its source, so that changing it leaves the shared tiny model as built
    source_dir = os.path.join(workdir, f"source-{kind}-running-engine")
    shutil.rmtree(source_dir, ignore_errors=True)
    shutil.copytree(model_dir, source_dir)
    pristine = os.path.join(workdir, f"source-{kind}-pristine")
    shutil.rmtree(pristine, ignore_errors=True)
    shutil.copytree(source_dir, pristine)
    result: dict = {"kind": kind, "refused": {}, "wrote": {}, "stable": {}, "unchanged_by_save": {}}

    def refused_save(case: str) -> None:
        """Save; it must be refused, write nothing, and leave the engine answering as it did before."""
        before = _answers(llm)
        result["stable"][case] = _answers(llm) == before  # the engine answers alike twice, before any save
        out = os.path.join(workdir, f"ckpt-{kind}-{case}")
        try:
            llm.collective_rpc("save_tensorizer_manifest", args=(out,))
            result["refused"][case] = None
        except Exception as exc:
            result["refused"][case] = error_chain(exc)
        result["wrote"][case] = os.path.exists(os.path.join(out, "model.manifest.json"))
        result["unchanged_by_save"][case] = _answers(llm) == before

    llm = LLM(model=source_dir, **engine_options(worker_extension_cls=WORKER_EXTENSION, **engine))
    try:
        before = _answers(llm)
        result["reference_tokens"] = [[token for token, _ in answer] for answer in before]
        result["saved"] = llm.collective_rpc("save_tensorizer_manifest", args=(rebuilt_dir,))[0]
        result["unchanged_by_save"]["saved"] = [_answers(llm) == before for _ in range(3)]

        # the source moved away: nothing to rebuild from
        moved = [name for name in os.listdir(source_dir) if name.endswith(".safetensors")]
        for name in moved:
            os.rename(os.path.join(source_dir, name), os.path.join(source_dir, name + ".away"))
        try:
            refused_save("no-source")
        finally:
            for name in moved:
                os.rename(os.path.join(source_dir, name + ".away"), os.path.join(source_dir, name))

        # the source changed after loading (a re-export, another revision): the engine serves the old weights
        for case, name, how in (("source-weight", CHANGED_WEIGHT, "negate"), ("source-scale", CHANGED_SCALE, "scale")):
            if _change_source(source_dir, name, how):
                refused_save(case)
            for path in Path(pristine).glob("*.safetensors"):
                shutil.copyfile(path, Path(source_dir) / path.name)

        # one weight changed in place in the engine (what merging a LoRA does)
        def nudge(worker) -> str:
            model = worker.model_runner.get_model()
            for name, param in model.named_parameters():
                if name.endswith("layers.0.post_attention_layernorm.weight"):
                    with torch.no_grad():
                        param.add_(0.5)
                    return name
            return ""

        result["nudged"] = llm.collective_rpc(nudge)[0]
        refused_save("copy")
        result["answers_moved_by_copy"] = _answers(llm) != before

        # vLLM's own in-place update, with one weight of the source changed (what an RLHF step hands it)
        def reload(worker) -> None:
            weights = {}
            for path in sorted(Path(source_dir).glob("*.safetensors")):
                weights |= load_file(path)
            name = next(n for n in sorted(weights) if n.endswith("layers.1.post_attention_layernorm.weight"))
            weights[name] = weights[name] * 1.5
            # vLLM 0.32 runs the step of reload_weights outside the model's default dtype: W8A8-int8's oneDNN
            # handle then writes float32 into bf16 outputs and the engine crashes. Its loader's context, given here.
            with set_default_torch_dtype(worker.model_config.dtype):
                worker.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)

        try:
            llm.collective_rpc(reload)
            result["reload_weights"] = None
            refused_save("reload-weights")
        except Exception as exc:  # an engine whose vLLM cannot update it in place: said, not hidden
            result["reload_weights"] = error_chain(exc)
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
