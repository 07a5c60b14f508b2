"""Load a checkpoint and its source model at another context length; prints ``CONTEXT_RESULT {json}``.

Usage: python tests/scenarios/context.py CHECKPOINT MODEL_DIR MAX_MODEL_LEN [ENGINE_JSON]
Greedy tokens of the checkpoint (load_format="tensorizer_manifest") and of vLLM's default
loader on MODEL_DIR, both with ``max_model_len=MAX_MODEL_LEN``, in one process.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    checkpoint, model_dir, max_model_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    engine = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from tensorizer_manifest.cli.demo import generate_tokens

    engine["max_model_len"] = max_model_len
    result = {
        "manifest_tokens": generate_tokens(checkpoint, "tensorizer_manifest", **engine)[0],
        "reference_tokens": generate_tokens(model_dir, "auto", **engine)[0],
    }
    print("CONTEXT_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
