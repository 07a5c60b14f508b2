"""``schema``: the manifest's JSON Schema, as ``make schema`` writes it to ``schemas/``."""

from __future__ import annotations

import click

from .output import write_json


@click.command()
def schema() -> None:
    """Print the manifest's JSON Schema (generated from the types)."""
    from ..format.schema import json_schema

    write_json(json_schema())
