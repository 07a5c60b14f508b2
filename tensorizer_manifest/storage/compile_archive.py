"""A compile form's files as one archive of the generation: written once, read only through its hashes.

The archive is the files of a compile cache directory, concatenated in path order; the generation's
``CompileForm.files`` names each one (its path inside the directory, offset, size, blake3). The files are code:
pickles, generated Python and C++, shared objects. So nothing is written out of an archive until its bytes match
the generation's hash of the whole archive *and* of each file, and a path can only name a place inside the target
directory (``format.generation.InsidePath`` is checked when the generation is decoded, and again here). No torch,
no vLLM.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import blake3

from ..errors import IntegrityError
from ..format.generation import INSIDE_PATTERN, CompileFile, FileRef
from ..format.schema import blake3_hex

#: Files a compile cache holds that are not artifacts: locks, and temporaries of a write that did not finish.
_NOT_ARTIFACTS = re.compile(r"(\.lock|\.tmp[^/]*|~)$")
_INSIDE_PATH = re.compile(INSIDE_PATTERN)


def cache_files(directory: Path) -> Iterator[tuple[str, Path]]:
    """The artifacts under ``directory``, as (path relative to it, ``/``-separated; its file), in path order.

    A name that a generation could not hold (hidden, or of characters outside ``InsidePath``) is refused rather
    than left out: a cache missing one file it wrote may load wrong, not merely slower."""
    found = []
    for dirpath, _, names in os.walk(directory):
        for name in names:
            path = Path(dirpath, name)
            relative = path.relative_to(directory).as_posix()
            if _NOT_ARTIFACTS.search(name) or not path.is_file() or path.is_symlink():
                continue
            if not _INSIDE_PATH.match(relative):
                raise IntegrityError(
                    f"{path}: a compile cache file whose name a checkpoint cannot hold; this vLLM or torch writes "
                    "its cache otherwise than tensorizer-manifest knows (report it, with the name)"
                )
            found.append((relative, path))
    return iter(sorted(found))


def pack(directory: Path, archive: Path, archive_path: str) -> tuple[FileRef, list[CompileFile]]:
    """Write the artifacts under ``directory`` into ``archive`` (a new file): the archive's reference (its path in
    the checkpoint is ``archive_path``) and each file's entry."""
    files: list[CompileFile] = []
    offset = 0
    whole = blake3.blake3()
    with open(archive, "xb") as out:
        for relative, path in cache_files(directory):
            data = path.read_bytes()
            out.write(data)
            whole.update(data)
            files.append(CompileFile(path=relative, offset=offset, size=len(data), hash=blake3_hex(data)))
            offset += len(data)
    return FileRef(path=archive_path, size=offset, hash="blake3:" + whole.hexdigest()), files


def read_archive(root: object, archive: FileRef) -> bytes:
    """The archive's bytes, from the checkpoint ``root`` (a ``Path`` or a ``RemoteDir``, read no further than the
    size the generation records)."""
    location = root / archive.path  # type: ignore[operator]
    return location.read_bytes() if isinstance(location, Path) else location.read_bytes(archive.size)


def check_archive(data: bytes, archive: FileRef, files: list[CompileFile], where: str) -> None:
    """``IntegrityError`` unless ``data`` is the archive the generation records and each file in it is (``where``
    names the archive in messages)."""
    if len(data) != archive.size or blake3_hex(data) != archive.hash:
        raise IntegrityError(f"{where}: not the bytes the generation records (size or content hash differs)")
    for entry in files:
        chunk = memoryview(data)[entry.offset : entry.offset + entry.size]
        if not _INSIDE_PATH.match(entry.path) or len(chunk) != entry.size or blake3_hex(chunk) != entry.hash:
            raise IntegrityError(f"{where}: artifact {entry.path!r} is not the bytes the generation records")


def unpack(data: bytes, archive: FileRef, files: list[CompileFile], target: Path, where: str) -> None:
    """Write ``files`` out of the archive's bytes ``data`` under ``target`` (an empty private directory), once every
    hash matched (``check_archive``)."""
    check_archive(data, archive, files, where)
    for entry in files:
        out = target / entry.path
        out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(out, "xb") as f:
            f.write(memoryview(data)[entry.offset : entry.offset + entry.size])
