"""A typed error raised in vLLM's engine processes reaches the caller of ``LLM()`` as that error.

Usage: python tests/scenarios/typed_errors.py CHECKPOINT WORKDIR

vLLM's default multiprocessing: the loader runs in the engine core's process, not in this one. A copy of CHECKPOINT
with one byte of its form set's tensor data flipped is loaded; prints ``TYPED_RESULT {json}``: the class ``LLM()``
raised, the class of its cause (vLLM's own error), its message, and whether anything was generated.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path


def main() -> None:
    checkpoint, workdir = Path(sys.argv[1]), Path(sys.argv[2])
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine core is another process
    from vllm import LLM, SamplingParams

    from tensorizer_manifest.cli.demo import engine_options
    from tensorizer_manifest.embedded_models.tiny import DEMO_PROMPTS
    from tensorizer_manifest.save.from_source import shutdown
    from tensorizer_manifest.storage.checkpoint import load_generation

    damaged = workdir / "damaged"
    shutil.copytree(checkpoint, damaged, symlinks=True)
    generation, _ = load_generation(damaged)
    (form_set,) = generation.form_sets
    tensors = damaged / form_set.ranks[0].tensor_files[0]
    data = bytearray(tensors.read_bytes())
    data[len(data) - 64] ^= 0x10  # tensor data near the end of the file, not its header
    tensors.write_bytes(bytes(data))
    result: dict = {"raised": None, "cause": None, "message": None, "tokens": None}
    llm = None
    try:
        llm = LLM(model=str(damaged), load_format="tensorizer_manifest", **engine_options())
        out = llm.generate(DEMO_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        result["tokens"] = list(out[0].outputs[0].token_ids)
    except Exception as exc:  # noqa: BLE001 - what is raised is the result
        result.update(
            raised=f"{type(exc).__module__}.{type(exc).__name__}",
            cause=None if exc.__cause__ is None else type(exc.__cause__).__name__,
            message=str(exc)[:1500],
        )
    finally:
        if llm is not None:
            shutdown(llm)
    print("TYPED_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
    os._exit(0)
