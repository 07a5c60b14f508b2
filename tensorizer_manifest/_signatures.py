"""Keyword parameters declared once: a function that takes ``**options`` and passes them on shows them as its own.

Two places use it: the public save functions, whose options an options model (pydantic) declares, and the
functions that only forward to another (``write_checkpoint`` to ``prepare_checkpoint``, ``open_checked`` to
``open_checked_forms``), so that their keywords are not written twice. ``help()``, ``inspect`` and the IDEs that
introspect (IPython, Jupyter) show them; a static checker still sees ``**options``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

Function = TypeVar("Function", bound=Callable[..., Any])


def takes_keywords_of(source: Callable[..., Any]) -> Callable[[Function], Function]:
    """Show a function's ``**options`` as ``source``'s keyword-only parameters, each with its type and default.

    ``source`` is an options model (its fields) or the function the options are passed on to: it stays their
    one declaration, and its signature's keyword-only part becomes the function's ``__signature__``.
    """

    def decorate(function: Function) -> Function:
        signature = inspect.signature(function)
        fixed = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        keywords = [
            p for p in inspect.signature(source).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
        ]
        function.__signature__ = signature.replace(parameters=[*fixed, *keywords])  # type: ignore[attr-defined]
        return function

    return decorate
