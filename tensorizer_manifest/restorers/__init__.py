"""Restorers, one module per kernel family; this package imports them all.

Supporting a new kernel is one new module here (a ``Restorer`` subclass, and
``register`` of an instance) plus its test: nothing else changes. Modules are
imported in name order, which is the order ``find_restorer`` asks them in;
restorers should apply to disjoint kinds of layer. Beside them, not imported
here: ``base`` (what a restorer is) and ``inventory`` (every vLLM kernel class
with a post-load step, and which restorer covers it; the ``kernels`` command).
May import ``model``, ``_vllm_compat``, ``storage`` and ``format``.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import RESTORERS, Restorer, find_restorer, known_replays, register

#: Modules of this folder that hold no restorer.
_NOT_RESTORERS = ("base", "inventory")

for _module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _module.name not in _NOT_RESTORERS:
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["RESTORERS", "Restorer", "find_restorer", "known_replays", "register"]
