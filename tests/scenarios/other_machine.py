"""Load a checkpoint as a machine with the other AMX answer would: torch's AMX probe is flipped.

Usage: python tests/scenarios/other_machine.py CHECKPOINT [--reference MODEL_DIR] [--add-form WORKDIR]
vLLM asks ``torch.cpu._is_amx_tile_supported()`` when it picks a MoE experts
class and a 4-bit weight layout; flipping it makes this process choose what
the other kind of x86 machine chooses. Prints ``OTHER_MACHINE_RESULT {json}``:
the error (type and message) or the greedy tokens (with ``--reference``, also
those of vLLM's default loader on MODEL_DIR, same process, same flipped probe,
and the content hashes of the processed tensors that loader made), how many
tensors were read from the checkpoint, the loader's form choices and vLLM's
post-load steps counted per layer. With ``--add-form``, a copy of CHECKPOINT in
WORKDIR first gets this machine's form (``add_form``), and the copy is loaded.
(``--no-flip`` leaves the probe alone: a dry run of the script on this machine.)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers
    from helpers.errors import error_summary

    checkpoint = sys.argv[1]
    reference = sys.argv[sys.argv.index("--reference") + 1] if "--reference" in sys.argv else None
    workdir = sys.argv[sys.argv.index("--add-form") + 1] if "--add-form" in sys.argv else None
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    had_amx = bool(torch.cpu._is_amx_tile_supported())
    if "--no-flip" not in sys.argv:
        torch.cpu._is_amx_tile_supported = lambda: not had_amx

    from helpers.post_load import install_post_load_counter

    from tensorizer_manifest.cli.demo import generate_tokens
    from tensorizer_manifest.storage import tensor_file

    read = {"tensors": 0}
    stream = tensor_file.TensorFileReader.stream

    def counting_stream(self, *args, **kwargs):
        for item in stream(self, *args, **kwargs):
            read["tensors"] += 1
            yield item

    tensor_file.TensorFileReader.stream = counting_stream
    result = {"had_amx": had_amx, "error": None, "message": None, "tokens": None}
    try:
        if workdir is not None:
            from tensorizer_manifest.save.add_form import add_form

            copy = Path(workdir) / (Path(checkpoint).name + "-with-this-machines-form")
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(checkpoint, copy, copy_function=os.link)
            (copy / "model.manifest.json").unlink()
            shutil.copy(Path(checkpoint) / "model.manifest.json", copy / "model.manifest.json")
            result["add_form"] = add_form(copy).ranks[0]
            checkpoint = str(copy)
        counts = install_post_load_counter()
        read["tensors"] = 0
        if reference is not None:
            report: dict = {}
            result["tokens"] = generate_tokens(checkpoint, "tensorizer_manifest", report=report)[0]
            result["forms"] = report.get("forms")
            result["post_load_counts"] = {f"{label}:{layer}": n for (label, layer), n in counts.items()}
            result["reference_hashes"] = {}
            from vllm.model_executor.model_loader import base_loader

            from tensorizer_manifest.live_model.tensors import hash_tensor

            original = base_loader.process_weights_after_loading

            def keep(model, model_config, device):
                original(model, model_config, device)
                for path, module in model.named_modules():
                    for name, t in list(module._parameters.items()) + list(module._buffers.items()):
                        if t is not None:
                            result["reference_hashes"][f"{path}.{name}"] = hash_tensor(t.detach().cpu())

            base_loader.process_weights_after_loading = keep
            result["reference_tokens"] = generate_tokens(reference, "auto")[0]
        else:
            from vllm import LLM

            LLM(model=checkpoint, load_format="tensorizer_manifest", dtype="bfloat16", enforce_eager=True,
                max_model_len=128, max_num_seqs=1, kv_cache_memory_bytes=64 << 20)  # fmt: skip
    except BaseException as exc:  # noqa: BLE001
        result.update(error_summary(exc))
    result["tensors_read"] = read["tensors"]
    if workdir is not None:
        from tensorizer_manifest.storage.checkpoint import read_manifest

        manifest = read_manifest(Path(checkpoint) / "model.manifest.json")
        result["added_hashes"] = {
            f"{m.path}.{t.name}": t.hash for form in manifest.added_forms for m in form.modules for t in m.tensors
        }
    print("OTHER_MACHINE_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
