"""Load a checkpoint as a machine with the other AMX answer would: torch's AMX probe is flipped.

Usage: python tests/scenarios/other_machine.py CHECKPOINT [--reference MODEL_DIR]
vLLM asks ``torch.cpu._is_amx_tile_supported()`` when it picks a MoE experts
class and a 4-bit weight layout; flipping it makes this process choose what
the other kind of x86 machine chooses. Prints ``OTHER_MACHINE_RESULT {json}``:
the error (type and message) or the greedy tokens (with ``--reference``, also
those of vLLM's default loader on MODEL_DIR, same process, same flipped probe),
and how many tensors were read from the checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers
    from helpers.errors import error_summary

    checkpoint = sys.argv[1]
    reference = sys.argv[sys.argv.index("--reference") + 1] if "--reference" in sys.argv else None
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    had_amx = bool(torch.cpu._is_amx_tile_supported())
    torch.cpu._is_amx_tile_supported = lambda: not had_amx

    from tensorizer_manifest import tensor_file
    from tensorizer_manifest.demo import generate_tokens

    read = {"tensors": 0}
    stream = tensor_file.TensorFileReader.stream

    def counting_stream(self, *args, **kwargs):
        for item in stream(self, *args, **kwargs):
            read["tensors"] += 1
            yield item

    tensor_file.TensorFileReader.stream = counting_stream
    result = {"had_amx": had_amx, "error": None, "message": None, "tokens": None}
    try:
        if reference is not None:
            result["tokens"] = generate_tokens(checkpoint, "tensorizer_manifest")[0]
            result["reference_tokens"] = generate_tokens(reference, "auto")[0]
        else:
            from vllm import LLM

            LLM(model=checkpoint, load_format="tensorizer_manifest", dtype="bfloat16", enforce_eager=True,
                max_model_len=128, max_num_seqs=1, kv_cache_memory_bytes=64 << 20)  # fmt: skip
    except BaseException as exc:  # noqa: BLE001
        result.update(error_summary(exc))
    result["tensors_read"] = read["tensors"]
    print("OTHER_MACHINE_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
