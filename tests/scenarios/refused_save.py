"""Save a model vLLM refuses; prints ``REFUSED_RESULT {json}``: what was raised, and whether anything was written.

Usage: python tests/scenarios/refused_save.py MODEL_DIR OUT

In a process of its own: vLLM may refuse after its engine has set up process-global state (a model whose
kernel it finds no implementation for fails inside ``load_model``).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from tensorizer_manifest.errors import TensorizerManifestError
    from tensorizer_manifest.save.from_source import save_checkpoint

    try:
        save_checkpoint(model_dir, out)
        raised = None
    except Exception as error:  # noqa: BLE001 - what is raised is the result
        raised = {
            "type": f"{type(error).__module__}.{type(error).__qualname__}",
            "message": str(error),
            "ours": isinstance(error, TensorizerManifestError),
        }
    print("REFUSED_RESULT " + json.dumps({"raised": raised, "written": os.path.exists(out)}))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
