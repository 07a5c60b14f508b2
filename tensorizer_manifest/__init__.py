"""tensorizer_manifest: vLLM tensorizer checkpoints that describe themselves.

Save with :func:`save_checkpoint` (or ``tensorizer-manifest save``), load with
``LLM(model=OUT, load_format="tensorizer_manifest")``, look inside with
``tensorizer-manifest inspect``. Importing this package imports neither torch
nor vLLM; the functions below import them when called.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (
    CheckpointNotFoundError,
    CompatibilityError,
    IntegrityError,
    ManifestError,
    ManifestVersionError,
    ReplayError,
    TensorizerManifestError,
    UnsupportedModelError,
)
from .schema import FORMAT_VERSION, Manifest, decode_manifest, encode_manifest, json_schema

LOAD_FORMAT = "tensorizer_manifest"
CAPTURE_LOAD_FORMAT = "tensorizer_manifest_capture"
WORKER_EXTENSION = "tensorizer_manifest.vllm_integration.ManifestWorkerExtension"


def save_checkpoint(src, out, **engine_args):
    """Load ``src`` with vLLM and write a self-describing checkpoint to ``out``. See ``save.py``."""
    from .save import save_checkpoint as _save

    return _save(src, out, **engine_args)


def read_manifest(path):
    """The manifest of a checkpoint directory or manifest file (no torch, no vLLM)."""
    from .checkpoint import load_manifest

    return load_manifest(path)[0]


__all__ = [
    "__version__",
    "FORMAT_VERSION",
    "LOAD_FORMAT",
    "CAPTURE_LOAD_FORMAT",
    "WORKER_EXTENSION",
    "Manifest",
    "save_checkpoint",
    "read_manifest",
    "decode_manifest",
    "encode_manifest",
    "json_schema",
    "TensorizerManifestError",
    "ManifestError",
    "ManifestVersionError",
    "CheckpointNotFoundError",
    "IntegrityError",
    "CompatibilityError",
    "UnsupportedModelError",
    "ReplayError",
]
