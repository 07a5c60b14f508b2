"""A checkpoint against itself, with no vLLM and no GPU: the manifest's records, then its tensor file.

Like safetensors' reader, everything that can be checked from metadata is
checked before any tensor data is read or allocated: the seal over the whole
manifest, record names unique, shapes and byte counts consistent, aliases
valid, the digest over all records equal to the one bound to the tensor file,
the file's exact size, the hash of its prefix (read plainly, before tensorizer
parses a byte of it), the hash of its head, and tensorizer's own index (every
record present once, the same dtype, shape and byte length, data inside the
file and not overlapping). Content hashes are checked last, one tensor at a time
(of the plaintext: an encrypted file's are checked with its key, and only then).

``validate_checkpoint`` collects every problem into a frozen report (as
huggingface_hub's cache verification does); the loader calls
``open_checked`` (``check_files`` with the tensor file left open, so tensorizer
parses its header once) and raises the first kind of problem with all of them listed.
A remote checkpoint (``s3://``, ``http(s)://``) gets the same checks: its
prefix and headers with ranged reads, its content hashes as it streams.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ._constants import ENCRYPTION_KEY_ENV, SIGNING_KEY_ENV
from .checkpoint import (
    FileLocation,
    encryption_key_from,
    file_size,
    load_manifest,
    read_manifest,
    resolve_tensor_file,
    signing_key_from,
)
from .errors import (
    CompatibilityError,
    ConfigurationError,
    IntegrityError,
    ManifestError,
    RemoteStorageError,
    TensorizerManifestError,
)
from .fingerprint import settings_differences
from .progress import ProgressCallback, ProgressCounter
from .remote import RemoteFile, RemoteOptions
from .restorers import known_replays
from .schema import (
    ALLOWED_PARAM_MODULES,
    DTYPE_ITEMSIZE,
    REPLAY_NONE,
    REPLAY_POST_LOAD,
    EncryptionKey,
    Manifest,
    SigningKey,
    TensorRecord,
    digest_line,
    digest_of_lines,
    fallback_name,
    full_name,
    required_format_version,
    seal_hash,
)
from .tensor_file import IndexEntry, TensorFileReader, head_hash, prefix_hash, read_index
from .tensors import hash_tensor

#: The largest tensor a record may describe; bigger claims are refused before allocation.
MAX_TENSOR_BYTES = 1 << 40


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint, and the error the loader would raise for it."""

    kind: type[TensorizerManifestError]
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"

    def to_dict(self) -> dict:
        return {"error": self.kind.__name__, "where": self.where, "message": self.message}


@dataclass(frozen=True)
class ValidationReport:
    """What ``validate_checkpoint`` checked and found; ``ok`` when it found nothing."""

    manifest_path: FileLocation | None
    tensor_path: FileLocation | None
    records: int = 0
    stored: int = 0
    hashes_checked: int = 0
    problems: tuple[Problem, ...] = field(default_factory=tuple)
    warnings: tuple[str, ...] = field(default_factory=tuple)
    """What is not wrong but weaker than it should be (an unsealed manifest); ``ok`` ignores them."""
    encrypted: bool = False
    """The tensor file is encrypted (its content hashes are checked only with its key)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        """Raise the first problem's error, naming the others (up to five) in its message."""
        if self.problems:
            first, rest = self.problems[0], self.problems[1:]
            more = f" (and {len(rest)} more: " + "; ".join(map(str, rest[:5])) + ")" if rest else ""
            raise first.kind(f"{first}{more}")

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "manifest": str(self.manifest_path) if self.manifest_path else None,
            "tensor_file": str(self.tensor_path) if self.tensor_path else None,
            "records": self.records,
            "stored": self.stored,
            "hashes_checked": self.hashes_checked,
            "encrypted": self.encrypted,
            "problems": [p.to_dict() for p in self.problems],
            "warnings": list(self.warnings),
        }


def _check_record(record: TensorRecord) -> str | None:
    """Rules a record must follow that its types alone do not say (those msgspec checked at decode)."""
    if len(record.shape) != len(record.stride):
        return f"shape {record.shape} and stride {record.stride} differ in rank"
    itemsize = DTYPE_ITEMSIZE[record.dtype]
    numel = 1
    for d in record.shape:
        numel *= d
        if numel * itemsize > MAX_TENSOR_BYTES:
            return f"shape {record.shape} describes more than {MAX_TENSOR_BYTES} bytes"
    if numel * itemsize != record.nbytes:
        return f"nbytes {record.nbytes} does not match {record.dtype}{record.shape} ({numel * itemsize} bytes)"
    if record.kind == "buffer" and record.param_class is not None:
        return "a buffer cannot have a parameter class"
    if record.param_class is not None and record.param_class.rpartition(".")[0] not in ALLOWED_PARAM_MODULES:
        return f"parameter class {record.param_class!r} is not one the loader may build"
    if record.param_attrs and any(attr.startswith("__") for attr in record.param_attrs):
        return f"parameter attribute names may not start with '__': {sorted(record.param_attrs)}"
    return None


def _check_module_replay(module, known: set[str], problem) -> None:
    if module.state == "raw" and module.replay != REPLAY_POST_LOAD:
        problem(ManifestError, f"raw layer {module.path!r} must replay post_load, not {module.replay!r}")
    if module.replay not in known:
        problem(
            ManifestError,
            f"layer {module.path!r} names an unknown replay {module.replay!r}; upgrade tensorizer-manifest or re-save",
        )
    if module.state == "processed" and module.replay == REPLAY_POST_LOAD:
        problem(
            ManifestError,
            f"processed layer {module.path!r} cannot replay post_load (that would process it twice)",
        )


_PASS_THE_KEY = (
    f"pass its key file (signing_key_file in model_loader_extra_config, --signing-key-file, or ${SIGNING_KEY_ENV})"
)


_PASS_THE_ENCRYPTION_KEY = (
    "pass its key file (encryption_key_file in model_loader_extra_config, --encryption-key-file, "
    f"or ${ENCRYPTION_KEY_ENV})"
)


def check_encryption(
    manifest: Manifest, encryption_key: EncryptionKey | None
) -> tuple[type[TensorizerManifestError], str] | None:
    """Whether the keys given suit the checkpoint's encryption, as (error, message); None when they do.

    An encrypted checkpoint needs its key (``ConfigurationError``). Given a key,
    only an encrypted checkpoint passes: anyone who can write the files could
    otherwise replace an encrypted checkpoint with a plain one of their own.
    """
    encrypted = manifest.tensor_file.encryption != "none"
    if encrypted and encryption_key is None:
        return ConfigurationError, f"the checkpoint's tensor file is encrypted; {_PASS_THE_ENCRYPTION_KEY}"
    if not encrypted and encryption_key is not None:
        return IntegrityError, (
            "an encryption key was given but the checkpoint is not encrypted (it was saved without the key, or "
            "replaced by a plain one): re-save it with the key, or load it without one"
        )
    return None


def check_seal(
    manifest: Manifest, signing_key: SigningKey | None, encryption_key: EncryptionKey | None = None
) -> tuple[type[TensorizerManifestError], str] | None:
    """Whether the seal binds this manifest, as (error, message); None when it does, or when there is none and no key.

    With a signing key, only a ``mac`` seal made with that key passes: a
    ``digest`` can be recomputed by anyone who edits the manifest, and a seal can
    be removed. An encrypted checkpoint's manifest is always sealed with a MAC:
    ``mac``, or without a signing key ``mac-encryption-key``, checked with the
    encryption key.
    """
    seal = manifest.seal
    encrypted = manifest.tensor_file.encryption != "none"
    if encrypted and (seal is None or seal.mode == "digest"):
        return IntegrityError, (
            "the manifest was modified after it was saved, or forged: it says its tensor file is encrypted but is "
            "not sealed with a key, as every encrypted checkpoint's manifest is; re-save the checkpoint"
        )
    if seal is not None and seal.mode == "mac-encryption-key":
        if signing_key is not None:
            return IntegrityError, (
                "a signing key was given but the manifest is sealed with its encryption key (saved without the "
                "signing key): re-save it with the signing key, or load it without one"
            )
        if encryption_key is None:
            return ConfigurationError, (
                f"the manifest is sealed with its encryption key (mac-encryption-key); {_PASS_THE_ENCRYPTION_KEY}"
            )
        if seal_hash(manifest, seal.mode, encryption_key=encryption_key) != seal.hash:
            return IntegrityError, (
                "the manifest was modified after it was saved, or the encryption key is not the one it was saved "
                "with (its seal does not match): use the right key, or re-save the checkpoint"
            )
        return None
    if seal is None:
        if signing_key is None:
            return None  # an old manifest: a warning (unsealed_warning), not an error
        return IntegrityError, (
            "a signing key was given but the manifest is not sealed (saved by tensorizer-manifest 0.2.0 or "
            "older, or its seal was removed): re-save the checkpoint with the key"
        )
    if seal.mode == "mac" and signing_key is None:
        return ConfigurationError, f"the manifest is sealed with a signing key (mac); {_PASS_THE_KEY} to check it"
    if seal.mode == "digest" and signing_key is not None:
        return IntegrityError, (
            "a signing key was given but the manifest's seal is a plain digest, which anyone who edits the "
            "manifest can recompute: it was saved without the key, or edited and re-sealed; re-save it with the key"
        )
    if seal_hash(manifest, seal.mode, signing_key) != seal.hash:
        if seal.mode == "mac":
            return IntegrityError, (
                "the manifest was modified after it was saved, or the signing key is not the one it was saved with "
                "(its seal does not match): use the right key, or re-save the checkpoint"
            )
        return IntegrityError, (
            "the manifest was modified after it was saved (its seal does not match its content): re-save the checkpoint"
        )
    return None


def unsealed_warning(manifest: Manifest) -> str | None:
    """The note for an unsealed manifest: loadable, but edits to it are not caught as such."""
    if manifest.seal is not None:
        return None
    return (
        "the manifest is not sealed (saved by tensorizer-manifest 0.2.0 or older): an edit of a field the other "
        "checks do not cover would go unnoticed; re-save the checkpoint to seal it"
    )


def seal_needs_encryption_key(manifest: Manifest, encryption_key: EncryptionKey | None) -> bool:
    """The seal is keyed from the encryption key, and none was given: it cannot be checked."""
    return encryption_key is None and manifest.seal is not None and manifest.seal.mode == "mac-encryption-key"


def check_manifest(
    manifest: Manifest,
    manifest_path: FileLocation,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
    check_the_seal: bool = True,
) -> tuple[list[Problem], dict[str, TensorRecord]]:
    """The seal (unless ``check_the_seal`` is false), then record-level checks; returns problems and the stored
    records by file key."""
    problems: list[Problem] = []
    where = str(manifest_path)

    def problem(kind: type[TensorizerManifestError], message: str) -> None:
        problems.append(Problem(kind, where, message))

    sealed = check_seal(manifest, signing_key, encryption_key) if check_the_seal else None
    if sealed is not None:
        problem(*sealed)

    records_by_name: dict[str, TensorRecord] = {}
    by_key: dict[str, TensorRecord] = {}
    paths: set[str] = set()
    known = known_replays()
    digest_lines: list[str] = []  # the digest is taken in this same pass: one full name per record

    def check_record(name: str, record: TensorRecord) -> None:
        digest_lines.append(digest_line(name, record))
        if name in records_by_name:
            problem(ManifestError, f"tensor {name!r} is recorded twice")
        bad = _check_record(record)
        if bad:
            problem(ManifestError, f"tensor {name!r}: {bad}")
        if record.alias_of is not None:
            _check_alias(name, record, records_by_name, problem)
        elif record.key is not None:
            if record.key in by_key:
                problem(ManifestError, f"tensor file key {record.key!r} is used twice")
            by_key[record.key] = record
        elif record.nbytes:
            problem(ManifestError, f"tensor {name!r} has {record.nbytes} bytes but no tensor file key")
        records_by_name.setdefault(name, record)

    for module in manifest.modules:
        if module.path in paths:
            problem(ManifestError, f"module {module.path!r} is recorded twice")
        paths.add(module.path)
        _check_module_replay(module, known, problem)
        for record in module.tensors:
            check_record(full_name(module.path, record.name), record)
    for module in manifest.modules:  # the raw fallbacks, after every layer's own tensors (as in the file)
        if module.fallback and (module.state != "processed" or module.replay == REPLAY_NONE):
            problem(ManifestError, f"layer {module.path!r} has a raw fallback but is not a processed layer")
        for record in module.fallback:
            name = fallback_name(full_name(module.path, record.name))
            if record.alias_of is not None:
                problem(ManifestError, f"raw fallback {name!r} is an alias; fallbacks store every tensor")
            check_record(name, record)
    if manifest.format_version < required_format_version(manifest):
        problem(
            ManifestError,
            f"the manifest says format version {manifest.format_version} but holds raw fallbacks (version "
            f"{required_format_version(manifest)}): it was edited by hand; re-save the checkpoint",
        )
    if digest_of_lines(digest_lines) != manifest.tensor_file.digest:
        problem(
            IntegrityError,
            "the tensor records do not match the digest bound to the tensor file: the manifest was edited "
            "or belongs to another checkpoint; re-save it",
        )
    if len(by_key) != manifest.tensor_file.tensor_count:
        problem(
            IntegrityError,
            f"{len(by_key)} stored tensors recorded, the manifest's tensor file entry says "
            f"{manifest.tensor_file.tensor_count}",
        )
    return problems, by_key


def _check_alias(name: str, record: TensorRecord, records_by_name: dict[str, TensorRecord], problem) -> None:
    if record.key is not None:
        problem(ManifestError, f"tensor {name!r} is an alias and cannot also be stored")
    target = records_by_name.get(record.alias_of)
    if target is None or record.alias_of == name:
        problem(ManifestError, f"tensor {name!r} is an alias of {record.alias_of!r}, which is not recorded before it")
        return
    form = (record.dtype, record.shape, record.stride, record.storage_offset, record.hash)
    if (target.dtype, target.shape, target.stride, target.storage_offset, target.hash) != form:
        problem(
            ManifestError,
            f"tensor {name!r} differs in form or content from {record.alias_of!r}, the tensor it is an alias of",
        )


def check_tensor_file(manifest: Manifest, tensor_path: FileLocation, by_key: dict[str, TensorRecord]) -> list[Problem]:
    """File-level checks from metadata only: size, prefix, head hash, tensorizer's index.

    A remote file that cannot be read is one problem of its ``RemoteStorageError`` kind.
    """
    try:
        problems = _check_before_parsing(manifest, tensor_path, by_key)
        if problems:
            return problems  # tensorizer never sees a file whose header and index are not the saved ones
        try:
            index = read_index(tensor_path, encrypted=manifest.tensor_file.encryption != "none")
        except RemoteStorageError:
            raise
        except Exception as exc:  # tensorizer raises many kinds on a damaged file
            return [
                Problem(
                    IntegrityError,
                    str(tensor_path),
                    f"tensorizer cannot read the file's index ({type(exc).__name__}: {exc}): "
                    "the file's header does not match the manifest",
                )
            ]
        return _check_index(manifest, tensor_path, by_key, index)
    except RemoteStorageError as exc:
        return [Problem(type(exc), str(tensor_path), str(exc))]


def _check_before_parsing(
    manifest: Manifest, tensor_path: FileLocation, by_key: dict[str, TensorRecord]
) -> list[Problem]:
    """What plain reads can check before tensorizer parses a byte: the size, then the prefix."""
    where = str(tensor_path)
    size = file_size(tensor_path)
    if size != manifest.tensor_file.size:
        return [
            Problem(
                IntegrityError,
                where,
                f"{size} bytes, the manifest says {manifest.tensor_file.size}: "
                "the file is truncated, padded or from another save",
            )
        ]
    total = sum(r.nbytes for r in by_key.values())
    if total > size:
        return [Problem(IntegrityError, where, f"the manifest claims {total} bytes of tensors in a {size} byte file")]
    prefix = _check_prefix(manifest, tensor_path, size)
    return [prefix] if prefix is not None else []


def _check_index(
    manifest: Manifest, tensor_path: FileLocation, by_key: dict[str, TensorRecord], index: dict[str, IndexEntry]
) -> list[Problem]:
    """tensorizer's index of the file (already parsed) and the bytes around the data against the manifest."""
    where, size = str(tensor_path), manifest.tensor_file.size  # the size was checked before parsing
    problems: list[Problem] = []
    if manifest.tensor_file.head_hash is not None and head_hash(tensor_path, index) != manifest.tensor_file.head_hash:
        problems.append(
            Problem(
                IntegrityError,
                where,
                "the file's header does not match the manifest (tensorizer's index or a tensor header differs): "
                "it belongs to another checkpoint or is damaged",
            )
        )
    for key in sorted(set(by_key) - set(index)):
        problems.append(Problem(IntegrityError, where, f"tensor {key!r} is in the manifest but not in the file"))
    for key in sorted(set(index) - set(by_key)):
        problems.append(Problem(IntegrityError, where, f"tensor {key!r} is in the file but not in the manifest"))
    spans = []
    for key in sorted(set(index) & set(by_key)):
        record, entry = by_key[key], index[key]
        if entry.dtype != record.dtype or entry.shape != record.shape:
            problems.append(
                Problem(
                    IntegrityError,
                    where,
                    f"tensor {key!r} is {entry.dtype}{entry.shape} in the file, "
                    f"{record.dtype}{record.shape} in the manifest",
                )
            )
        if entry.data_length != record.nbytes:
            problems.append(
                Problem(
                    IntegrityError,
                    where,
                    f"tensor {key!r} has {entry.data_length} bytes in the file, {record.nbytes} in the manifest",
                )
            )
        end = entry.data_offset + entry.data_length
        if entry.data_offset < 0 or end > size:
            problems.append(
                Problem(
                    IntegrityError,
                    where,
                    f"tensor {key!r} lies outside the file ({entry.data_offset}+{entry.data_length} > {size})",
                )
            )
        spans.append((entry.data_offset, end, key))
    spans.sort()
    for (_, end1, key1), (start2, _, key2) in itertools.pairwise(spans):
        if start2 < end1:
            problems.append(Problem(IntegrityError, where, f"tensors {key1!r} and {key2!r} overlap in the file"))
    return problems


def _check_prefix(manifest: Manifest, tensor_path: FileLocation, size: int) -> Problem | None:
    """tensorizer's file header and index against the manifest, with plain reads of at most the file's size.

    tensorizer believes the size fields it finds there (a damaged index length
    makes it allocate what it claims), so they are checked before it opens the
    file. Manifests of 0.2.0 and older have no prefix: tensorizer reads their index unchecked.
    """
    ref, where = manifest.tensor_file, str(tensor_path)
    if ref.prefix_size is None and ref.prefix_hash is None:
        return None
    if ref.prefix_size is None or ref.prefix_hash is None:
        return Problem(ManifestError, where, "prefix_size and prefix_hash are recorded together or not at all")
    if ref.prefix_size > size:
        return Problem(IntegrityError, where, f"the manifest's prefix_size {ref.prefix_size} is past the file's end")
    if prefix_hash(tensor_path, ref.prefix_size) != ref.prefix_hash:
        return Problem(
            IntegrityError,
            where,
            "the file's header does not match the manifest (tensorizer's file header or index differs; "
            "checked before tensorizer reads it): it belongs to another checkpoint or is damaged",
        )
    return None


def check_files(
    manifest: Manifest,
    manifest_path: FileLocation,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
) -> FileLocation:
    """Everything but content hashes; raises on the first kind of problem. Returns the tensor file's location.

    The seal comes first: with the encryption key, a wrong key is refused here, before any weight is read.
    The loader uses ``open_checked``, the same checks with the file left open.
    """
    tensor_path, by_key = _check_manifest_for_loading(manifest, manifest_path, signing_key, encryption_key)
    problems = check_tensor_file(manifest, tensor_path, by_key)
    ValidationReport(manifest_path, tensor_path, problems=tuple(problems)).raise_for_problems()
    return tensor_path


@contextmanager
def open_checked(
    manifest: Manifest,
    manifest_path: FileLocation,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
    *,
    device: str = "cpu",
    num_readers: int | None = None,
) -> Iterator[TensorFileReader]:
    """``check_files``, then the tensor file open for reading, its header parsed by tensorizer once.

    The prefix hash vouches for tensorizer's header and index with plain reads
    before tensorizer opens the file; the index the reader then parsed is
    checked as ``check_files`` checks it. Nothing is read from the tensor data.
    """
    tensor_path, by_key = _check_manifest_for_loading(manifest, manifest_path, signing_key, encryption_key)
    try:
        problems = _check_before_parsing(manifest, tensor_path, by_key)
    except RemoteStorageError as exc:
        problems = [Problem(type(exc), str(tensor_path), str(exc))]
    ValidationReport(manifest_path, tensor_path, problems=tuple(problems)).raise_for_problems()
    try:
        reader = TensorFileReader(tensor_path, device=device, num_readers=num_readers, encryption_key=encryption_key)
    except ConfigurationError:
        if manifest.tensor_file.encryption != "none":
            raise
        raise IntegrityError(f"{tensor_path}: the tensor file is encrypted, its manifest says it is not") from None
    with reader:
        try:
            problems = _check_index(manifest, tensor_path, by_key, reader.index())
        except RemoteStorageError as exc:
            problems = [Problem(type(exc), str(tensor_path), str(exc))]
        ValidationReport(manifest_path, tensor_path, problems=tuple(problems)).raise_for_problems()
        yield reader


def _check_manifest_for_loading(
    manifest: Manifest,
    manifest_path: FileLocation,
    signing_key: SigningKey | None,
    encryption_key: EncryptionKey | None,
) -> tuple[FileLocation, dict[str, TensorRecord]]:
    """The manifest's own checks and its keys, raised; then where its tensor file is."""
    problems, by_key = check_manifest(manifest, manifest_path, signing_key, encryption_key)
    keys = check_encryption(manifest, encryption_key)
    if keys is not None:
        problems.insert(0, Problem(keys[0], str(manifest_path), keys[1]))
    ValidationReport(manifest_path, None, problems=tuple(problems)).raise_for_problems()
    return resolve_tensor_file(manifest, manifest_path), by_key


def validate_checkpoint(
    path: str | Path | RemoteFile,
    *,
    verify_hashes: bool = True,
    signing_key_file: str | os.PathLike | None = None,
    encryption_key_file: str | os.PathLike | None = None,
    progress: ProgressCallback | None = None,
    remote: RemoteOptions | None = None,
) -> ValidationReport:
    """Every check, every problem: for ``tensorizer-manifest validate``. Never raises for bad input.

    ``path`` is a directory, a manifest file or a URI (``s3://bucket/prefix``,
    ``https://host/path``; ``remote`` holds credentials and endpoint).
    ``signing_key_file`` (else ``$TENSORIZER_MANIFEST_SIGNING_KEY``) names the key
    of a ``mac`` seal; with a key, only a seal made with it passes.
    ``encryption_key_file`` (else ``$TENSORIZER_MANIFEST_ENCRYPTION_KEY``) names
    an encrypted checkpoint's key: without it, everything but the content hashes
    (and a seal keyed from it) is checked, and the report's warnings say so.
    ``progress`` is called after each tensor whose hash is checked.
    """
    try:
        signing_key = signing_key_from(signing_key_file)
        encryption_key = encryption_key_from(encryption_key_file)
        manifest, manifest_path = load_manifest(path, remote=remote)
    except TensorizerManifestError as exc:
        return ValidationReport(None, None, problems=(Problem(type(exc), str(path), str(exc)),))
    encrypted = manifest.tensor_file.encryption != "none"
    unchecked_seal = seal_needs_encryption_key(manifest, encryption_key)
    problems, by_key = check_manifest(
        manifest, manifest_path, signing_key, encryption_key, check_the_seal=not unchecked_seal
    )
    keys = check_encryption(manifest, encryption_key)
    if keys is not None and keys[0] is not ConfigurationError:  # a missing key is a warning here
        problems.insert(0, Problem(keys[0], str(manifest_path), keys[1]))
    warning = unsealed_warning(manifest) if signing_key is None and encryption_key is None else None
    warnings = [f"{manifest_path}: {warning}"] if warning else []
    if unchecked_seal:
        warnings.append(
            f"{manifest_path}: the seal was not checked: it is keyed from the encryption key; "
            "pass --encryption-key-file to check it"
        )
    records = len(manifest.ordered_records())
    try:
        tensor_path = resolve_tensor_file(manifest, manifest_path)
    except TensorizerManifestError as exc:
        problems.append(Problem(type(exc), str(manifest_path), str(exc)))
        return ValidationReport(
            manifest_path, None, records, len(by_key), 0, tuple(problems), tuple(warnings), encrypted
        )
    problems += check_tensor_file(manifest, tensor_path, by_key)
    checked = 0
    if verify_hashes and encrypted and encryption_key is None:
        warnings.append(
            f"{tensor_path}: content hashes were not checked: the tensor file is encrypted; "
            "pass --encryption-key-file to check them"
        )
    elif verify_hashes and not problems:
        problems, checked = _check_hashes(tensor_path, by_key, encryption_key, progress)
    return ValidationReport(
        manifest_path, tensor_path, records, len(by_key), checked, tuple(problems), tuple(warnings), encrypted
    )


def _check_hashes(
    tensor_path: FileLocation,
    by_key: dict[str, TensorRecord],
    encryption_key: EncryptionKey | None = None,
    progress: ProgressCallback | None = None,
) -> tuple[list[Problem], int]:
    """Read every stored tensor (tensorizer's parallel readers, in file order; decrypted with ``encryption_key``)
    and check its content hash."""
    where = str(tensor_path)
    problems: list[Problem] = []
    checked = 0
    counter = ProgressCounter(progress, len(by_key), sum(r.nbytes for r in by_key.values()))
    try:
        with TensorFileReader(tensor_path, encryption_key=encryption_key) as reader:
            for key, tensor in reader.stream():
                checked += 1
                counter.advance(by_key[key].nbytes)
                if hash_tensor(tensor) != by_key[key].hash:
                    problems.append(
                        Problem(
                            IntegrityError,
                            where,
                            f"tensor {key!r}: content hash does not match the manifest (the data is damaged)",
                        )
                    )
    except TensorizerManifestError as exc:
        problems.append(Problem(type(exc), where, str(exc)))
    return problems, checked


def check_engine_settings(
    manifest_path: FileLocation,
    *,
    dtype: str | None = None,
    quantization: str | None = None,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
) -> list[Problem]:
    """Would an engine started with these settings accept the checkpoint? (``fingerprint`` decides.)"""
    try:
        saved = read_manifest(manifest_path).fingerprint
    except TensorizerManifestError as exc:
        return [Problem(type(exc), str(manifest_path), str(exc))]
    differences = settings_differences(
        saved,
        dtype=dtype,
        quantization=quantization,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
    )
    return [
        Problem(
            CompatibilityError,
            str(manifest_path),
            f"saved with {name}={was!r}, the engine would use {now!r}: start vLLM with the saved setting "
            "or re-save the checkpoint",
        )
        for name, was, now in differences
    ]
