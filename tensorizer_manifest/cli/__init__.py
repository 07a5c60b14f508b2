"""The ``tensorizer-manifest`` command and what only it shows: the commands, ``inspect``'s summary, ``diff``, the
demo, ``verify-kernels``. The top of the house: it may import every folder, and nothing imports it.

``commands`` (the command and its subcommands: known errors as one line, never a traceback), ``summary``
(``inspect``'s reading of a checkpoint for people), ``diff`` (what differs between two checkpoints), ``demo`` (the
main job end to end on the embedded default), ``verify_kernels`` (``verify-kernels``: proof on this machine that
each restorer a model uses gives vLLM's own result).

``main`` is the console script's entry point (``tensorizer_manifest.cli:main``).
"""

from __future__ import annotations

from .commands import app, main

__all__ = ["app", "main"]
