"""verify-kernels against a restorer broken on purpose: the kit must say "fail", naming what differs.

Usage: python tests/scenarios/verify_sabotaged.py MODEL_DIR WORKDIR
The cpu_wna16 restorer is patched to nudge each layer's scales after its real
replay (as a restorer that transformed a tensor again would). Prints
``VERIFY_RESULT {json}``: the records.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import msgspec
    import torch

    from tensorizer_manifest.cli.verify_kernels import verify_kernels
    from tensorizer_manifest.restorers import RESTORERS

    restorer = RESTORERS["cpu_wna16"]
    honest = restorer.replay

    def sabotaged(module, model_config):
        honest(module, model_config)
        with torch.no_grad():
            module.scales.mul_(1.5)

    restorer.replay = sabotaged
    result = verify_kernels(sys.argv[1], sys.argv[2], engine_args={"dtype": "bfloat16"})
    print("VERIFY_RESULT " + json.dumps(msgspec.to_builtins(result.records)))


if __name__ == "__main__":
    main()
