"""Checkpoints of format version 3: immutable files, one pointer swapped by compare-and-swap, and ``gc``.

Writers only ever create files (``put``: create-only), under ``generations/<id>/``, and replace one object, the
pointer, only if it still names the generation the writer started from (``commit``): locally under an ``flock``
(``LocalCheckpoint``), on S3 with a conditional PUT (``S3Checkpoint``: ``If-Match`` on the ETag read,
``If-None-Match: *`` for the first). Generation ids never repeat, so neither compare has an ABA. ``gc`` removes
what no generation current within a grace period names (``docs/design.md``, "Removing old generations"), with
the storage's own timestamps. After a commit, the top level (the model files vLLM's ``model`` path reads, a stub
at each rank's old manifest name) is refreshed from the current generation (``refresh_top_level``).

All of it is written once (``CheckpointStore``), against ``storage.backends``' protocol: a storage is a
``Backend`` (create-once, compare-and-swap of the pointer, listing with its timestamps), never a branch here.
No torch, no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .. import _failpoints
from ..errors import (
    CheckpointNotFoundError,
    ConcurrentWriteError,
    IntegrityError,
    TensorizerManifestError,
)
from ..format.generation import (
    GENERATION_DOCUMENT,
    GENERATIONS_DIR,
    POINTER_NAME,
    STUB,
    FileRef,
    Generation,
    Pointer,
    commit_mark_path,
    decode_generation,
    decode_pointer,
    encode_generation,
    encode_pointer,
    generation_document_path,
    is_generation_id,
    pointer_to,
)
from ..format.schema import blake3_hex
from .backends import Backend, LocalBackend, S3Backend
from .files import remove_dead_temporaries
from .remote import RemoteDir
from .remote.uris import HTTP_MODEL_FILES

#: ``gc``'s defaults: a generation stays this long after a newer one is committed (readers that read the older
#: pointer finish), and an uncommitted folder (a writer killed, or one still writing) this long after its newest
#: file was written.
GRACE_S = 10 * 60.0
ORPHAN_GRACE_S = 24 * 3600.0

#: In a local stage of a remote checkpoint (``CheckpointStore.stage``): the files its generation names that stayed
#: remote (its tensor files), one path a line, so that a commit over the stage does not take them for removed.
STAGED_ELSEWHERE = ".tensorizer-manifest-staged-elsewhere"


@dataclass(frozen=True)
class GcSettings:
    """How long ``gc`` keeps what: see ``CheckpointStore.plan_gc``."""

    grace_s: float = GRACE_S
    orphan_grace_s: float = ORPHAN_GRACE_S
    keep: tuple[str, ...] = ()


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
    settings: GcSettings = GcSettings()


class CheckpointStore:
    """A checkpoint of format version 3 in any storage (a ``backends.Backend``): reading through the pointer,
    committing over it, ``gc``'s walk and the top level's refresh, each written once, against the backend."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.where = backend.where
        self._pointer_versions: dict[str, str] = {}
        """The version token of each pointer read, by the generation it named: what a commit over it replaces."""

    def clock(self) -> float:
        """The storage's clock now (``Backend.clock``). ``gc`` measures every age by this clock, never the host's,
        so a host whose clock runs fast removes nothing young."""
        return self.backend.clock()

    # --- reading --------------------------------------------------------------------------------------------

    def read_pointer(self) -> Pointer | None:
        """The pointer, or None where there is none (a new checkpoint, or one of format version 1 or 2)."""
        found = self.backend.read_versioned(POINTER_NAME)
        if found is None:
            return None
        pointer = decode_pointer(found[0], f"{self.where}/{POINTER_NAME}")
        self._pointer_versions[pointer.generation] = found[1]
        return pointer

    def current_generation_id(self) -> str | None:
        pointer = self.read_pointer()
        return None if pointer is None else pointer.generation

    def read_generation(self, generation_id: str, expected_hash: str | None = None) -> Generation:
        """A generation's document, its bytes checked against ``expected_hash`` (the pointer's) when given.

        A document that is gone is a ``CheckpointNotFoundError`` naming the generation: ``gc`` removed it after a
        newer commit, so the caller read an old pointer (read it again)."""
        return self._read_generation(generation_id, expected_hash)[1]

    def _read_generation(self, generation_id: str, expected_hash: str | None) -> tuple[bytes, Generation]:
        relative = generation_document_path(generation_id)
        data = self.backend.read(relative)
        if data is None:
            raise CheckpointNotFoundError(
                f"{self.where}: generation {generation_id} is gone (a newer save was committed and the old one "
                "removed after its grace period); read the checkpoint again"
            )
        if expected_hash is not None and blake3_hex(data) != expected_hash:
            raise IntegrityError(
                f"{self.where}/{relative}: its bytes are not the ones the pointer names (damaged, or replaced by "
                "hand); restore it or save the checkpoint again"
            )
        generation = decode_generation(data, f"{self.where}/{relative}")
        if generation.id != generation_id:
            raise IntegrityError(f"{self.where}/{relative}: it says it is generation {generation.id}")
        return data, generation

    def current(self) -> Generation | None:
        """The current generation, through the pointer (its hash checked); None without a pointer."""
        pointer = self.read_pointer()
        if pointer is None:
            return None
        return self.read_generation(pointer.generation, pointer.hash)

    def stage(self, target: Path) -> Generation:
        """A local checkpoint at ``target`` holding this one's current generation without its tensor files: the
        pointer, the document, every rank's manifest and the model files, each checked against the hash the
        generation records. What an engine that reads the tensors from here needs on its own disk, and what a
        writer commits its new generation over (an add-form on S3: ``remote_checkpoint.publish_to_s3``)."""
        pointer = self.read_pointer()
        if pointer is None:
            raise CheckpointNotFoundError(f"{self.where}: no {POINTER_NAME}; not a checkpoint of format version 3")
        document, generation = self._read_generation(pointer.generation, pointer.hash)
        local = LocalCheckpoint(target)
        refs = [m.file for m in generation.model_files] + [r.manifest for s in generation.form_sets for r in s.ranks]
        for ref in refs:
            data = self.backend.read(ref.path)
            if data is None or blake3_hex(data) != ref.hash:
                raise IntegrityError(
                    f"{self.where}/{ref.path}: {'missing' if data is None else 'not the bytes'} generation "
                    f"{generation.id} records; save the checkpoint again"
                )
            local.put(ref.path, data)
        local.put(generation_document_path(generation.id), document)
        elsewhere = sorted(set(generation.named_paths()) - {ref.path for ref in refs})
        local.backend.replace(STAGED_ELSEWHERE, "".join(f"{path}\n" for path in elsewhere).encode())
        local.backend.replace(POINTER_NAME, encode_pointer(pointer))
        return generation

    # --- writing --------------------------------------------------------------------------------------------

    def create(self, relative: str, data: bytes) -> bool:
        """Create ``relative`` with ``data`` only if no file has that name; False: one had (left as it was)."""
        return self.backend.create(relative, data)

    def create_again(self, relative: str, data: bytes, generation_id: str) -> bool:
        """``create`` for a write that may be a try again after a failure: True when this call created the file,
        False when an earlier try had, with these very bytes; other bytes there are an ``IntegrityError`` (the
        generation's id was used by another write)."""
        if self.create(relative, data):
            return True
        if self.backend.read(relative) != data:
            raise IntegrityError(
                f"{self.where}/{relative}: generation {generation_id} was written before with other contents (an "
                "earlier try committed it over another generation, and was refused); a generation is committed "
                "once: write the checkpoint again, which makes a new generation"
            )
        return False

    def put(self, relative: str, data: bytes) -> FileRef:
        """Create ``relative`` with ``data``, only if no file has that name (writers never replace a file a
        generation may name). Returns its ``FileRef``."""
        if not self.backend.create(relative, data):
            raise IntegrityError(
                f"{self.where}/{relative}: already exists, and files of a checkpoint are never replaced; each write "
                "uses a new generation id (this one was used twice)"
            )
        return FileRef(path=relative, size=len(data), hash=blake3_hex(data))

    def upload(self, relative: str, source: Path) -> None:
        """A large new file (a tensor file) under a key no generation names yet (``Backend.upload``: no
        condition; the key carries this write's generation id, so no other writer uses it)."""
        self.backend.upload(relative, source)

    def commit(self, generation: Generation) -> Pointer:
        """Write ``generation``'s document, then make it current: only if the pointer still names its parent
        (``Generation.parent``; None: there was none), else ``ConcurrentWriteError`` and the pointer stays; and
        only if every file it names is there at the swap (a ``gc`` may have removed a slow writer's files, or an
        older generation's it names), else ``CheckpointNotFoundError`` naming them, and the pointer stays. Then
        the commit's mark (``COMMIT_MARK``), from which ``gc`` counts the parent's grace.

        Safe to try again after a failure (a pointer write that timed out): the document an earlier try wrote is
        accepted where its bytes are these, and a try that did commit is not committed twice."""
        if generation.seal is None:
            raise ValueError("a generation is sealed before it is committed (format.generation.seal_generation)")
        document = encode_generation(generation)
        path = generation_document_path(generation.id)
        pointer = pointer_to(generation.id, document)
        if not self.create_again(path, document, generation.id):  # an earlier try of this commit wrote it
            if self.current_generation_id() == generation.id:
                self._mark(pointer)
                return pointer  # that try committed: done
        _failpoints.pause("before-commit", generation.id)
        self._swap_pointer(encode_pointer(pointer), generation)
        self._mark(pointer)
        return pointer

    def _swap_pointer(self, data: bytes, generation: Generation) -> None:
        """Replace the pointer with ``data`` only if it is still the version read that named ``generation.parent``
        (None: only if there is none), and every file ``generation`` names is there just before (under the
        writers' lock where the storage has one); else ``ConcurrentWriteError``, and the pointer stays."""
        parent = generation.parent
        if parent is not None and parent not in self._pointer_versions:
            self.read_pointer()  # the version that names the parent, if it still does
        version = None if parent is None else self._pointer_versions.get(parent)
        if parent is not None and not version:
            raise self._refuse(self.current_generation_id(), parent)
        if not self.backend.swap(POINTER_NAME, data, version, lambda: self._check_named(generation)):
            raise self._refuse(self.current_generation_id(), parent)

    def _check_named(self, generation: Generation) -> None:
        """Every file ``generation`` names, and its document, are there (what the swap is about to make current)."""
        wanted = [generation_document_path(generation.id), *generation.named_paths()]
        missing = self._missing(wanted)
        if missing:
            raise CheckpointNotFoundError(
                f"{self.where}: generation {generation.id} names files that are gone ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}): a gc removed them while this write was under way (slower "
                "than its orphan grace, or naming an old generation's files); nothing was committed: write it again"
            )

    def _missing(self, relatives: list[str]) -> list[str]:
        """Those of ``relatives`` that are not there (a stage holds those of ``STAGED_ELSEWHERE`` where it was
        staged from, not here)."""
        elsewhere = set((self.backend.read(STAGED_ELSEWHERE) or b"").decode().split())
        present = {relative for relative, _ in self.backend.files(GENERATIONS_DIR)}
        return [relative for relative in relatives if relative not in elsewhere and relative not in present]

    def _mark(self, pointer: Pointer) -> None:
        """The commit's mark: best effort (without it ``gc`` counts the grace from a later, safe time)."""
        try:
            self.create(commit_mark_path(pointer.generation), encode_pointer(pointer))
        except (OSError, TensorizerManifestError):
            pass

    def _refuse(self, now: str | None, parent: str | None) -> ConcurrentWriteError:
        return ConcurrentWriteError(
            f"{self.where}/{POINTER_NAME}: another writer committed generation {now or 'none'} since this one read "
            f"{parent or 'none'}; nothing of this write was committed: read the checkpoint again and re-run it"
        )

    # --- gc -------------------------------------------------------------------------------------------------

    def plan_gc(
        self,
        grace_s: float = GRACE_S,
        orphan_grace_s: float = ORPHAN_GRACE_S,
        now: float | None = None,
        keep: tuple[str, ...] = (),
    ) -> GcPlan:
        """What ``gc`` would do now; nothing is removed. A checkpoint without a pointer is refused (typed).

        *Committed* generations are the current one and its ancestors (the ``parent`` walk). One stays while it was
        current less than ``grace_s`` ago, by the storage's clock (``now``, else ``clock()``): the current
        generation's parent stopped being current when the pointer was last written; an older one when its child's
        commit mark was written, or at the latest when its grandchild's document was (that writer read the child as
        current). Every other folder is an *orphan* (a writer still at work, one killed, a loser of a race), removed
        only once its newest file is older than ``orphan_grace_s``. ``keep``: generation ids kept with every file
        they name, whatever their age (a generation vLLM was given as its ``model``). The files are listed between
        two reads of the pointer, so a commit meanwhile makes the plan again."""
        settings = GcSettings(grace_s, orphan_grace_s, tuple(keep))
        now = self.clock() if now is None else now
        pointer = self.read_pointer()
        for _ in range(8):
            if pointer is None:
                raise CheckpointNotFoundError(
                    f"{self.where}: no {POINTER_NAME}; gc works on checkpoints of format version 3 only"
                )
            _failpoints.pause("gc-after-pointer", pointer.generation)
            files = self.backend.files(GENERATIONS_DIR)
            swapped = self.backend.modified(POINTER_NAME)
            again = self.read_pointer()
            if again == pointer:
                break
            pointer = again  # a commit while listing: list again
        else:
            raise ConcurrentWriteError(f"{self.where}: writers committed all the while gc listed; run it again")
        return self._plan(pointer, files, now, now if swapped is None else swapped, settings)

    def _plan(
        self, pointer: Pointer, files: list[tuple[str, float]], now: float, swapped: float, settings: GcSettings
    ) -> GcPlan:
        written = dict(files)
        chain = self._chain(pointer)
        kept: dict[str, Generation] = {}
        for k, generation in enumerate(chain):
            recent = k == 0 or now - self._retired_at(chain, k, written, swapped) < settings.grace_s
            if recent or generation.id in settings.keep:
                kept[generation.id] = generation
        for generation_id in settings.keep:
            if generation_id not in kept:
                kept[generation_id] = self.read_generation(generation_id)  # a pinned generation off the walk
        keep = {
            path
            for g in kept.values()
            for path in [generation_document_path(g.id), commit_mark_path(g.id), *g.named_paths()]
        }
        committed = {g.id for g in chain}
        newest: dict[str, float] = {}
        for relative, mtime in files:
            folder = relative.split("/")[1]
            newest[folder] = max(newest.get(folder, 0.0), mtime)
        delete: list[str] = []
        documents: list[str] = []
        waiting: dict[str, str] = {}
        for relative, _ in files:
            folder = relative.split("/")[1]
            if relative in keep or not is_generation_id(folder):
                continue
            if folder not in committed and newest[folder] > now - settings.orphan_grace_s:
                waiting[relative] = "not committed, written within the orphan grace period (a writer may be at it)"
                continue
            (documents if relative.endswith("/" + GENERATION_DOCUMENT) else delete).append(relative)
        return GcPlan(
            current=pointer.generation,
            kept_generations=list(kept),
            delete=delete + documents,
            waiting=waiting,
            settings=settings,
        )

    def _chain(self, pointer: Pointer) -> list[Generation]:
        """The current generation and its ancestors, newest first, as far as their documents are there."""
        chain = [self.read_generation(pointer.generation, pointer.hash)]
        while chain[-1].parent is not None:
            try:
                chain.append(self.read_generation(chain[-1].parent))
            except CheckpointNotFoundError:
                break  # removed by an earlier gc
        return chain

    @staticmethod
    def _retired_at(chain: list[Generation], k: int, written: dict[str, float], swapped: float) -> float:
        """When ``chain[k]`` (k >= 1) stopped being current, or a later time (never an earlier one: a later one only
        keeps it longer): the current generation's parent when the pointer was last written (``swapped``); an older
        one when its child's commit mark was written, else when its grandchild's document was (that writer read the
        child as current, after its commit)."""
        if k == 1:
            return swapped
        mark = written.get(commit_mark_path(chain[k - 1].id))
        return mark if mark is not None else written.get(generation_document_path(chain[k - 2].id), swapped)

    def gc(self, plan: GcPlan) -> list[str]:
        """Remove what ``plan`` says, documents last (a ``gc`` killed midway leaves a walk the next one can follow);
        where a writer committed since the plan was made, what a new plan says. Under the writers' lock where the
        storage has one: no commit (which checks its files under the same lock) comes between the pointer read
        again and the removals. Then what the storage leaves besides files (``Backend.tidy``: empty folders; a
        killed S3 writer's unfinished uploads and scratch keys past the orphan grace). Returns what was removed."""
        with self.backend.lock(POINTER_NAME):
            if self.current_generation_id() != plan.current:
                plan = self.plan_gc(plan.settings.grace_s, plan.settings.orphan_grace_s, keep=plan.settings.keep)
            for relative in plan.delete:
                self.backend.delete(relative)
            return list(plan.delete) + self.backend.tidy(GENERATIONS_DIR, plan.settings.orphan_grace_s)

    # --- the top level: what vLLM's ``model`` path and readers of versions 1 and 2 find ---------------------

    def refresh_top_level(self, rounds: int = 8) -> None:
        """Make the files vLLM's ``model`` path reads at the top equal to the current generation's (and remove those
        an older generation had and this one has not), and leave a stub at each rank's old manifest name; again
        while another writer moves the pointer meanwhile (the last writer leaves them matching). Loads give vLLM
        the generation's own folder, or check these copies against the generation, so a stale one is refused, never
        used."""
        for _ in range(rounds):
            generation = self.current()
            if generation is None:
                return
            for name in stale_model_files(self.backend.names(), generation):
                self.backend.delete(name)
            for model_file in generation.model_files:
                data = self.backend.read(model_file.file.path)
                if data is None:
                    raise CheckpointNotFoundError(
                        f"{self.where}/{model_file.file.path}: generation {generation.id} names it, and it is gone"
                    )
                self.backend.replace(model_file.name, data)
            for stem in {rank.stem for form_set in generation.form_sets for rank in form_set.ranks}:
                self.backend.replace(f"{stem}.manifest.json", STUB)
            if self.current_generation_id() == generation.id:
                return


class LocalCheckpoint(CheckpointStore):
    """A version-3 checkpoint in a local directory (``backends.LocalBackend``: the pointer swapped under an
    ``flock`` by a rename)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        super().__init__(LocalBackend(self.root))

    def refresh_top_level(self, rounds: int = 8) -> None:
        """``CheckpointStore.refresh_top_level``, after this host's temporaries of writers that were killed go."""
        remove_dead_temporaries(self.root)
        super().refresh_top_level(rounds)


class S3Checkpoint(CheckpointStore):
    """A version-3 checkpoint under an ``s3://`` prefix (``backends.S3Backend``: new keys created with
    ``If-None-Match: *``, the pointer replaced with ``If-Match`` on the ETag of the version read, on a server whose
    conditional writes were probed)."""

    def __init__(self, root: RemoteDir, allow_unconditional_writes: bool = False):
        self.root = root
        self.allow_unconditional_writes = allow_unconditional_writes
        super().__init__(S3Backend(root, allow_unconditional_writes))


def stale_model_files(names: Iterable[str], generation: Generation) -> list[str]:
    """Those of ``names`` (a model directory's files) that vLLM reads by name (a tokenizer, a chat template, a
    generation config) and ``generation`` has not: another save's, left behind."""
    own = {m.name for m in generation.model_files}
    return sorted(name for name in names if name in HTTP_MODEL_FILES and name not in own)
