"""Where vLLM's tensorizer users are, on real vLLM, in its own process; prints a JSON result on the last line.

Usage: python tests/scenarios/dropin.py WORKDIR

A tiny Llama served by vLLM's default loader gives the reference tokens, and from that same engine stock
vLLM's ``save_tensorized_model`` writes a ``model.tensors`` with no manifest. Then:

- the checkpoint ``tensorizer-manifest save`` wrote loads with ``model_loader_extra_config`` in vLLM's
  ``TensorizerConfig`` names (``tensorizer_uri``, ``verify_hash``, ``num_readers``) and the source model as
  ``model``, as a ``--load-format tensorizer`` deployment has them;
- the stock file is refused, with whether vLLM's model was built first (it must not be: nothing is read);
- the re-save command the refusal names is run as it is, and the checkpoint it wrote loads.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    workdir = sys.argv[1]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from helpers.errors import error_chain
    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader import utils as loader_utils
    from vllm.model_executor.model_loader.tensorizer import TensorizerConfig

    from tensorizer_manifest import WORKER_EXTENSION
    from tensorizer_manifest.cli.demo import engine_options, generate_tokens
    from tensorizer_manifest.embedded_models.tiny import DEMO_PROMPTS, build_tiny_model, engine_args
    from tensorizer_manifest.save.from_source import save_checkpoint, shutdown
    from tensorizer_manifest.storage.checkpoint import load_manifest

    model_dir = str(build_tiny_model(os.path.join(workdir, "tiny-llama"), "llama"))
    engine = engine_args("llama")
    result: dict = {}

    llm = LLM(model=model_dir, **engine_options(worker_extension_cls=WORKER_EXTENSION, **engine))
    try:
        outputs = llm.generate(DEMO_PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        result["reference_tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
        stock = os.path.join(workdir, "stock-llama", "model.tensors")
        try:
            llm.collective_rpc(
                "save_tensorized_model", kwargs={"tensorizer_config": TensorizerConfig(tensorizer_uri=stock)}
            )
        except Exception as exc:  # after the tensors, stock vLLM fetches the model's other files from the hub
            result["stock_save_error"] = error_chain(exc)[-1][:300]
        result["stock_file_written"] = os.path.isfile(stock)
    finally:
        shutdown(llm)

    checkpoint = os.path.join(workdir, "ckpt-llama-dropin")
    save_checkpoint(model_dir, checkpoint, dtype="bfloat16", max_model_len=128, engine_args=engine)
    manifest, _ = load_manifest(checkpoint)
    stock_names = {
        "tensorizer_uri": os.path.join(checkpoint, manifest.tensor_file.path),
        "verify_hash": True,
        "num_readers": 2,
    }
    report: dict = {}
    result["stock_names_tokens"], _, _ = generate_tokens(
        model_dir, "tensorizer_manifest", report=report, loader_config=stock_names, **engine
    )
    result["stock_names_report"] = {key: report.get(key) for key in ("verify_hashes", "num_readers", "bytes_read")}

    built = []
    original = loader_utils.initialize_model

    def counting(*args, **kwargs):
        built.append(1)
        return original(*args, **kwargs)

    loader_utils.initialize_model = counting
    try:
        generate_tokens(model_dir, "tensorizer_manifest", loader_config={"tensorizer_uri": stock}, **engine)
        result["stock_file_load"] = None
    except Exception as exc:
        result["stock_file_load"] = error_chain(exc)
    finally:
        loader_utils.initialize_model = original
    result["stock_file_model_built"] = len(built)

    # The command the refusal names, run as the user would, then the checkpoint it wrote loaded.
    message = result["stock_file_load"][0] if result["stock_file_load"] else ""
    command = message.partition("`")[2].partition("`")[0]
    result["resave_command"] = command
    if command.startswith("tensorizer-manifest save "):
        executable = os.path.join(os.path.dirname(sys.executable), "tensorizer-manifest")
        done = subprocess.run([executable, *shlex.split(command)[1:]], capture_output=True, text=True, timeout=600)
        result["resave_rc"] = done.returncode
        result["resave_stderr"] = done.stderr[-2000:] if done.returncode else ""
        if done.returncode == 0:
            result["resaved_tokens"], _, _ = generate_tokens(
                model_dir, "tensorizer_manifest", loader_config={"tensorizer_dir": os.path.dirname(stock)}, **engine
            )
    print("DROPIN_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
