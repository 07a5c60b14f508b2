"""A local checkpoint of format version 3: immutable files, one pointer swapped by compare-and-swap, and ``gc``.

Writers only ever create files (``LocalCheckpoint.put``: a temporary, then a hard link that fails if the name
exists), under ``generations/<id>/``, and replace one file, the pointer, under an ``flock``, only if it still
names the generation the writer started from (``commit``). Generation ids never repeat, so the compare has no
ABA. ``gc`` removes what no generation current within a grace period names (``docs/design.md``, "Removing old
generations"). No torch, no vLLM.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .. import _failpoints
from ..errors import CheckpointNotFoundError, ConcurrentWriteError, IntegrityError
from ..format.generation import (
    GENERATIONS_DIR,
    POINTER_NAME,
    FileRef,
    Generation,
    Pointer,
    decode_generation,
    decode_pointer,
    encode_generation,
    encode_pointer,
    generation_document_path,
    is_generation_id,
    pointer_to,
)
from ..format.schema import blake3_hex
from .files import create_only, exclusive_lock, replace_atomically

#: ``gc``'s defaults: a generation stays this long after a newer one is committed (readers that read the older
#: pointer finish), and an uncommitted folder (a writer killed, or one still writing) this long after its newest
#: file was written.
GRACE_S = 10 * 60.0
ORPHAN_GRACE_S = 24 * 3600.0


@dataclass(frozen=True)
class GcPlan:
    """What ``gc`` keeps and removes, and why (paths relative to the checkpoint)."""

    current: str
    kept_generations: list[str]
    delete: list[str]
    """Files to remove: those of generations retired for longer than the grace period and of orphans past theirs,
    each generation's document after its other files."""
    waiting: dict[str, str] = field(default_factory=dict)
    """Files not named by a kept generation that stay for now, with why (an orphan still young)."""


class LocalCheckpoint:
    """A version-3 checkpoint in a local directory."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    @property
    def pointer_path(self) -> Path:
        return self.root / POINTER_NAME

    def lock(self) -> Iterator[None]:
        """The writers' lock: ``.tensorizer-manifest.json.lock`` beside the pointer."""
        return exclusive_lock(self.root / f".{POINTER_NAME}.lock", self.pointer_path)

    # --- reading -------------------------------------------------------------------------------------------

    def read_pointer(self) -> Pointer | None:
        """The pointer, or None where there is none (a new checkpoint, or one of format version 1 or 2)."""
        try:
            data = self.pointer_path.read_bytes()
        except FileNotFoundError:
            return None
        return decode_pointer(data, str(self.pointer_path))

    def current_generation_id(self) -> str | None:
        pointer = self.read_pointer()
        return None if pointer is None else pointer.generation

    def read_generation(self, generation_id: str, expected_hash: str | None = None) -> Generation:
        """A generation's document, its bytes checked against ``expected_hash`` (the pointer's) when given.

        A document that is gone is a ``CheckpointNotFoundError`` naming the generation: ``gc`` removed it after a
        newer commit, so the caller read an old pointer (read it again)."""
        path = self.root / generation_document_path(generation_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{self.root}: generation {generation_id} is gone (a newer save was committed and the old one "
                "removed after its grace period); read the checkpoint again"
            ) from None
        if expected_hash is not None and blake3_hex(data) != expected_hash:
            raise IntegrityError(
                f"{path}: its bytes are not the ones the pointer names (damaged, or replaced by hand); "
                "restore it or save the checkpoint again"
            )
        generation = decode_generation(data, str(path))
        if generation.id != generation_id:
            raise IntegrityError(f"{path}: it says it is generation {generation.id}; the folder is {generation_id}")
        return generation

    def current(self) -> Generation | None:
        """The current generation, through the pointer (its hash checked); None without a pointer."""
        pointer = self.read_pointer()
        if pointer is None:
            return None
        return self.read_generation(pointer.generation, pointer.hash)

    # --- writing -------------------------------------------------------------------------------------------

    def put(self, relative: str, data: bytes) -> FileRef:
        """Create ``relative`` with ``data``, atomically and only if no file has that name (writers never replace
        a file a generation may name). Returns its ``FileRef``."""
        target = self.root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if not create_only(target, data):
            raise IntegrityError(
                f"{target}: already exists, and files of a checkpoint are never replaced; each write uses a new "
                "generation id (this one was used twice)"
            )
        return FileRef(path=relative, size=len(data), hash=blake3_hex(data))

    def commit(self, generation: Generation) -> Pointer:
        """Write ``generation``'s document, then make it current: only if the pointer still names its parent
        (``Generation.parent``; None: there was none), else ``ConcurrentWriteError`` and the pointer stays."""
        if generation.seal is None:
            raise ValueError("a generation is sealed before it is committed (format.generation.seal_generation)")
        document = encode_generation(generation)
        self.put(generation_document_path(generation.id), document)
        pointer = pointer_to(generation.id, document)
        _failpoints.pause("before-commit", generation.id)
        with self.lock():
            now = self.current_generation_id()
            if now != generation.parent:
                raise ConcurrentWriteError(
                    f"{self.pointer_path}: another writer committed generation {now or 'none'} since this one read "
                    f"{generation.parent or 'none'}; nothing of this write was committed: read the checkpoint again "
                    "and re-run it"
                )
            replace_atomically(self.pointer_path, encode_pointer(pointer))  # the commit point
        return pointer

    # --- gc ------------------------------------------------------------------------------------------------

    def plan_gc(self, grace_s: float = GRACE_S, orphan_grace_s: float = ORPHAN_GRACE_S, now: float | None = None):
        """What ``gc`` would do now; nothing is removed. A checkpoint without a pointer is refused (typed)."""
        now = time.time() if now is None else now
        pointer = self.read_pointer()
        if pointer is None:
            raise CheckpointNotFoundError(
                f"{self.root}: no {POINTER_NAME}; gc works on checkpoints of format version 3 only"
            )
        kept: dict[str, Generation] = {}
        generation: Generation | None = self.read_generation(pointer.generation, pointer.hash)
        while generation is not None:
            kept[generation.id] = generation
            if generation.parent is None:
                break
            # The parent stopped being current when this generation was committed, just after its document was
            # written: the document's mtime is when, by this file system's clock.
            retired = (self.root / generation_document_path(generation.id)).stat().st_mtime
            if now - retired >= grace_s:
                break
            try:
                generation = self.read_generation(generation.parent)
            except CheckpointNotFoundError:
                break  # removed by an earlier gc
        keep = {path for g in kept.values() for path in [generation_document_path(g.id), *g.named_paths()]}
        files, documents, waiting = [], [], {}
        for folder in sorted((self.root / GENERATIONS_DIR).glob("*")):
            if not folder.is_dir() or not is_generation_id(folder.name):
                continue
            paths = sorted(p for p in folder.rglob("*") if p.is_file())
            young = max((p.stat().st_mtime for p in paths), default=0.0) > now - orphan_grace_s
            committed = (folder / "generation.json").is_file()
            for path in paths:
                relative = path.relative_to(self.root).as_posix()
                if relative in keep:
                    continue
                if not committed and young:
                    waiting[relative] = "not committed, written within the orphan grace period (a writer may be at it)"
                    continue
                (documents if path.name == "generation.json" else files).append(relative)
        return GcPlan(
            current=pointer.generation, kept_generations=list(kept), delete=files + documents, waiting=waiting
        )

    def gc(self, plan: GcPlan) -> list[str]:
        """Remove what ``plan`` says (documents last, so that a ``gc`` killed midway leaves a walk the next one can
        follow), then the folders it emptied. Returns the paths removed."""
        removed = []
        for relative in plan.delete:
            (self.root / relative).unlink(missing_ok=True)
            removed.append(relative)
        for folder in sorted((self.root / GENERATIONS_DIR).glob("*/**/"), reverse=True):
            try:
                folder.rmdir()  # only if empty
            except OSError:
                pass
        for folder in (self.root / GENERATIONS_DIR).glob("*"):
            try:
                folder.rmdir()
            except OSError:
                pass
        return removed
