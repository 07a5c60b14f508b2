"""``schema``: the manifest's JSON Schema, as ``make schema`` writes it to ``schemas/``."""

from __future__ import annotations

import sys

import click


@click.command()
def schema() -> None:
    """Print the manifest's JSON Schema (generated from the types)."""
    import msgspec

    from ..format.schema import json_schema

    sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(json_schema()), indent=2) + b"\n")
