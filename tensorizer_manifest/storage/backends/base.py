"""``Backend``: what a checkpoint's storage must do, in keys relative to the checkpoint's root, so that the commit
protocol of format version 3 (``storage.generations``) is written once, against this, for every store.

Two writes carry the protocol: ``create`` (a key written once, never replaced: a generation's files) and ``swap``
(the pointer replaced only if it is still the version read, by ``read_versioned``'s token: under a lock locally,
``If-Match`` on S3). The rest reads, lists files with the storage's own timestamps (``gc`` ages files by them, never by
this host's clock), and removes. A storage that cannot write refuses every write with a typed error; none
silently degrades a condition. No torch, no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..remote import RemoteDir, RemoteFile

#: A whole object read over the network (a pointer, a document, a manifest, a model file) is refused above this,
#: before it is read: none of them holds weights.
SMALL_OBJECT_BYTES = 64 << 20


@runtime_checkable
class Backend(Protocol):
    """One checkpoint's storage. ``key`` is a path below the root (``generations/<id>/model.tensors``); ``where``
    names the root in messages (a directory, a URI: never a credential)."""

    where: str

    # --- reading ---------------------------------------------------------------------------------------------

    def read(self, key: str) -> bytes | None:
        """A whole small object (a pointer, a document, a manifest, a model file); None where there is none."""
        ...

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """``read``, with the token of the version read: what ``swap`` compares to replace exactly it."""
        ...

    def read_range(self, key: str, begin: int, end: int) -> bytes:
        """Bytes ``begin`` to ``end`` (end exclusive) of an object; a typed error where it is missing."""
        ...

    def size(self, key: str) -> int:
        """An object's size in bytes; ``CheckpointNotFoundError`` (or its remote kind) where it is missing."""
        ...

    def exists(self, key: str) -> bool: ...

    def files(self, prefix: str) -> list[tuple[str, float]]:
        """Every object below ``prefix`` (a folder's key; ``""``: the root), at any depth, sorted: its key and when
        it was last written, by the storage's clock."""
        ...

    def names(self, prefix: str = "") -> list[str]:
        """The names of the objects directly in ``prefix`` (not below), sorted."""
        ...

    def modified(self, key: str) -> float | None:
        """When an object was last written, by the storage's clock; None where there is none."""
        ...

    def clock(self) -> float:
        """The storage's clock now (the time a scratch object written for it, and removed, was written)."""
        ...

    # --- writing ---------------------------------------------------------------------------------------------

    def create(self, key: str, data: bytes) -> bool:
        """Write ``data`` only if no object has that key, whole or not at all; False: one had (left as it was)."""
        ...

    def upload(self, key: str, source: Path) -> None:
        """A large new object (a tensor file) from a local file, visible once complete; no condition: its key is
        one no other writer uses (it carries the writer's generation id)."""
        ...

    def replace(self, key: str, data: bytes) -> None:
        """Write ``data`` whatever is there (copies nothing trusts unchecked: the top level's model files, stubs)."""
        ...

    def swap(self, key: str, data: bytes, replaces: str | None, check: Callable[[], None]) -> bool:
        """Compare-and-swap: replace ``key`` with ``data`` only if it is still the version ``replaces``
        (``read_versioned``'s token; None: only if there is none), running ``check()`` just before (under the lock
        where the storage has one: what it raises stops the swap). True: swapped, or ``key`` already holds exactly
        ``data`` (a try again of a swap that landed, its answer lost). False: another version is there; nothing
        was written."""
        ...

    def delete(self, key: str) -> None:
        """Remove an object; one already gone is no error."""
        ...

    def lock(self, key: str) -> AbstractContextManager[None]:
        """The writers' lock of ``key``, held by ``swap`` and by ``gc``'s removals, so that no swap's ``check`` comes
        between them; where the storage has no lock (object stores: the conditional write is the compare), a
        context that holds nothing."""
        ...

    def tidy(self, prefix: str, orphan_grace_s: float) -> list[str]:
        """After objects below ``prefix`` were removed: what the storage leaves besides them, removed (empty
        folders; unfinished uploads and scratch objects older than ``orphan_grace_s`` by its clock). Returns what
        is worth reporting, as ``name (why)`` or a key."""
        ...


class RemoteObjects:
    """What the remote backends read alike, through ``storage.remote``'s objects (ranged reads pinned to one
    version, sizes, existence): ``S3Backend`` and ``HttpReadOnlyBackend`` differ in what they may write and list."""

    def __init__(self, root: RemoteDir):
        self.root = root
        self.where = str(root)

    def _object(self, key: str) -> RemoteFile:
        return self.root / key

    def read_range(self, key: str, begin: int, end: int) -> bytes:
        return b"".join(self._object(key).read_range(begin, end))

    def size(self, key: str) -> int:
        return self._object(key).size()

    def exists(self, key: str) -> bool:
        return self._object(key).exists()
