"""Turn a capture into a checkpoint: the tensor file, then the manifest, both renamed into place.

The manifest is written last, so a directory whose manifest exists has a
complete tensor file beside it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ._constants import PRODUCER
from .capture import Capture
from .layers import TensorSlot
from .progress import ProgressCallback, ProgressCounter
from .remote import is_model_file
from .schema import (
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
    full_name,
    qualified_class,
    required_format_version,
    seal_manifest,
)
from .tensor_file import head_hash, prefix_hash, prefix_size, read_index, write_tensor_file
from .tensors import make_record


def build_manifest(capture: Capture, tensor_file_name: str) -> tuple[Manifest, list[tuple[str, TensorSlot]]]:
    """Records for every captured layer, and the (key, slot) pairs to store (``stored_tensors`` reads them).

    Every layer's own tensors come first, in layer order; the raw fallbacks after all of them, so that a
    load that needs none reads one contiguous run of the file and stops.
    """
    modules: list[ModuleRecord] = []
    to_store: list[tuple[str, TensorSlot]] = []
    seen: dict[int, str] = {}  # id(tensor) -> full name of the first record holding it
    ordered: list[tuple[str, TensorRecord]] = []
    for layer in capture.layers:
        records: list[TensorRecord] = []
        for name, slot in layer.tensors.items():
            tensor_name = full_name(layer.path, name)
            alias_of = seen.get(id(slot.tensor))
            record = _record(name, slot, tensor_name, alias_of)
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
        for name, slot in layer.fallback.items():
            tensor_name = fallback_name(full_name(layer.path, name))
            record = _record(name, slot, tensor_name, None)
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


def _record(name: str, slot: TensorSlot, tensor_name: str, alias_of: str | None) -> TensorRecord:
    return make_record(
        name,
        slot.tensor,
        kind=slot.kind,
        persistent=slot.persistent,
        key=tensor_name,
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


def write_checkpoint(
    capture: Capture,
    out_dir: Path,
    stem: str,
    signing_key: SigningKey | None = None,
    release: bool = False,
    encryption_key: EncryptionKey | None = None,
    progress: ProgressCallback | None = None,
) -> Manifest:
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

    ``release`` closes the capture's pre-step copies as soon as the tensor file is
    written, so that their dirty pages are dropped instead of competing with the
    ``fsync`` for the disk.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_orphaned_temporaries(out_dir, stem)
    manifest, to_store = build_manifest(capture, "")
    tensor_name = _write_tensors(
        out_dir, stem, manifest.tensor_file, to_store, encryption_key, progress, capture.close if release else None
    )
    manifest.seal = seal_manifest(manifest, signing_key, encryption_key)
    _write_manifest(out_dir, stem, manifest)
    for stale in out_dir.glob(f"{stem}.*{TENSORS_SUFFIX}"):
        if stale.name != tensor_name:
            stale.unlink(missing_ok=True)
    return manifest


def write_added_form(
    capture: Capture,
    checkpoint_dir: Path,
    stem: str,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
) -> Manifest:
    """Add the processed form of ``capture``'s layers (this engine's, made from their raw fallbacks) to the
    checkpoint in ``checkpoint_dir``: a tensor file of its own, then the manifest with the form appended to
    ``added_forms``, sealed again, renamed into place last.

    Crash-safe as ``write_checkpoint`` is: until the rename, the directory holds the checkpoint as it was
    (an unreferenced new tensor file at worst), and a loader that read the old manifest still finds every
    file it names. Returns the new manifest.
    """
    manifest_path = checkpoint_dir / (stem + MANIFEST_SUFFIX)
    manifest = decode_manifest(manifest_path.read_bytes(), str(manifest_path))
    _remove_orphaned_temporaries(checkpoint_dir, stem)
    form, to_store = build_manifest(capture, "")
    _write_tensors(checkpoint_dir, stem, form.tensor_file, to_store, encryption_key)
    manifest.added_forms.append(
        AddedForm(fingerprint=capture.fingerprint, tensor_file=form.tensor_file, modules=form.modules)
    )
    manifest.format_version = required_format_version(manifest)
    manifest.seal = seal_manifest(manifest, signing_key, encryption_key)
    _write_manifest(checkpoint_dir, stem, manifest)
    return manifest


def _write_tensors(
    out_dir: Path,
    stem: str,
    ref: TensorFileRef,
    to_store: list[tuple[str, TensorSlot]],
    encryption_key: EncryptionKey | None,
    progress: ProgressCallback | None = None,
    written: Callable[[], None] | None = None,
) -> str:
    """Write ``<stem>.<digest>.tensors`` (``written`` is called once its data is out), fill ``ref`` (name,
    size, head and prefix hashes, encryption), and rename it into place. Returns its name."""
    tensor_name = f"{stem}.{ref.digest.removeprefix('blake3:')[:16]}{TENSORS_SUFFIX}"
    ref.path = tensor_name
    if encryption_key is not None:
        ref.encryption = ENCRYPTION_TENSORIZER
    counter = ProgressCounter(progress, len(to_store), sum(_nbytes(slot) for _, slot in to_store))
    tmp_tensors = out_dir / f".{tensor_name}.{os.getpid()}.tmp"
    try:
        write_tensor_file(
            tmp_tensors, stored_tensors(to_store), encryption_key, on_written=lambda _, n: counter.advance(n)
        )
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
        _fsync(tmp_tensors)
        os.replace(tmp_tensors, out_dir / tensor_name)
    finally:
        tmp_tensors.unlink(missing_ok=True)
    return tensor_name


def _write_manifest(out_dir: Path, stem: str, manifest: Manifest) -> None:
    """``<stem>.manifest.json``, written beside and renamed over the old one: the commit point."""
    manifest_name = stem + MANIFEST_SUFFIX
    tmp_manifest = out_dir / f".{manifest_name}.{os.getpid()}.tmp"
    try:
        tmp_manifest.write_bytes(encode_manifest(manifest))
        _fsync(tmp_manifest)
        os.replace(tmp_manifest, out_dir / manifest_name)  # the commit point
        _fsync_dir(out_dir)
    finally:
        tmp_manifest.unlink(missing_ok=True)


def _nbytes(slot: TensorSlot) -> int:
    """Bytes a slot's tensor stores (a pre-step copy's stand-in on the meta device has the shape and dtype)."""
    return slot.tensor.numel() * slot.tensor.element_size()


def _remove_orphaned_temporaries(out_dir: Path, stem: str) -> None:
    """Hidden temporaries of saves that were killed (their process is gone)."""
    for tmp in out_dir.glob(f".{stem}.*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except PermissionError:  # alive, another user's
            pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


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
