"""``S3Backend``: a checkpoint under an ``s3://`` prefix, through ``storage.remote``'s objects (boto3 and
tensorizer's streams): create-only with ``If-None-Match: *``, the pointer's compare-and-swap with ``If-Match`` on
the ETag read, on a server whose conditional writes were probed (``remote.probe_conditional_writes``; refused,
typed, where it ignores them, unless the user accepts that the last writer wins). A version token is an ETag.
No torch."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from ...errors import ConcurrentWriteError, RemoteNotFoundError, RemoteStorageError
from ..files import temporary_name
from ..remote import (
    PROBE_SCRATCH_PREFIX,
    RemoteDir,
    abort_upload,
    list_objects,
    probe_conditional_writes,
    unfinished_uploads,
)
from .base import SMALL_OBJECT_BYTES, RemoteObjects

CLOCK_SCRATCH = "tensorizer-manifest-clock"
#: The scratch keys at the prefix's top that a killed process may leave: the probe's and the clock's.
SCRATCH_PREFIXES = (PROBE_SCRATCH_PREFIX, f".{CLOCK_SCRATCH}.")


class S3Backend(RemoteObjects):
    """The objects under ``root``; a key is a name below the prefix."""

    def __init__(self, root: RemoteDir, allow_unconditional_writes: bool = False):
        super().__init__(root)
        self.allow_unconditional_writes = allow_unconditional_writes

    def _folder(self, prefix: str) -> RemoteDir:
        return RemoteDir(f"{self.root.uri}/{prefix.strip('/')}", self.root.options) if prefix.strip("/") else self.root

    def _probe(self) -> None:
        probe_conditional_writes(self.root, self.allow_unconditional_writes)

    # --- reading ---------------------------------------------------------------------------------------------

    def read(self, key: str) -> bytes | None:
        found = self.read_versioned(key)
        return None if found is None else found[0]

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        target = self._object(key)
        try:
            data = target.read_bytes(SMALL_OBJECT_BYTES)
        except RemoteNotFoundError:
            return None
        return data, target.etag or ""  # "" (no ETag kept): no swap can match it

    def files(self, prefix: str) -> list[tuple[str, float]]:
        below = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        return [(below + name, written) for name, written in list_objects(self._folder(prefix))]

    def names(self, prefix: str = "") -> list[str]:
        return self._folder(prefix).list_names()

    def modified(self, key: str) -> float | None:
        return self._object(key).last_modified()

    def clock(self) -> float:
        scratch = self._object(temporary_name(CLOCK_SCRATCH))
        scratch.put_bytes(b"")
        try:
            stamp = scratch.last_modified()
        finally:
            scratch.delete()
        if stamp is None:
            raise RemoteStorageError(f"{scratch}: written, then not found; the server's clock cannot be read")
        return stamp

    # --- writing ---------------------------------------------------------------------------------------------

    def create(self, key: str, data: bytes) -> bool:
        self._probe()
        try:
            self._object(key).put_if(data, None)
        except ConcurrentWriteError:
            return False
        return True

    def upload(self, key: str, source: Path) -> None:
        self._probe()
        self._object(key).upload(source)

    def replace(self, key: str, data: bytes) -> None:
        self._object(key).put_bytes(data)

    def swap(self, key: str, data: bytes, replaces: str | None, check: Callable[[], None]) -> bool:
        self._probe()
        check()
        try:
            self._object(key).put_if(data, replaces)  # the commit point
        except ConcurrentWriteError:
            return self.read(key) == data  # a try whose answer was lost may have written it
        return True

    def delete(self, key: str) -> None:
        self._object(key).delete()

    def lock(self, key: str) -> AbstractContextManager[None]:
        return nullcontext()

    def tidy(self, prefix: str, orphan_grace_s: float) -> list[str]:
        """What a killed writer leaves besides objects, once older than ``orphan_grace_s`` by the server's clock:
        multipart uploads below ``prefix`` never completed (S3 keeps and bills their parts), and the scratch keys of
        the conditional-write probe and of ``clock`` at the prefix's top."""
        removed = []
        cutoff = self.clock() - orphan_grace_s
        below = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        for name, upload_id, written in unfinished_uploads(self.root):
            if name.startswith(below) and written <= cutoff:
                abort_upload(self.root, name, upload_id)
                removed.append(f"{name} (an unfinished upload, aborted)")
        for name, written in list_objects(self.root):
            if "/" not in name and name.startswith(SCRATCH_PREFIXES) and written <= cutoff:
                self.delete(name)
                removed.append(name)
        return removed
