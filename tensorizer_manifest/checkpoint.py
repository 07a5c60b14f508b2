"""Where a checkpoint's files are: per-rank names, the manifest, the tensor file it names, the key files.

A checkpoint is a local directory or a remote prefix (``s3://bucket/prefix``,
``https://host/path``, read through ``remote``); a manifest or tensor file is
then a ``Path`` or a ``remote.RemoteFile``. No torch, no vLLM: ``inspect`` uses
it too. Reading goes through ``schema.decode_manifest``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TypeVar

from ._constants import ENCRYPTION_KEY_ENV, SIGNING_KEY_ENV
from .errors import (
    CheckpointNotFoundError,
    CompatibilityError,
    ConfigurationError,
    ManifestError,
    RemoteNotFoundError,
    TensorizerManifestError,
)
from .remote import RemoteDir, RemoteFile, RemoteOptions, as_remote, is_remote
from .schema import MANIFEST_SUFFIX, EncryptionKey, Manifest, SigningKey, TensorFileRef, decode_manifest

_Key = TypeVar("_Key", SigningKey, EncryptionKey)

#: A manifest or tensor file: on disk, or an object in remote storage.
FileLocation = Path | RemoteFile

#: Manifests larger than this are refused before parsing.
MAX_MANIFEST_BYTES = 256 << 20
#: Key files (signing or encryption) larger than this are refused (a key is a few dozen bytes).
MAX_SIGNING_KEY_BYTES = 64 << 10


def checkpoint_stem(tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> str:
    """``model`` for one rank, ``model-tp{r}-of-{n}`` (and ``-pp{r}-of-{n}``) when sharded."""
    stem = "model"
    if tp_size > 1:
        stem += f"-tp{tp_rank}-of-{tp_size}"
    if pp_size > 1:
        stem += f"-pp{pp_rank}-of-{pp_size}"
    return stem


_STEM = re.compile(r"^model(?:-tp(\d+)-of-(\d+))?(?:-pp(\d+)-of-(\d+))?$")


def parallel_layout(stem: str) -> tuple[int, int] | None:
    """``(tensor_parallel_size, pipeline_parallel_size)`` a checkpoint stem was saved with; None if not ours."""
    match = _STEM.match(stem)
    if match is None:
        return None
    return int(match.group(2) or 1), int(match.group(4) or 1)


def layout_mismatch(where: object, wanted_stem: str, manifest_names: list[str]) -> CompatibilityError | None:
    """Why a rank's manifest is missing when the checkpoint holds other ranks': the saved layout, named."""
    saved = sorted(
        {
            layout
            for name in manifest_names
            if name.endswith(MANIFEST_SUFFIX)
            and (layout := parallel_layout(name.removesuffix(MANIFEST_SUFFIX))) is not None
        }
    )
    wanted = parallel_layout(wanted_stem)
    if not saved or wanted is None or wanted in saved:
        return None
    layouts = " or ".join(f"tensor_parallel_size={tp}, pipeline_parallel_size={pp}" for tp, pp in saved)
    return CompatibilityError(
        f"{where}: this checkpoint was saved with {layouts}; this engine runs tensor_parallel_size={wanted[0]}, "
        f"pipeline_parallel_size={wanted[1]} and would need {wanted_stem}{MANIFEST_SUFFIX}. Start vLLM with the "
        "saved sizes, or re-save the checkpoint with this engine's.",
        [("parallel_layout", saved[0], wanted)],
    )


def find_manifest(
    path: str | Path | RemoteFile | RemoteDir, stem: str | None = None, remote: RemoteOptions | None = None
) -> FileLocation:
    """A manifest file, given it or its checkpoint directory or URI (``stem`` picks a rank's).

    ``remote`` holds the credentials and endpoint for an ``s3://`` URI.
    """
    if is_remote(path):
        return _find_remote_manifest(as_remote(path, remote), stem)  # type: ignore[arg-type]
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: no such checkpoint directory or manifest file")
    if stem is not None:
        candidate = path / (stem + MANIFEST_SUFFIX)
        if candidate.is_file():
            return candidate
        mismatch = layout_mismatch(path, stem, [p.name for p in path.glob("*" + MANIFEST_SUFFIX)])
        if mismatch is not None:
            raise mismatch
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


def _find_remote_manifest(location: RemoteFile | RemoteDir, stem: str | None) -> RemoteFile:
    if isinstance(location, RemoteFile):
        return location
    if stem is None and location.scheme == "s3":
        found = [n for n in location.list_names() if n.endswith(MANIFEST_SUFFIX)]
        if not found:
            raise RemoteNotFoundError(
                f"{location}: no *{MANIFEST_SUFFIX} there; this is not a tensorizer-manifest checkpoint "
                "(create one with `tensorizer-manifest save SRC s3://bucket/prefix`)"
            )
        return location / found[0]
    candidate = location / ((stem or "model") + MANIFEST_SUFFIX)
    if not candidate.exists():
        if stem is not None and location.scheme == "s3":
            mismatch = layout_mismatch(location, stem, location.list_names())
            if mismatch is not None:
                raise mismatch
        hint = (
            "save this checkpoint with `tensorizer-manifest save` using the same tensor- and pipeline-parallel "
            "sizes as this engine"
            if stem is not None
            else f"over http(s) name a rank's manifest file itself (…/model-tp0-of-2{MANIFEST_SUFFIX})"
        )
        raise RemoteNotFoundError(f"{location}: no {candidate.name} there; {hint}")
    return candidate


def file_size(path: FileLocation) -> int:
    """The size of a local file or a remote object."""
    return path.size() if isinstance(path, RemoteFile) else path.stat().st_size


def load_manifest(
    path: str | Path | RemoteFile | RemoteDir, stem: str | None = None, remote: RemoteOptions | None = None
) -> tuple[Manifest, FileLocation]:
    """The manifest of a checkpoint directory, URI or manifest file, and the file it was read from."""
    manifest_path = find_manifest(path, stem, remote)
    if isinstance(manifest_path, RemoteFile):
        size = manifest_path.size()
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{manifest_path}: manifest is {size} bytes, over the {MAX_MANIFEST_BYTES} byte limit")
        data = manifest_path.read_bytes(MAX_MANIFEST_BYTES)
        return decode_manifest(data, source=str(manifest_path)), manifest_path
    size = manifest_path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{manifest_path}: manifest is {size} bytes, over the {MAX_MANIFEST_BYTES} byte limit")
    return decode_manifest(manifest_path.read_bytes(), source=str(manifest_path)), manifest_path


def read_manifest(
    path: str | Path | RemoteFile | RemoteDir, stem: str | None = None, remote: RemoteOptions | None = None
) -> Manifest:
    """The manifest of a checkpoint directory, URI or manifest file (no torch, no vLLM)."""
    return load_manifest(path, stem, remote)[0]


def resolve_tensor_file(
    manifest: Manifest, manifest_path: FileLocation, ref: TensorFileRef | None = None
) -> FileLocation:
    """The tensor file (``ref``'s, an added form's; by default the manifest's own): a plain name inside the
    checkpoint directory (or beside a remote manifest), no link out."""
    name = (ref or manifest.tensor_file).path
    if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith("~") or "\0" in name:
        raise ManifestError(
            f"{manifest_path}: tensor file {name!r} must be a plain file name inside the checkpoint directory"
        )
    if isinstance(manifest_path, RemoteFile):
        if any(c in name for c in "?#%") or any(ord(c) < 32 for c in name):
            raise ManifestError(f"{manifest_path}: tensor file {name[:80]!r} is not a plain object name")
        remote_path = manifest_path.parent / name
        try:
            remote_path.size()
        except RemoteNotFoundError:
            raise RemoteNotFoundError(f"{remote_path}: the tensor file named by the manifest is missing") from None
        return remote_path
    try:
        directory = manifest_path.parent.resolve()
        path = manifest_path.parent / name
        if path.is_symlink() and path.resolve().parent != directory:
            raise ManifestError(f"{manifest_path}: tensor file {name!r} is a link out of the checkpoint directory")
        if not path.is_file():
            raise CheckpointNotFoundError(f"{path}: the tensor file named by the manifest is missing")
    except TensorizerManifestError:
        raise
    except OSError as exc:  # e.g. a name longer than the file system allows
        raise ManifestError(
            f"{manifest_path}: tensor file {name[:80]!r} cannot be used ({exc.strerror or exc})"
        ) from None
    return path


def _read_key_file(path: str | os.PathLike, source: str, what: str) -> bytes:
    """A key file's bytes exactly (a trailing newline included); messages never show its name or content:
    a key pasted where its path belongs must not end up in a log."""
    try:
        with open(path, "rb") as f:
            material = f.read(MAX_SIGNING_KEY_BYTES + 1)
    except OSError as exc:
        raise ConfigurationError(
            f"the {what} file given by {source} cannot be read ({exc.strerror or type(exc).__name__}); "
            "it must be the path of a file holding the key, not the key itself"
        ) from None
    if len(material) > MAX_SIGNING_KEY_BYTES:
        raise ConfigurationError(
            f"the {what} file given by {source} is over {MAX_SIGNING_KEY_BYTES} bytes: not a key file"
        )
    return material


def read_signing_key(path: str | os.PathLike, source: str = "signing_key_file") -> SigningKey:
    """The key in a file: its bytes exactly (a trailing newline included), at least 16 of them."""
    return _read_key(SigningKey, "signing key", path, source)


def read_encryption_key(path: str | os.PathLike, source: str = "encryption_key_file") -> EncryptionKey:
    """The encryption key in a file, under the signing key's rules (its bytes exactly, 16 bytes to 64 KiB)."""
    return _read_key(EncryptionKey, "encryption key", path, source)


def _read_key(key_class: type[_Key], what: str, path: str | os.PathLike, source: str) -> _Key:
    material = _read_key_file(path, source, what)
    try:
        return key_class(material)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{source}: {exc}") from None


def signing_key_from(path: str | os.PathLike | None) -> SigningKey | None:
    """The signing key of an entry point: the file its option names, else the file ``$TENSORIZER_MANIFEST_SIGNING_KEY``
    names, else None (manifests are then sealed, and checked, with a plain digest)."""
    if path is not None:
        return read_signing_key(path)
    from_env = os.environ.get(SIGNING_KEY_ENV)
    if from_env:
        return read_signing_key(from_env, source=f"${SIGNING_KEY_ENV}")
    return None


def encryption_key_from(path: str | os.PathLike | None) -> EncryptionKey | None:
    """The encryption key of an entry point: the file its option names, else the file
    ``$TENSORIZER_MANIFEST_ENCRYPTION_KEY`` names, else None (tensor files are then written, and read, in plain)."""
    if path is not None:
        return read_encryption_key(path)
    from_env = os.environ.get(ENCRYPTION_KEY_ENV)
    if from_env:
        return read_encryption_key(from_env, source=f"${ENCRYPTION_KEY_ENV}")
    return None
