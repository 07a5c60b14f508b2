"""The ``tensorizer-manifest`` command and what only it shows: the commands, ``inspect``'s summary, ``diff``, the
demo, ``verify-kernels``. The top of the house: it may import every folder, and nothing imports it.

``main`` is the console script's entry point (``tensorizer_manifest.cli:main``).
"""

from __future__ import annotations

from .commands import app, main

__all__ = ["app", "main"]
