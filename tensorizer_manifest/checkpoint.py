"""Finding and reading a checkpoint's manifest. No torch, no vLLM: ``inspect`` uses it too."""

from __future__ import annotations

from pathlib import Path

from .errors import CheckpointNotFoundError, ManifestError
from .schema import MANIFEST_SUFFIX, Manifest, decode_manifest

#: Manifests larger than this are refused before parsing.
MAX_MANIFEST_BYTES = 256 << 20


def find_manifest(path: str | Path, stem: str | None = None) -> Path:
    """A manifest file, given it or its checkpoint directory (``stem`` picks a rank's)."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: no such checkpoint directory or manifest file")
    if stem is not None:
        candidate = path / (stem + MANIFEST_SUFFIX)
        if candidate.is_file():
            return candidate
        raise CheckpointNotFoundError(
            f"{path}: no {candidate.name}; save this checkpoint with `tensorizer-manifest save` "
            "using the same tensor- and pipeline-parallel sizes as this engine"
        )
    found = sorted(path.glob("*" + MANIFEST_SUFFIX))
    if not found:
        raise CheckpointNotFoundError(
            f"{path}: no *{MANIFEST_SUFFIX} here; this is not a tensorizer-manifest checkpoint "
            "(create one with `tensorizer-manifest save SRC OUT`)"
        )
    return found[0]


def read_manifest(path: str | Path) -> Manifest:
    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: manifest not found")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}: manifest is {size} bytes, over the {MAX_MANIFEST_BYTES} byte limit")
    return decode_manifest(path.read_bytes(), source=str(path))


def load_manifest(path: str | Path, stem: str | None = None) -> tuple[Manifest, Path]:
    """The manifest of a checkpoint directory or manifest file, and where it was found."""
    manifest_path = find_manifest(path, stem)
    return read_manifest(manifest_path), manifest_path
