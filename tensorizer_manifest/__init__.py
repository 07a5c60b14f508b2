"""tensorizer_manifest: vLLM tensorizer checkpoints that describe themselves.

Save with :func:`save_checkpoint` (or ``tensorizer-manifest save``), load with
``LLM(model=OUT, load_format="tensorizer_manifest")``, look inside with
``tensorizer-manifest inspect`` or :func:`read_manifest`, check with
:func:`validate_checkpoint`. Support a new kernel with a :class:`Restorer`
(``register_restorer``).

Importing this package imports neither torch nor vLLM: the names that need
them are loaded on first use (PEP 562), so ``inspect`` and ``schema`` answer fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from ._constants import CAPTURE_LOAD_FORMAT, LOAD_FORMAT, WORKER_EXTENSION, __version__
from .errors import *  # noqa: F403  (every error class: errors.__all__, added to ours below)
from .format.schema import FORMAT_VERSION, Manifest, decode_manifest, encode_manifest, json_schema
from .storage.checkpoint import read_manifest
from .storage.remote import RemoteOptions
from .storage.remote_checkpoint import fetch_model_files, upload_checkpoint

if TYPE_CHECKING:
    from .checks.report import Problem, ValidationReport
    from .checks.validate import validate_checkpoint
    from .restorers import Restorer
    from .restorers import register as register_restorer
    from .save.from_source import SaveOptions, SaveResult, save_checkpoint

#: Public names that import torch (and some vLLM) when first used: name -> (module, attribute).
_LAZY: dict[str, tuple[str, str]] = {
    "save_checkpoint": (".save.from_source", "save_checkpoint"),
    "SaveOptions": (".save.from_source", "SaveOptions"),
    "SaveResult": (".save.from_source", "SaveResult"),
    "validate_checkpoint": (".checks.validate", "validate_checkpoint"),
    "ValidationReport": (".checks.validate", "ValidationReport"),
    "Problem": (".checks.validate", "Problem"),
    "Restorer": (".restorers", "Restorer"),
    "register_restorer": (".restorers", "register"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name, __name__), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    "FORMAT_VERSION",
    "LOAD_FORMAT",
    "CAPTURE_LOAD_FORMAT",
    "WORKER_EXTENSION",
    # saving
    "save_checkpoint",
    "SaveOptions",
    "SaveResult",
    # reading and checking
    "Manifest",
    "read_manifest",
    "decode_manifest",
    "encode_manifest",
    "json_schema",
    "validate_checkpoint",
    "ValidationReport",
    "Problem",
    # remote checkpoints
    "RemoteOptions",
    "fetch_model_files",
    "upload_checkpoint",
    # extending
    "Restorer",
    "register_restorer",
]
__all__ += errors.__all__  # every error class, as errors.py lists them
