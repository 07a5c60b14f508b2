"""``diff``: what differs between two checkpoints, as ``diff`` finds it in their manifests; exit 0 same, 1 not."""

from __future__ import annotations

import click

from ..errors import TensorizerManifestError
from .output import console, fail, write_json
from .parameters import json_option, location_of, remote_from, remote_options


@click.command()
@click.argument("a")
@click.argument("b")
@json_option
@remote_options
def diff(a: str, b: str, json: bool, **remote) -> None:
    """What differs between two checkpoints (directories, manifest files or URIs); exit 0 when they are the
    same, 1 when they differ."""
    from ..storage.checkpoint import load_manifest
    from .diff import diff_manifests

    options = remote_from(**remote)
    try:
        ma, _ = load_manifest(location_of(a), remote=options)
        mb, _ = load_manifest(location_of(b), remote=options)
    except TensorizerManifestError as exc:
        fail(exc)
    result = diff_manifests(ma, mb)
    if json:
        write_json(result.to_dict())
    else:
        if result.same:
            console().print("the checkpoints describe the same model, layers and tensors")
        for field_name, x, y in result.fingerprint:
            console().print(f"fingerprint.{field_name}: {x!r} -> {y!r}", highlight=False)
        for path in result.layers_removed:
            console().print(f"[red]- {path}[/red]", highlight=False)
        for path in result.layers_added:
            console().print(f"[green]+ {path}[/green]", highlight=False)
        for path, what, x, y in result.layers_changed:
            console().print(f"~ {path}: {what}: {x!r} -> {y!r}", highlight=False)
    raise SystemExit(0 if result.same else 1)
