"""``kernels``: the installed vLLM's classes with a post-load step, with their strategy and verification status."""

from __future__ import annotations

import sys

import click

from .output import console, write_json
from .parameters import json_option


@click.command()
@json_option
@click.option("--markdown", is_flag=True, help="The table as Markdown (docs/kernels-inventory.md).")
@click.option("--all", "show_all", is_flag=True, help="Also classes with no post-load step.")
def kernels(json: bool, markdown: bool, show_all: bool) -> None:
    """Every vLLM class with a post-load step in the installed vLLM, with its strategy (our restorer, vLLM's
    pre-processed branch, raw only) and verification status."""
    from ..restorers.inventory import STRATEGY_NONE, build_inventory, to_markdown

    inventory = build_inventory()
    if not show_all:
        inventory.entries = [e for e in inventory.entries if e.strategy != STRATEGY_NONE]
    if json:
        write_json(inventory.to_dict())
        return
    if markdown:
        sys.stdout.write(to_markdown(inventory))
        return
    from rich.table import Table

    table = Table(title=f"vLLM {inventory.vllm_version}: classes with a post-load step")
    for column in ("family", "vLLM class", "strategy", "restorer", "status"):
        table.add_column(column)
    for e in inventory.entries:
        table.add_row(
            e.family, e.vllm_class.removeprefix("vllm.model_executor."), e.strategy, e.restorer or "-", e.status
        )
    console().print(table)
    console().print(f"{len(inventory.unimportable)} vLLM modules do not import here (other hardware); not listed")
