"""A checkpoint against itself, with no vLLM and no GPU: the entry points that run the checks of ``checks/``.

Like safetensors' reader, everything that can be checked from metadata is
checked before any tensor data is read or allocated: the seal over the whole
manifest, record names unique, shapes and byte counts consistent, aliases
valid, the digest over all records equal to the one bound to the tensor file,
the file's exact size, the hash of its prefix (read plainly, before tensorizer
parses a byte of it), every size field tensorizer will believe (its index and
each tensor's own header, parsed with bounded plain reads and compared with the
records, so that tensorizer allocates no more than they record), the hash of
its head, and tensorizer's own index (every record present once, the same
dtype, shape and byte length, data inside the file and not overlapping).
Content hashes are checked last, one tensor at a time
(of the plaintext: an encrypted file's are checked with its key, and only then).

``validate_checkpoint`` collects every problem into a frozen report (as
huggingface_hub's cache verification does); the loader calls
``open_checked`` (``check_files`` with the tensor file left open, so tensorizer
parses its header once) and raises the first kind of problem with all of them listed.
A remote checkpoint (``s3://``, ``http(s)://``) gets the same checks: its
prefix and headers with ranged reads, its content hashes as it streams.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, cast

from .._signatures import takes_keywords_of
from ..errors import (
    CompatibilityError,
    ConfigurationError,
    IntegrityError,
    ManifestVersionError,
    RemoteStorageError,
    TensorizerManifestError,
)
from ..format.generation import BaseDocument, Generation
from ..format.schema import (
    MANIFEST_SUFFIX,
    EncryptionKey,
    Manifest,
    SigningKey,
    TensorFileRef,
    TensorRecord,
)
from ..progress import ProgressCallback
from ..storage.checkpoint import (
    FileLocation,
    checkpoint_root,
    encryption_key_from,
    load_base,
    load_generation,
    load_manifest,
    read_manifest,
    resolve_tensor_file,
    signing_key_from,
)
from ..storage.remote import RemoteDir, RemoteFile, RemoteOptions, as_remote, is_remote
from ..storage.source_files import SourceFilesReader
from ..storage.tensor_file import TensorFileReader
from .fingerprint import settings_differences
from .generation_files import generation_problems
from .records import check_added_forms, check_base, check_manifest
from .report import Problem, ValidationReport
from .seal import check_encryption, seal_needs_encryption_key, unsealed_warning
from .tensor_files import check_before_parsing, check_hashes, check_index, check_tensor_file


def check_files(
    manifest: Manifest,
    manifest_path: FileLocation,
    *,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
) -> FileLocation:
    """Everything but content hashes; raises on the first kind of problem. Returns the tensor file's location.

    The seal comes first: with the encryption key, a wrong key is refused here, before any weight is read.
    The loader uses ``open_checked``, the same checks with the file left open. Added forms' tensor files
    are checked as the main one is.
    """
    by_key, form_problems, forms_by_key = _check_manifest_for_loading(
        manifest, manifest_path, signing_key, encryption_key
    )
    ValidationReport(
        manifest_path, None, problems=tuple(p for found in form_problems for p in found)
    ).raise_for_problems()
    forms = [(form.tensor_file, forms_by_key[index]) for index, form in manifest.readable_forms()]
    refs = [(manifest.tensor_file, by_key), *forms]
    files = [(ref, resolve_tensor_file(manifest, manifest_path, ref), keys) for ref, keys in refs]
    problems = [p for ref, tensor_path, keys in files for p in check_tensor_file(ref, tensor_path, keys)]
    ValidationReport(manifest_path, files[0][1], problems=tuple(problems)).raise_for_problems()
    return files[0][1]


class CheckedFiles:
    """A loader's tensor files: the main one, checked and open; each added form's, checked and opened only when
    a layer first chooses that form (``usable``).

    A form is an optimisation, never a single point of failure: one this loader cannot use (a record or
    restorer this version does not know, a file missing, damaged or unreachable) is skipped, with its reason in
    ``skipped``, and its layers take their next choice (``layer_forms.choose_forms``)."""

    def __init__(
        self,
        main: TensorFileReader,
        open_form: Callable[[int], TensorFileReader],
        form_problems: list[list[Problem]],
    ):
        self.main = main
        self._open_form = open_form
        self._readers: dict[int, TensorFileReader] = {}
        self.skipped: dict[int, str] = {
            index: "; ".join(p.message for p in problems) for index, problems in enumerate(form_problems) if problems
        }

    def usable(self, index: int) -> bool:
        """Whether added form ``index`` can be read: opened and checked here, the first time it is asked."""
        if index in self.skipped:
            return False
        if index not in self._readers:
            try:
                self._readers[index] = self._open_form(index)
            except (TensorizerManifestError, OSError) as exc:
                self.skipped[index] = f"{type(exc).__name__}: {exc}"
                return False
        return True

    def form(self, index: int) -> TensorFileReader:
        """Added form ``index``'s reader (``usable`` said it is)."""
        return self._readers[index]

    def close(self) -> None:
        """Close every file (closing again, on the way out, is harmless)."""
        for reader in (self.main, *self._readers.values()):
            reader.close()


@contextmanager
def open_checked_forms(
    manifest: Manifest,
    manifest_path: FileLocation,
    *,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
    device: str = "cpu",
    num_readers: int | None = None,
    base_available: bool = False,
) -> Iterator[CheckedFiles]:
    """``open_checked`` for the main tensor file, and the added forms' files ready to be opened as chosen.
    ``base_available``: the manifest is a rank of a generation with a base, which may hold some of its layers."""
    by_key, form_problems, forms_by_key = _check_manifest_for_loading(
        manifest, manifest_path, signing_key, encryption_key, base_available
    )

    def open_one(ref: TensorFileRef, records: dict[str, TensorRecord]) -> TensorFileReader:
        location = resolve_tensor_file(manifest, manifest_path, ref)
        return stack.enter_context(
            _open_one(
                manifest_path,
                ref,
                location,
                records,
                encryption_key=encryption_key,
                device=device,
                num_readers=num_readers,
            )
        )

    with ExitStack() as stack:
        main = open_one(manifest.tensor_file, by_key)

        def open_form(index: int) -> TensorFileReader:
            return open_one(manifest.added_forms[index].tensor_file, forms_by_key[index])

        yield CheckedFiles(main, open_form, form_problems)


@contextmanager
@takes_keywords_of(open_checked_forms)
def open_checked(manifest: Manifest, manifest_path: FileLocation, **options: Any) -> Iterator[TensorFileReader]:
    """``check_files``, then the tensor file open for reading, its header parsed by tensorizer once.

    The prefix hash vouches for tensorizer's header and index with plain reads
    before tensorizer opens the file; the index the reader then parsed is
    checked as ``check_files`` checks it. Nothing is read from the tensor data.
    ``open_checked_forms`` gives the added forms' files too.
    """
    with open_checked_forms(manifest, manifest_path, **options) as files:
        yield files.main


@contextmanager
def open_checked_base(
    base: BaseDocument,
    document: FileLocation,
    tensor_path: FileLocation,
    *,
    encryption_key: EncryptionKey | None = None,
    device: str = "cpu",
    num_readers: int | None = None,
) -> Iterator[TensorFileReader]:
    """A base's tensor file, checked as a form's is (its records, the size, prefix, head hash and index) and open
    for reading; its document's bytes were checked against the generation (``checkpoint.load_base``). A base by
    reference: the source's files at ``tensor_path`` (a directory), each there with its recorded size."""
    problems, by_key = check_base(base, document)
    ValidationReport(document, None, problems=tuple(problems)).raise_for_problems()
    if base.source is not None:
        with SourceFilesReader(base.source, tensor_path) as reader:  # type: ignore[arg-type]
            yield reader  # type: ignore[misc]
        return
    with _open_one(
        document,
        base.tensor_file,
        tensor_path,
        by_key,
        encryption_key=encryption_key,
        device=device,
        num_readers=num_readers,
    ) as reader:
        yield reader


@contextmanager
def _open_one(manifest_path, ref, tensor_path, by_key, *, encryption_key, device, num_readers):
    try:
        problems, scan = check_before_parsing(ref, tensor_path, by_key)
    except RemoteStorageError as exc:
        problems, scan = [Problem(type(exc), str(tensor_path), str(exc))], None
    ValidationReport(manifest_path, tensor_path, problems=tuple(problems)).raise_for_problems()
    try:
        reader = TensorFileReader(tensor_path, device=device, num_readers=num_readers, encryption_key=encryption_key)
    except ConfigurationError:
        if ref.encryption != "none":
            raise
        raise IntegrityError(f"{tensor_path}: the tensor file is encrypted, its manifest says it is not") from None
    with reader:
        try:
            problems = check_index(ref, tensor_path, by_key, reader.index(), scan)
        except RemoteStorageError as exc:
            problems = [Problem(type(exc), str(tensor_path), str(exc))]
        ValidationReport(manifest_path, tensor_path, problems=tuple(problems)).raise_for_problems()
        yield reader


def _check_manifest_for_loading(
    manifest: Manifest,
    manifest_path: FileLocation,
    signing_key: SigningKey | None,
    encryption_key: EncryptionKey | None,
    base_available: bool = False,
) -> tuple[dict[str, TensorRecord], list[list[Problem]], list[dict[str, TensorRecord]]]:
    """The manifest's own checks and its keys, raised; returns its stored records by key, and each added form's
    problems (left to the caller: a loader skips such a form) and stored records by key."""
    problems, by_key = check_manifest(
        manifest, manifest_path, signing_key, encryption_key, base_available=base_available
    )
    form_problems, forms_by_key = check_added_forms(manifest, manifest_path)
    keys = check_encryption(manifest, encryption_key)
    if keys is not None:
        problems.insert(0, Problem(keys[0], str(manifest_path), keys[1]))
    ValidationReport(manifest_path, None, problems=tuple(problems)).raise_for_problems()
    return by_key, form_problems, forms_by_key


def _generation_of(
    path: str | Path | RemoteFile, remote: RemoteOptions | None
) -> tuple[Path | RemoteDir, Generation] | None:
    """The checkpoint and current generation ``validate``'s ``path`` names (format version 3; None otherwise):
    its directory or prefix, or a rank's name at the top of it."""
    root = checkpoint_root(path, remote)
    if root is None and str(path).endswith(MANIFEST_SUFFIX):
        if isinstance(path, RemoteFile):
            root = path.parent
        elif isinstance(path, str) and is_remote(path):
            root = cast(RemoteFile, as_remote(path, remote)).parent  # a URI ending in MANIFEST_SUFFIX is a file
        else:
            root = Path(path).parent
    if root is None:
        return None
    found = load_generation(root)
    return None if found is None else (root, found[0])


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
    problems: list[Problem] = []
    generation_warnings: list[str] = []
    try:
        current = _generation_of(path, remote)
    except TensorizerManifestError as exc:
        current = None
        problems.append(Problem(type(exc), str(path), str(exc)))
    found, by_key = check_manifest(
        manifest,
        manifest_path,
        signing_key,
        encryption_key,
        check_the_seal=not unchecked_seal,
        base_available=current is not None and current[1].base is not None,
    )
    problems = found + problems
    if current is not None:
        in_generation, generation_warnings = generation_problems(*current, manifest, signing_key, encryption_key)
        problems += [Problem(kind, where, message) for kind, where, message in in_generation]
    form_problems, forms_by_key = check_added_forms(manifest, manifest_path)
    # a form another version wrote, which this one does not use, is not damage: loaders skip it
    other_version = [p for found in form_problems for p in found if p.kind is ManifestVersionError]
    problems += [p for found in form_problems for p in found if p.kind is not ManifestVersionError]
    keys = check_encryption(manifest, encryption_key)
    if keys is not None and keys[0] is not ConfigurationError:  # a missing key is a warning here
        problems.insert(0, Problem(keys[0], str(manifest_path), keys[1]))
    warning = unsealed_warning(manifest) if signing_key is None and encryption_key is None else None
    warnings = [f"{manifest_path}: {warning}"] if warning else []
    warnings += [f"{p}; loaders skip it" for p in other_version]
    warnings += generation_warnings
    if unchecked_seal:
        warnings.append(
            f"{manifest_path}: the seal was not checked: it is keyed from the encryption key; "
            "pass --encryption-key-file to check it"
        )
    readable = manifest.readable_forms()
    records = len(manifest.ordered_records()) + sum(len(m.tensors) for _, f in readable for m in f.modules)
    stored = len(by_key) + sum(len(keys) for keys in forms_by_key)
    refs = [(manifest.tensor_file, by_key)] + [(form.tensor_file, forms_by_key[index]) for index, form in readable]
    files = []
    for ref, keys in refs:
        try:
            files.append((resolve_tensor_file(manifest, manifest_path, ref), keys))
        except TensorizerManifestError as exc:
            problems.append(Problem(type(exc), str(manifest_path), str(exc)))
    referenced = None
    if current is not None and current[1].base is not None:  # the base's file is checked as the rank's are
        try:
            base, document, base_path = load_base(*current)
        except TensorizerManifestError as exc:
            problems.append(Problem(type(exc), str(current[0]), str(exc)))
        else:
            found, base_keys = check_base(base, document)
            problems += found
            records += len(base.tensors)
            if base.source is not None:  # by reference: the source's files, checked after the checkpoint's own
                referenced = (base, base_path)
            else:
                refs.append((base.tensor_file, base_keys))
                files.append((base_path, base_keys))
                stored += len(base_keys)
    if len(files) < len(refs):
        return ValidationReport(manifest_path, None, records, stored, 0, tuple(problems), tuple(warnings), encrypted)
    for (ref, _), (tensor_path, keys) in zip(refs, files, strict=True):
        problems += check_tensor_file(ref, tensor_path, keys)
    tensor_path = files[0][0]
    checked = 0
    if verify_hashes and encrypted and encryption_key is None:
        warnings.append(
            f"{tensor_path}: content hashes were not checked: the tensor file is encrypted; "
            "pass --encryption-key-file to check them"
        )
    elif verify_hashes and not problems:
        for path, keys in files:
            found, n = check_hashes(path, keys, encryption_key, progress)
            problems, checked = problems + found, checked + n
    if referenced is not None and not problems:
        found, n = check_source_files(*referenced, verify_hashes=verify_hashes)
        problems, checked = problems + found, checked + n
    return ValidationReport(
        manifest_path, tensor_path, records, stored, checked, tuple(problems), tuple(warnings), encrypted
    )


def check_source_files(base: BaseDocument, source_dir: FileLocation, verify_hashes: bool = True) -> tuple[list, int]:
    """A base by reference's source files: each there with its recorded size, and (``verify_hashes``) each base
    tensor in them with its recorded content hash. Returns problems and how many hashes were checked."""
    from ..live_model.sources import source_record

    expected = {record.name: record for record in base.tensors}
    checked = 0
    try:
        with SourceFilesReader(base.source, source_dir) as reader:  # type: ignore[arg-type]
            if not verify_hashes:
                return [], 0
            for name, tensor in reader.stream():
                if source_record(name, tensor).hash != expected[name].hash:
                    message = f"content hash of base tensor {name!r} does not match the base: the source changed"
                    return [Problem(IntegrityError, str(source_dir), message + "; save the checkpoint again")], checked
                checked += 1
    except TensorizerManifestError as exc:
        return [Problem(type(exc), str(source_dir), str(exc))], checked
    return [], checked


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
