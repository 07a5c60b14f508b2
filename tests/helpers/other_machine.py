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
    """The checkpoint with its manifest edited by ``edit(manifest)`` and sealed again (tensor files linked).
    ``edit`` may return the new manifest's bytes itself (a document this version cannot write, sealed by the caller).

    A checkpoint of format version 3 gets the edit as a writer would make it: a new generation, every file it names
    in its own folder (so that ``publish_to_s3`` can take it as it is). With ``damage``, the tensor file is a copy
    with one byte flipped in the first fallback tensor of the first layer that has one (the data only: the headers
    and the index are as saved)."""
    from tensorizer_manifest.format import schema
    from tensorizer_manifest.storage.checkpoint import load_manifest, resolve_tensor_file
    from tensorizer_manifest.storage.tensor_file import read_index

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(checkpoint, out, copy_function=os.link)
    manifest, path = load_manifest(out)
    tensor_files = [
        resolve_tensor_file(manifest, path, ref) for ref in [None, *(f.tensor_file for f in manifest.added_forms)]
    ]
    folder = path.parent
    generation = _new_generation(out) if path.parent != out else None
    if generation is not None:
        folder = generation.folder
        tensor_files = [_link(file, folder / file.name) for file in tensor_files]
    if damage:
        tensors = tensor_files[0]
        layer = next(m for m in manifest.modules if m.fallback)
        key = layer.fallback[0].key
        if key is None:  # the fallback is the base's (a save with a base): damage a base tensor it is fed from
            from tensorizer_manifest.storage.checkpoint import load_base
            from tensorizer_manifest.storage.generations import LocalCheckpoint

            base, _, tensors = load_base(out, LocalCheckpoint(out).current())
            key = next(name for name, paths in base.consumers.items() if layer.path in paths)
        offset = read_index(tensors)[key].data_offset
        data = bytearray(tensors.read_bytes())
        data[offset] ^= 0xFF
        tensors.unlink()
        tensors.write_bytes(bytes(data))
    document = edit(manifest)
    if document is None:
        manifest.seal = schema.seal_manifest(manifest)
        document = schema.encode_manifest(manifest)
    target = folder / path.name
    target.unlink(missing_ok=True)  # a hard link: write a file of its own
    target.write_bytes(document)
    if generation is not None:
        _commit(generation, out, schema.decode_manifest(document))
    return out


def _link(source: Path, target: Path) -> Path:
    if not target.exists():
        os.link(source, target)
    return target


def _new_generation(root: Path):
    from tensorizer_manifest.format.generation import new_generation_id
    from tensorizer_manifest.save import publish
    from tensorizer_manifest.storage.generations import LocalCheckpoint

    current = LocalCheckpoint(root).current()
    return publish.begin(root, new_generation_id(), parent=current.id, read_parent=False)


def _commit(publication, root: Path, manifest) -> None:
    """The edited copy's new generation: one rank (the tests' checkpoints are single-rank), its fingerprint the
    edited manifest's, the model files and the base carried."""
    from tensorizer_manifest.save import publish
    from tensorizer_manifest.storage.generations import LocalCheckpoint

    current = LocalCheckpoint(root).current()
    (old,) = current.form_sets
    (rank,) = old.ranks
    ranks = [publish.rank_entry(publication, rank.stem)]
    publish.commit(
        publication,
        made_by="save",
        form_sets=[publish.form_set(old.layout, manifest.fingerprint, ranks)],
        model_files=publish.carry_model_files(publication, current),
        base=current.base,
    )
