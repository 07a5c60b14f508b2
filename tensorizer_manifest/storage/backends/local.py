"""``LocalBackend``: a checkpoint in a local directory (or a shared file system with locks), through
``storage.files``: create-only by a hard link, replacement by a rename, the pointer's compare-and-swap under the
writers' ``flock``, each write made durable. A version token is the content hash of the bytes read. No torch."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from ...errors import CheckpointNotFoundError, IntegrityError
from ...format.schema import blake3_hex
from ..files import (
    create_only,
    exclusive_lock,
    fsync_dir,
    fsync_file,
    make_folder,
    replace_atomically,
    temporary_name,
)


class LocalBackend:
    """The files under ``root``; a key is a path below it."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.where = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / key if key else self.root

    # --- reading ---------------------------------------------------------------------------------------------

    def read(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        data = self.read(key)
        return None if data is None else (data, blake3_hex(data))

    def read_range(self, key: str, begin: int, end: int) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(begin)
                data = f.read(max(0, end - begin))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no such file") from None
        if len(data) != max(0, end - begin):
            raise IntegrityError(f"{path}: {begin + len(data)} bytes, shorter than the range {begin}-{end} read")
        return data

    def size(self, key: str) -> int:
        path = self._path(key)
        try:
            return path.stat().st_size
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no such file") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def files(self, prefix: str) -> list[tuple[str, float]]:
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return sorted(  # hidden files too: the writers' lock files and temporaries go with their folder
            (path.relative_to(self.root).as_posix(), path.stat().st_mtime) for path in base.rglob("*") if path.is_file()
        )

    def names(self, prefix: str = "") -> list[str]:
        base = self._path(prefix)
        return sorted(p.name for p in base.iterdir() if p.is_file()) if base.is_dir() else []

    def modified(self, key: str) -> float | None:
        try:
            return self._path(key).stat().st_mtime
        except FileNotFoundError:
            return None

    def clock(self) -> float:
        if not self.root.is_dir():  # the file system's clock is read by writing there
            raise CheckpointNotFoundError(f"{self.root}: no such checkpoint directory")
        scratch = self.root / temporary_name("gc-clock")
        scratch.write_bytes(b"")
        try:
            return scratch.stat().st_mtime
        finally:
            scratch.unlink(missing_ok=True)

    # --- writing ---------------------------------------------------------------------------------------------

    def create(self, key: str, data: bytes) -> bool:
        target = self._path(key)
        make_folder(target.parent)
        return create_only(target, data)

    def upload(self, key: str, source: Path) -> None:
        target = self._path(key)
        make_folder(target.parent)
        tmp = target.parent / temporary_name(target.name)
        try:
            shutil.copyfile(source, tmp)
            fsync_file(tmp)
            os.replace(tmp, target)
            fsync_dir(target.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def replace(self, key: str, data: bytes) -> None:
        """``replace_atomically``; a file that holds these bytes already is left as it is (its time too)."""
        target = self._path(key)
        if self.read(key) != data:
            make_folder(target.parent)
            replace_atomically(target, data)

    def swap(self, key: str, data: bytes, replaces: str | None, check: Callable[[], None]) -> bool:
        make_folder(self._path(key).parent)
        with self.lock(key):
            found = self.read_versioned(key)
            if (None if found is None else found[1]) != replaces:
                return found is not None and found[0] == data
            check()
            replace_atomically(self._path(key), data)  # the commit point
            return True

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def lock(self, key: str) -> AbstractContextManager[None]:
        """``files.exclusive_lock`` on ``.<name>.lock`` beside ``key`` (a file that stays)."""
        target = self._path(key)
        return exclusive_lock(target.parent / f".{target.name}.lock", target)

    def tidy(self, prefix: str, orphan_grace_s: float) -> list[str]:
        """The folders below ``prefix`` that removals left empty (a killed writer's temporaries are files, which
        ``gc``'s plan already covers)."""
        base = self._path(prefix)
        for folder in sorted(base.glob("**/"), key=lambda p: len(p.parts), reverse=True):
            if folder != base:
                try:
                    folder.rmdir()  # only if empty
                except OSError:
                    pass
        return []
