"""Every crafted bad input against vLLM's real loader, in one process: nothing may be served.

Usage: python tests/scenarios/bad_inputs_loader.py MODEL_DIR KIND WORKDIR
Prints ``LOADER_RESULT {json}``: per case, the exception type raised by
``LLM(..., load_format="tensorizer_manifest")`` (anywhere in its cause chain),
its message, and whether any tokens were generated. Each case damages a copy laid out as format version
2 (``helpers.checkpoints.copy_as_version_2``): in a version-3 checkpoint the generation's hashes catch every
edit first. The checkpoint is saved here from MODEL_DIR without a base: a version-2 copy has no base to feed
the layers a form set leaves to one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    model_dir, kind, workdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers
    from helpers.bad_inputs import BAD_INPUTS, MODEL_BAD_INPUTS
    from helpers.checkpoints import copy_as_version_2
    from helpers.errors import our_error
    from vllm import LLM, SamplingParams

    from tensorizer_manifest.cli.demo import engine_options
    from tensorizer_manifest.embedded_models.tiny import DEMO_PROMPTS, engine_args
    from tensorizer_manifest.save.from_source import save_checkpoint, shutdown

    checkpoint = workdir / f"ckpt-{kind}-no-base"
    save_checkpoint(model_dir, checkpoint, dtype="bfloat16", base="none", engine_args=engine_args(kind))
    results = {}
    for case in BAD_INPUTS + MODEL_BAD_INPUTS:
        d = workdir / case.name / "ckpt"
        copy_as_version_2(checkpoint, d)
        case.mutate(d)
        entry = {"error": None, "message": None, "tokens": None, "raised": None}
        llm = None
        try:
            llm = LLM(
                model=str(d),
                load_format="tensorizer_manifest",
                **engine_options(),
                **case.engine,
            )
            out = llm.generate(DEMO_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            entry["tokens"] = list(out[0].outputs[0].token_ids)
        except BaseException as exc:  # noqa: BLE001
            ours = our_error(exc)
            entry["raised"] = type(exc).__name__
            entry["error"] = type(ours).__name__ if ours else None
            entry["message"] = str(ours if ours else exc)[:800]
        finally:
            if llm is not None:
                shutdown(llm)
            else:
                try:
                    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                    cleanup_dist_env_and_memory()
                except Exception:
                    pass
        results[case.name] = entry
    print("LOADER_RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
    os._exit(0)
