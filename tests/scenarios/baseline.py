"""vLLM's own load_format="tensorizer" on a tiny model, in its own process (issue #55198 baseline).

Usage: python tests/scenarios/baseline.py KIND WORKDIR {native|raw}

native: save with vLLM's own worker method ``save_tensorized_model`` (the
"native" file: processed weights plus the vLLM marker) and load it back.
raw: write the model's safetensors state dict to a plain tensorizer file and
load it. Prints ``BASELINE_RESULT {json}``: whether saving/loading/generating
raised, the error, and the tokens when it did generate.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main() -> None:
    kind, workdir, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from tensorizer_manifest.cli.demo import engine_options, generate_tokens
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model
    from tensorizer_manifest.save.from_source import shutdown

    model_dir = str(build_tiny_model(os.path.join(workdir, f"tiny-{kind}"), kind))
    path = os.path.join(workdir, f"vllm-{mode}-{kind}.tensors")
    result: dict = {"kind": kind, "mode": mode, "stage": "save", "error": None, "tokens": None}
    try:
        if mode == "native":
            from vllm import LLM

            llm = LLM(
                model=model_dir,
                **engine_options(),
            )
            try:
                llm.collective_rpc("save_tensorized_model", kwargs={"tensorizer_config": {"tensorizer_uri": path}})
            except Exception as exc:  # the extra-artifact download fails offline; the tensors are written first
                result["save_error"] = f"{type(exc).__name__}: {exc}"[:500]
            finally:
                shutdown(llm)
            if not os.path.exists(path):
                raise RuntimeError(f"vLLM wrote no native file at {path}")
        else:
            from safetensors.torch import load_file
            from tensorizer import TensorSerializer

            serializer = TensorSerializer(path)
            serializer.write_state_dict(load_file(os.path.join(model_dir, "model.safetensors")))
            serializer.close()
        result["stage"] = "load"
        result["tokens"], _, _ = generate_tokens(
            model_dir, "tensorizer", model_loader_extra_config={"tensorizer_uri": path}
        )
        result["stage"] = "done"
    except BaseException as exc:  # noqa: BLE001 - recording the failure is the point
        result["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        result["traceback_tail"] = traceback.format_exc()[-1500:]
    print("BASELINE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    os._exit(0)
