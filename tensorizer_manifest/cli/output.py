"""What the commands print: the consoles, a known error as one line, JSON for tools.

A known error (``TensorizerManifestError``) is one red line and exit code 1, 2 for a mistake in how the command
was called (as click's own usage errors); never a traceback. rich is imported on first use: ``inspect --json``
and ``schema`` never pay for it.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import NoReturn

# Piped output is read by tools and people alike: give tables room instead of rich's 80 columns, and never break
# a line of text (a path or a URI broken in two in a log cannot be copied back).
_WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 220


@functools.cache
def console():
    """rich, imported on first use: `inspect --json` and `schema` never pay for it."""
    from rich.console import Console

    return Console(width=_WIDTH, soft_wrap=not sys.stdout.isatty())


@functools.cache
def err_console():
    from rich.console import Console

    return Console(stderr=True, width=_WIDTH, soft_wrap=not sys.stderr.isatty())


def fail(exc: BaseException) -> NoReturn:
    """One red line; exit 2 for a mistake in how the command was called, 1 otherwise."""
    from ..errors import ConfigurationError

    err_console().print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
    raise SystemExit(2 if isinstance(exc, ConfigurationError) else 1)


def engine_in_this_process() -> None:
    """Run the command's vLLM engine core in this process, unless ``VLLM_ENABLE_V1_MULTIPROCESSING`` says otherwise:
    in a process of its own it imports torch and vLLM again, about as long as the rest of a small model's save (a
    tiny Llama's ``save`` on 2 cores: 14 s against 33 s). The command starts one engine and exits; workers at
    TP>1 are processes of their own either way; vLLM's reason for not starting one is said here instead of in the
    core's log (``_vllm_compat.start_engine``, ``engine_did_not_start``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def engine_did_not_start(exc: Exception) -> NoReturn:
    """vLLM's engine did not start for a reason of its own (memory, a setting): one red line that says where that
    reason is, exit 1. Its engine core in this process raised that reason here: it is said on the line above,
    as the core's own process would have logged it. Any other error goes on as it was."""
    from .. import _vllm_compat

    if not _vllm_compat.is_engine_start_failure(exc):
        raise exc
    if _vllm_compat.failed_to_start_here(exc):
        err_console().print(f"vLLM: {type(exc).__name__}: {exc}", highlight=False, soft_wrap=True, markup=False)
    err_console().print(
        "[red]error:[/red] vLLM's engine did not start, for a reason of its own: it is in vLLM's log above (the "
        "engine core's or a worker's ERROR lines; on a CPU, often memory: --engine-arg kv_cache_memory_bytes=N "
        "sets the KV cache's size). Nothing was committed.",
        highlight=False,
        soft_wrap=True,
    )
    raise SystemExit(1)


def write_json(value: object) -> None:
    """A report for tools on stdout: msgspec's JSON, indented, and nothing else."""
    import msgspec

    sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(value), indent=2) + b"\n")


def json_dumps(value: object) -> str:
    """``json.dumps``, for commands whose ``--json`` flag hides the module's name."""
    import json

    return json.dumps(value)
