"""A checkpoint as another machine or another vLLM would see it: its manifest edited, then sealed again.

Used by ``scenarios/fallbacks.py`` and ``benchmarks/bench_kernels.py``: the other x86 machine records the
other ISA for the same layer (an AMX machine saves what an AVX-512 one would not produce, and the other way
round), and a checkpoint of another vLLM carries that version in its fingerprint.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

_CPU_MOE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe."


def other_machines_form(form: dict) -> dict:
    """The form the other kind of x86 machine records for the same layer (ISA, w4a8 and experts class switched)."""
    flipped = dict(form)
    for key in ("isa", "isa_hint"):
        if key in flipped:
            flipped[key] = "vec" if flipped[key] == "amx" else "amx"
    if "use_w4a8" in flipped:
        flipped["use_w4a8"] = not flipped["use_w4a8"]
    if "experts_class" in flipped:
        x86 = _CPU_MOE + "X86CPUUnquantizedExperts"
        flipped["experts_class"] = _CPU_MOE + "CPUUnquantizedExperts" if flipped["experts_class"] == x86 else x86
    return flipped


def as_the_other_machine(manifest, layers: int | None = None) -> None:
    """Every layer with a fallback (or the first ``layers`` of them) records the other machine's form."""
    for module in [m for m in manifest.modules if m.fallback][:layers]:
        module.form = other_machines_form(module.form)


def edited_copy(checkpoint: Path, out: Path, edit: Callable, damage: bool = False) -> Path:
    """The checkpoint with its manifest edited by ``edit(manifest)`` and sealed again (tensor file linked).

    With ``damage``, the tensor file is a copy with one byte flipped in the first fallback tensor of the
    first layer that has one (the data only: the headers and the index are as saved)."""
    from tensorizer_manifest.format import schema
    from tensorizer_manifest.storage.tensor_file import read_index

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(checkpoint, out, copy_function=os.link)
    path = out / "model.manifest.json"
    manifest = schema.decode_manifest(path.read_bytes())
    if damage:
        tensors = out / manifest.tensor_file.path
        key = next(m for m in manifest.modules if m.fallback).fallback[0].key
        offset = read_index(tensors)[key].data_offset
        data = bytearray(tensors.read_bytes())
        data[offset] ^= 0xFF
        tensors.unlink()
        tensors.write_bytes(bytes(data))
    edit(manifest)
    manifest.seal = schema.seal_manifest(manifest)
    path.unlink()  # a hard link: write a file of its own
    path.write_bytes(schema.encode_manifest(manifest))
    return out
