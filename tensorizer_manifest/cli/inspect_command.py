"""``inspect``: a checkpoint's layers for people (``summary``), or as JSON; for format version 3, its generation,
form sets, compile forms and base. No torch, no vLLM, no pydantic: it answers at once."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import TensorizerManifestError
from .output import console, fail
from .parameters import json_option, location_of, remote_from, remote_options

if TYPE_CHECKING:
    from ..storage.remote import RemoteOptions


@click.command()
@click.argument("location")
@json_option
@remote_options
def inspect(location: str, json: bool, **remote) -> None:
    """One row per layer: class, quant method, kernel, raw or processed, tensors, bytes, runtime state.

    LOCATION is a checkpoint directory, a manifest file, or an s3:// or http(s):// URI of either
    (only the manifest is read)."""
    from ..format.generation import BASE_DOCUMENT
    from ..storage.checkpoint import load_manifest
    from .summary import as_json, render

    path, options = location_of(location), remote_from(**remote)
    try:
        manifest, manifest_path = load_manifest(path, remote=options)
    except TensorizerManifestError as exc:
        fail(exc)
    if json:
        sys.stdout.buffer.write(as_json(manifest) + b"\n")
    else:
        render(manifest, str(manifest_path), console())
        _say_generation(path, options)
        if not isinstance(path, Path) or not isinstance(manifest_path, Path):
            return
        others = sorted(
            p.name
            for p in manifest_path.parent.glob("*.manifest.json")
            if p != manifest_path and p.name != BASE_DOCUMENT  # the base is no rank's: `_say_generation` shows it
        )
        if path.is_dir() and others:
            console().print(
                f"(this directory holds {len(others) + 1} rank manifests; "
                f"inspect the others by file: {', '.join(others)})"
            )


def _processed_layers(root, generation, form_set, remote) -> str:
    """How many of a form set's layers load processed (every rank's manifest): the others run vLLM's step."""
    from ..format.schema import fed_from_base
    from ..storage.checkpoint import load_manifest

    states: dict[str, set[str]] = {}
    fed: set[str] = set()
    try:
        for rank in form_set.ranks:
            manifest, _ = load_manifest(root, rank.stem, remote=remote, generation=generation, follow_pointer=False,
                                        vllm_version=form_set.fingerprint.vllm_version)  # fmt: skip
            for module in manifest.modules:
                states.setdefault(module.path, set()).add(module.state)
                if fed_from_base(module.tensors):
                    fed.add(module.path)
    except TensorizerManifestError as exc:
        return f"its rank manifests cannot be read ({exc})"
    processed = sum(state == {"processed"} for state in states.values())
    raw = len(states) - processed
    return (
        f"{processed} of {len(states)} layers processed"
        + (f" ({raw} raw: vLLM's step runs on them at load)" if raw else "")
        + (f"; {len(fed)} fed from the base (the form set stores only what vLLM's step changed)" if fed else "")
    )


def _say_generation(path, remote: RemoteOptions) -> None:
    """For a checkpoint of format version 3: which generation was shown, what it holds, where its layers are
    processed (each form set: a layout on one machine kind and vLLM) and whether a base serves other layouts."""
    from ..storage.checkpoint import checkpoint_root, load_base, load_generation

    root = checkpoint_root(path, remote)
    found = None if root is None else load_generation(root)
    if root is None or found is None:
        return
    generation = found[0]
    layouts = ", ".join(f"tp={s.layout.tp} pp={s.layout.pp} ({len(s.ranks)} ranks)" for s in generation.form_sets)
    console().print(
        f"generation {generation.id} ({generation.made_by}; over {generation.parent or 'nothing'}): {layouts}; "
        f"model files {', '.join(m.name for m in generation.model_files) or 'none'}",
        highlight=False,
    )
    for form_set in generation.form_sets:
        fingerprint = form_set.fingerprint
        features = " ".join(fingerprint.cpu_features)
        machine = f"{fingerprint.device_type} [{features}]" if features else fingerprint.device_type
        layers = _processed_layers(root, generation, form_set, remote)
        console().print(
            f"  processed for tp={form_set.layout.tp} pp={form_set.layout.pp} on {machine}, vLLM "
            f"{fingerprint.vllm_version}, {fingerprint.dtype}: {layers}",
            highlight=False,
        )
    for form in generation.compile_forms:
        settings = " ".join(f"{name}={value}" for name, value in form.settings.items())
        console().print(
            f"  compile form for {' '.join(form.machine)}: vLLM {form.vllm_version}, torch {form.torch_version}, "
            f"engine settings {form.config_hash[:12]}{f' ({settings})' if settings else ''}, "
            f"{'vLLM AOT artifacts' if form.aot else 'inductor cache'}, {len(form.files)} files "
            f"({form.archive.size:,} bytes); used "
            "by a compiling engine of that kind and settings, under a seal checked with its signing key",
            highlight=False,
            soft_wrap=True,
        )
    if generation.base is None:
        console().print("  no base: other tensor- and pipeline-parallel sizes are refused", highlight=False)
        return
    try:
        base, _, _ = load_base(root, generation)
    except TensorizerManifestError as exc:
        fail(exc)
    if base.tensor_file is not None:
        where = f"{base.tensor_file.size:,} bytes"
    else:
        assert base.source is not None  # load_base returns a base without a tensor file only by reference
        where = f"by reference: {len(base.source.files)} safetensors file(s) of {base.source.root}, not copied"
    console().print(
        f"  base: {len(base.tensors)} source tensors ({where}, observed at tp={base.observed.tp}): any other tensor- "
        "or pipeline-parallel size, and another vLLM release, loads through it",
        highlight=False,
    )
