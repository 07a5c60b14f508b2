"""``demo``: the command around ``demo`` (which imports torch and vLLM when it runs); it sets vLLM's logging and
engine process before they are imported."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ..embedded_models.tiny import TINY_KINDS
from ..errors import TensorizerManifestError
from .output import console, fail
from .parameters import PATH


@click.command()
@click.option(
    "--work-dir",
    type=PATH,
    default=Path(".cache/demo"),
    show_default=True,
    help="Where the tiny model and checkpoint are kept (cached).",
)
@click.option(
    "--kind",
    type=click.Choice(TINY_KINDS),
    default="w8a8-int8",
    show_default=True,
    help="Tiny model; w8a8-int8 has raw and processed layers.",
)
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--verbose", "-v", is_flag=True, help="Show vLLM's INFO logs (only its warnings and errors otherwise).")
def demo(work_dir: Path, kind: str, max_tokens: int, verbose: bool) -> None:
    """Build a tiny model, save it with a manifest, inspect it, load it back through vLLM, compare tokens."""
    # Read by vLLM when it is first imported: its INFO logs and configuration dumps would drown the story.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    # Its three engines run one after another in this process, as an offline script's do: vLLM's engine-core
    # process would import vLLM again for each (on 2 cores, 100 s of demo against 30 s). Set it to 1 to see
    # the demo through vLLM's multiprocess engine, which the tests also load through.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from ..progress import interactive
    from .demo import run_demo

    try:
        ok = run_demo(work_dir, kind, max_tokens, console(), progress=interactive())
    except TensorizerManifestError as exc:
        fail(exc)
    raise SystemExit(0 if ok else 1)
