"""``demo``: the command around ``demo`` (which imports torch and vLLM when it runs); it sets vLLM's logging and
engine process before they are imported."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import click

from ..embedded_models.tiny import TINY_KINDS
from ..errors import TensorizerManifestError
from .output import console, engine_in_this_process, fail
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
@click.option(
    "--verbose", "-v", is_flag=True, help="Show vLLM's and torch's INFO logs and warnings (only errors otherwise)."
)
def demo(work_dir: Path, kind: str, max_tokens: int, verbose: bool) -> None:
    """Build a tiny model, save it with a manifest, inspect it, load it back through vLLM, compare tokens."""
    # Read by vLLM and torch when they are first imported: their INFO logs, configuration dumps and warnings about
    # this machine (no Triton, no tcmalloc, NUMA binding: a dozen an engine, three engines) would drown the story.
    # What the demo shows is this package's own output; it compares the tokens itself.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "INFO" if verbose else "ERROR")
    if not verbose:
        logging.getLogger("vllm").setLevel(logging.ERROR)  # what it logs while importing, before its own set-up
        for category in (FutureWarning, DeprecationWarning, UserWarning):
            warnings.filterwarnings("ignore", category=category, module="(vllm|torch|transformers)([.]|$)")
    # Its three engines run one after another in this process, as an offline script's do: vLLM's engine-core
    # process would import vLLM again for each (on 2 cores, 100 s of demo against 30 s). Set
    # VLLM_ENABLE_V1_MULTIPROCESSING=1 to see the demo through vLLM's multiprocess engine.
    engine_in_this_process()
    from ..progress import interactive
    from .demo import run_demo

    try:
        ok = run_demo(work_dir, kind, max_tokens, console(), progress=interactive())
    except TensorizerManifestError as exc:
        fail(exc)
    raise SystemExit(0 if ok else 1)
