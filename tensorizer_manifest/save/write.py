"""Turn a capture into a checkpoint: the tensor file, then the manifest, both renamed into place.

The manifest is written last, so a directory whose manifest exists has a
complete tensor file beside it. Every commit of a manifest (a save, a re-save,
an add-form) is a compare-and-swap on the manifest the writer started from
(``commit_manifest``): writers of one checkpoint take turns under a lock, and
one whose starting manifest was replaced meanwhile gets ``ConcurrentWriteError``
and commits nothing, so that no writer silently loses another's work.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import msgspec
import torch

from .._constants import PRODUCER
from .._signatures import takes_keywords_of
from ..checks.seal import check_seal
from ..errors import ConcurrentWriteError, ConfigurationError, ManifestError
from ..format.generation import POINTER_NAME
from ..format.schema import (
    ENCRYPTION_TENSORIZER,
    MANIFEST_SUFFIX,
    TENSORS_SUFFIX,
    AddedForm,
    EncryptionKey,
    Manifest,
    ModuleRecord,
    SigningKey,
    TensorFileRef,
    TensorRecord,
    decode_manifest,
    digest_records,
    encode_manifest,
    fallback_name,
    form_base,
    full_name,
    manifest_generation,
    qualified_class,
    required_format_version,
    seal_manifest,
)
from ..live_model.layers import TensorSlot
from ..live_model.tensors import make_record
from ..progress import ProgressCallback, ProgressCounter
from ..storage.files import exclusive_lock, fsync_file, remove_dead_temporaries, replace_atomically, temporary_name
from ..storage.remote import is_model_file
from ..storage.tensor_file import head_hash, prefix_hash, prefix_size, read_index, write_tensor_file
from .capture import Capture


def build_manifest(
    capture: Capture, tensor_file_name: str, beside_a_base: bool = False
) -> tuple[Manifest, list[tuple[str, TensorSlot]]]:
    """Records for every captured layer, and the (key, slot) pairs to store (``stored_tensors`` reads them).

    Every layer's own tensors come first, in layer order; the raw fallbacks after all of them, so that a
    load that needs none reads one contiguous run of the file and stops.
    """
    modules: list[ModuleRecord] = []
    to_store: list[tuple[str, TensorSlot]] = []
    seen: dict[int, str] = {}  # id(tensor) -> full name of the first record holding it
    ordered: list[tuple[str, TensorRecord]] = []
    fills = capture.base_fills if beside_a_base else None  # without a base every layer is stored
    for layer in capture.layers:
        records: list[TensorRecord] = []
        from_base = (
            fills is not None
            and layer.as_loaded
            and _weight_loaders_made(layer.path, layer.tensors, fills)
            and len({id(slot.tensor) for slot in layer.tensors.values()} - seen.keys()) == len(layer.tensors)
        )
        for name, slot in layer.tensors.items():
            tensor_name = full_name(layer.path, name)
            alias_of = seen.get(id(slot.tensor))
            record = _record(name, slot, None if from_base else tensor_name, alias_of)
            if alias_of is None:
                seen[id(slot.tensor)] = tensor_name
                if record.key is not None:
                    to_store.append((record.key, slot))
            records.append(record)
            ordered.append((tensor_name, record))
        quant_method = getattr(layer.module, "quant_method", None)
        modules.append(
            ModuleRecord(
                path=layer.path,
                module_class=qualified_class(layer.module),
                quant_method=qualified_class(quant_method) if quant_method is not None else None,
                kernels=layer.kernels,
                state=layer.state,
                replay=layer.replay,
                tensors=records,
                runtime_state=layer.runtime_state,
                form=layer.form,
                verified=layer.verified,
            )
        )
    for layer, module in zip(capture.layers, modules, strict=True):
        # Each fallback stores every tensor (no aliases): a layer's choice of form never depends on another's.
        from_base = fills is not None and _weight_loaders_made(layer.path, layer.fallback, fills)
        for name, slot in layer.fallback.items():
            tensor_name = fallback_name(full_name(layer.path, name))
            record = _record(name, slot, None if from_base else tensor_name, None)
            if record.key is not None:
                to_store.append((record.key, slot))
            module.fallback.append(record)
            ordered.append((tensor_name, record))
    manifest = Manifest(
        format_version=1,
        producer=PRODUCER,
        fingerprint=capture.fingerprint,
        tensor_file=TensorFileRef(
            path=tensor_file_name, size=0, tensor_count=len(to_store), digest=digest_records(ordered)
        ),
        modules=modules,
    )
    manifest.format_version = required_format_version(manifest)
    return manifest, to_store


def _weight_loaders_made(path: str, tensors: dict[str, TensorSlot], fills: dict[str, list[str]]) -> bool:
    """Whether every one of a layer's tensors (before vLLM's step) is a parameter that vLLM's weight loaders
    filled from the source on this rank: then the same release's ``load_weights`` at this layout makes them again
    from the base, and the form set need not store them (``schema.held_by_base``)."""
    filled = set(fills.get(path, ()))
    return any(slot.tensor.numel() for slot in tensors.values()) and all(
        name in filled and slot.kind == "parameter" for name, slot in tensors.items()
    )


def _record(name: str, slot: TensorSlot, key: str | None, alias_of: str | None) -> TensorRecord:
    """``key`` None: a tensor the base holds (``schema.held_by_base``)."""
    return make_record(
        name,
        slot.tensor,
        kind=slot.kind,
        persistent=slot.persistent,
        key=key,
        alias_of=alias_of,
        content_hash=None if slot.stored is None else slot.stored.hash,
    )


def stored_tensors(to_store: list[tuple[str, TensorSlot]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` one at a time: a pre-step copy is read back from disk just before it is written.

    Every copy is read into the same buffer, the size of the largest: ``write_tensor_file`` has written
    a tensor before it asks for the next.
    """
    largest = max((slot.stored.nbytes for _, slot in to_store if slot.stored is not None), default=0)
    buffer = torch.empty(largest, dtype=torch.uint8) if largest else None
    for key, slot in to_store:
        yield key, slot.data(buffer)


class PreparedCheckpoint:
    """A checkpoint written but not committed: its tensor file is in place under its final name (named by no
    manifest yet), its manifest sealed and held in memory. ``commit`` makes it the checkpoint; ``abandon``
    removes the tensor file (unless the current manifest names it: a re-save of the same bytes)."""

    def __init__(self, out_dir: Path, stem: str, manifest: Manifest, tensor_name: str, started_from: str | None):
        self.out_dir, self.stem, self.manifest = out_dir, stem, manifest
        self.tensor_name, self.started_from = tensor_name, started_from

    def commit(self) -> Manifest:
        """The compare-and-swap on the manifest found when the write began, then the stale tensor files go."""
        with manifest_lock(self.out_dir, self.stem):
            commit_manifest(self.out_dir, self.stem, self.manifest, self.started_from, locked=True)
            for stale in self.out_dir.glob(f"{self.stem}.*{TENSORS_SUFFIX}"):  # no commit names them now
                if stale.name != self.tensor_name:
                    stale.unlink(missing_ok=True)
        return self.manifest

    def abandon(self) -> None:
        """Nothing of this write stays, and the checkpoint is as it was."""
        with manifest_lock(self.out_dir, self.stem):
            current = self.out_dir / (self.stem + MANIFEST_SUFFIX)
            try:
                named = decode_manifest(current.read_bytes(), str(current)).tensor_file_names()
            except (OSError, ManifestError):
                named = []
            if self.tensor_name not in named:
                (self.out_dir / self.tensor_name).unlink(missing_ok=True)


def prepare_checkpoint(
    capture: Capture,
    out_dir: Path,
    stem: str,
    *,
    signing_key: SigningKey | None = None,
    release: bool = False,
    encryption_key: EncryptionKey | None = None,
    progress: ProgressCallback | None = None,
    save_id: str | None = None,
    beside_a_base: bool = False,
) -> PreparedCheckpoint:
    """``write_checkpoint`` up to its commit: the tensor file written and the manifest sealed. ``beside_a_base``:
    the generation this rank's manifest goes into has a base, so the layers it can feed are left to it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_a_generations_checkpoint(out_dir)
    started_from = current_generation(out_dir / (stem + MANIFEST_SUFFIX))
    _remove_orphaned_temporaries(out_dir, stem)
    manifest, to_store = build_manifest(capture, "", beside_a_base)
    tensor_name = _write_tensors(
        out_dir, stem, manifest.tensor_file, to_store, encryption_key, progress, capture.close if release else None
    )
    manifest.save_id = save_id
    manifest.format_version = required_format_version(manifest)
    manifest.seal = seal_manifest(manifest, signing_key, encryption_key)
    return PreparedCheckpoint(out_dir, stem, manifest, tensor_name, started_from)


@takes_keywords_of(prepare_checkpoint)
def write_checkpoint(capture: Capture, out_dir: Path, stem: str, **options: Any) -> Manifest:
    """Write ``<stem>.<digest>.tensors`` and then ``<stem>.manifest.json`` into ``out_dir``.

    With ``encryption_key`` the tensor data is encrypted (tensorizer's own
    encryption; the manifest records it, and its content hashes stay those of
    the plaintext). The manifest is sealed last, over every field: keyed
    (``mac``) with ``signing_key``, else keyed from ``encryption_key``
    (``mac-encryption-key``), else a plain ``digest``. ``progress`` is called
    after each tensor is written.

    Crash safety: the tensor file gets a new name derived from its content, so a
    checkpoint already at ``out_dir`` is never touched until the new manifest
    replaces the old one in a single atomic rename. Killed at any moment, the
    directory holds either the old complete checkpoint or the new one; at worst
    beside it an unreferenced hidden ``*.tmp`` file or an unreferenced complete
    tensor file, both removed by the next save.

    The manifest found when this write starts is the one it may replace: one another writer committed
    meanwhile (an add-form, another save) is a ``ConcurrentWriteError``, and this write commits nothing.

    ``release`` closes the capture's pre-step copies as soon as the tensor file is
    written, so that their dirty pages are dropped instead of competing with the
    ``fsync`` for the disk. ``save_id`` is the id every rank of a sharded save shares (``Manifest.save_id``).

    It is ``prepare_checkpoint`` then ``PreparedCheckpoint.commit``: the ranks of a sharded save vote between
    the two (``vllm_integration``), so that none commits unless all have written their part.
    """
    return prepare_checkpoint(capture, out_dir, stem, **options).commit()


def refuse_a_generations_checkpoint(out_dir: Path) -> None:
    """A manifest of format version 1 or 2 is never written beside a pointer: readers would follow the pointer and
    never see it (the write would be lost, silently)."""
    if (out_dir / POINTER_NAME).is_file():
        raise ConfigurationError(
            f"{out_dir}: a checkpoint of format version 3 (it has {POINTER_NAME}); a write of format version 2 "
            "would not be seen by its readers: write it with format_version=3 (--format-version 3), or elsewhere"
        )


def write_added_form(
    capture: Capture,
    checkpoint_dir: Path,
    stem: str,
    base: Manifest,
    *,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
    into: Path | None = None,
) -> Manifest:
    """Add the processed form of ``capture``'s layers (this engine's, made from their raw fallbacks) to the
    checkpoint in ``checkpoint_dir``: a tensor file of its own, then the manifest with the form appended to
    ``added_forms``, sealed again, renamed into place last.

    ``base`` is the manifest the engine loaded, the one this form was made from: its seal is checked again
    (with the keys given) before it is re-sealed, and it is committed over only if it is still the checkpoint's
    manifest (``ConcurrentWriteError`` otherwise: a re-save or another add-form came first).

    Crash-safe as ``write_checkpoint`` is: until the rename, the directory holds the checkpoint as it was
    (an unreferenced new tensor file at worst), and a loader that read the old manifest still finds every
    file it names. Returns the new manifest.

    ``into``: a new generation's folder (format version 3): the form's tensor file and the new manifest are written
    there, and the pointer's swap is the compare (``publish.commit``).
    """
    if into is None:
        refuse_a_generations_checkpoint(checkpoint_dir)
    sealed = check_seal(base, signing_key, encryption_key)
    if sealed is not None:
        kind, message = sealed
        raise kind(f"{checkpoint_dir / (stem + MANIFEST_SUFFIX)}: not adding a form to it: {message}")
    started_from = manifest_generation(base) if into is None else None
    target = checkpoint_dir if into is None else into
    manifest = msgspec.structs.replace(base, added_forms=list(base.added_forms))
    _remove_orphaned_temporaries(target, stem)
    form, to_store = build_manifest(capture, "")
    _write_tensors(target, stem, form.tensor_file, to_store, encryption_key)
    covered = form_base(base, (layer.path for layer in form.modules))
    manifest.added_forms.append(
        AddedForm(fingerprint=capture.fingerprint, tensor_file=form.tensor_file, modules=form.modules, base=covered)
    )
    manifest.format_version = required_format_version(manifest)
    manifest.seal = seal_manifest(manifest, signing_key, encryption_key)
    commit_manifest(target, stem, manifest, started_from)
    return manifest


def manifest_lock(out_dir: Path, stem: str):
    """Writers of one checkpoint commit one at a time: ``files.exclusive_lock`` on ``.<stem>.manifest.json.lock``."""
    return exclusive_lock(out_dir / f".{stem}{MANIFEST_SUFFIX}.lock", out_dir / (stem + MANIFEST_SUFFIX))


def current_generation(manifest_path: Path) -> str | None:
    """The generation of the manifest at ``manifest_path`` now (``schema.manifest_generation``): None when there
    is none, and one that cannot be decoded by its bytes (so that a re-save can replace a damaged manifest)."""
    try:
        data = manifest_path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return manifest_generation(decode_manifest(data, str(manifest_path)))
    except ManifestError:
        return "unreadable:blake3:" + blake3.blake3(data).hexdigest()


def commit_manifest(
    out_dir: Path, stem: str, manifest: Manifest, started_from: str | None, locked: bool = False
) -> None:
    """Replace ``<stem>.manifest.json`` with ``manifest`` if it is still the one the writer started from
    (``started_from``, a ``current_generation``; None: there was none), else ``ConcurrentWriteError``.
    ``locked``: the caller holds ``manifest_lock`` already."""
    path = out_dir / (stem + MANIFEST_SUFFIX)
    with contextlib.nullcontext() if locked else manifest_lock(out_dir, stem):
        now = current_generation(path)
        if now != started_from:
            raise ConcurrentWriteError(
                f"{path}: another writer committed a manifest since this one read it "
                f"({started_from or 'none'} then, {now or 'none'} now); nothing of this write was committed: "
                "read the checkpoint again and re-run it"
            )
        _write_manifest(out_dir, stem, manifest)


def _write_tensors(
    out_dir: Path,
    stem: str,
    ref: TensorFileRef,
    to_store: list[tuple[str, TensorSlot]],
    encryption_key: EncryptionKey | None,
    progress: ProgressCallback | None = None,
    written: Callable[[], None] | None = None,
) -> str:
    """``write_stream`` of the slots' tensors (a pre-step copy read back just before it is written)."""
    nbytes = sum(_nbytes(slot) for _, slot in to_store)
    return write_stream(
        out_dir, stem, ref, stored_tensors(to_store), len(to_store), nbytes, encryption_key, progress, written
    )


def write_stream(
    out_dir: Path,
    stem: str,
    ref: TensorFileRef,
    tensors: Iterator[tuple[str, torch.Tensor]],
    count: int,
    nbytes: int,
    encryption_key: EncryptionKey | None,
    progress: ProgressCallback | None = None,
    written: Callable[[], None] | None = None,
) -> str:
    """Write ``<stem>.<digest>.tensors`` from ``(key, tensor)`` pairs (``written`` is called once its data is out),
    fill ``ref`` (name, size, head and prefix hashes, encryption), and rename it into place. Returns its name."""
    tensor_name = f"{stem}.{ref.digest.removeprefix('blake3:')[:16]}{TENSORS_SUFFIX}"
    ref.path = tensor_name
    if encryption_key is not None:
        ref.encryption = ENCRYPTION_TENSORIZER
    counter = ProgressCounter(progress, count, nbytes)
    tmp_tensors = out_dir / temporary_name(tensor_name)
    try:
        write_tensor_file(tmp_tensors, tensors, encryption_key, on_written=lambda _, n: counter.advance(n))
        if written is not None:
            written()
        ref.size = tmp_tensors.stat().st_size
        index = read_index(tmp_tensors, encrypted=encryption_key is not None)
        ref.head_hash = head_hash(tmp_tensors, index)
        ref.prefix_size = prefix_size(index, ref.size)
        ref.prefix_hash = prefix_hash(tmp_tensors, ref.prefix_size)
        if encryption_key is not None:
            # Fresh nonces make every encrypted write differ: its name takes the head hash too (nonces and MACs),
            # so that a re-save never replaces the file an older manifest names.
            head = ref.head_hash.removeprefix("blake3:")[:16]
            tensor_name = ref.path = tensor_name.replace(TENSORS_SUFFIX, f"-{head}{TENSORS_SUFFIX}")
        fsync_file(tmp_tensors)
        os.replace(tmp_tensors, out_dir / tensor_name)
    finally:
        tmp_tensors.unlink(missing_ok=True)
    return tensor_name


def _write_manifest(out_dir: Path, stem: str, manifest: Manifest) -> None:
    """``<stem>.manifest.json``, written beside and renamed over the old one: the commit point."""
    replace_atomically(out_dir / (stem + MANIFEST_SUFFIX), encode_manifest(manifest))


def _nbytes(slot: TensorSlot) -> int:
    """Bytes a slot's tensor stores (a pre-step copy's stand-in on the meta device has the shape and dtype)."""
    return slot.tensor.numel() * slot.tensor.element_size()


def _remove_orphaned_temporaries(out_dir: Path, stem: str) -> None:
    """Hidden temporaries of this host's saves of ``stem`` that were killed (``files.remove_dead_temporaries``)."""
    remove_dead_temporaries(out_dir, f".{stem}.*.tmp")


def copy_model_files(src_dir: Path, out_dir: Path) -> list[str]:
    """Copy config, tokenizer and other non-weight files; never download anything."""
    copied = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(src_dir.iterdir()):
        if not path.is_file() or not is_model_file(path.name):
            continue
        tmp = out_dir / f".{path.name}.{os.getpid()}.tmp"
        shutil.copy2(path, tmp)
        os.replace(tmp, out_dir / path.name)
        copied.append(path.name)
    return copied
