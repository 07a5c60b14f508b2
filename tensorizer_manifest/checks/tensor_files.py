"""A tensor file against its manifest: its exact size, then its prefix (tensorizer's header and index, read
plainly before tensorizer parses a byte) and every size field tensorizer will believe (its index and each
tensor's own header, parsed with bounded plain reads against the records), then its head hash and
tensorizer's index as tensorizer parsed it (every record present once, the same dtype, shape and length,
inside the file, not overlapping); content hashes last, one tensor at a time, of the plaintext. A remote
file gets the same checks with ranged reads."""

from __future__ import annotations

import itertools

from ..errors import (
    IntegrityError,
    ManifestError,
    RemoteStorageError,
    TensorizerManifestError,
    UnsupportedModelError,
)
from ..format.schema import EncryptionKey, TensorFileRef, TensorRecord
from ..live_model.tensors import hash_tensor
from ..progress import ProgressCallback, ProgressCounter
from ..storage.checkpoint import (
    FileLocation,
    file_size,
)
from ..storage.tensor_file import IndexEntry, TensorFileReader, head_hash, prefix_hash, read_index
from ..storage.tensor_headers import HeaderScan, scan_headers
from .report import Problem


def check_tensor_file(ref: TensorFileRef, tensor_path: FileLocation, by_key: dict[str, TensorRecord]) -> list[Problem]:
    """File-level checks from metadata only: size, prefix, head hash, tensorizer's index.

    A remote file that cannot be read is one problem of its ``RemoteStorageError`` kind.
    """
    try:
        problems, scan = check_before_parsing(ref, tensor_path, by_key)
        if problems:
            return problems  # tensorizer never sees a file whose header and index are not the saved ones
        try:
            index = read_index(tensor_path, encrypted=ref.encryption != "none")
        except (RemoteStorageError, UnsupportedModelError):  # storage failing, or this tensorizer lacking a name
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
        return check_index(ref, tensor_path, by_key, index, scan)
    except RemoteStorageError as exc:
        return [Problem(type(exc), str(tensor_path), str(exc))]


def check_before_parsing(
    ref: TensorFileRef, tensor_path: FileLocation, by_key: dict[str, TensorRecord]
) -> tuple[list[Problem], HeaderScan | None]:
    """What plain reads can check before tensorizer parses a byte: the size, the prefix, then every size field
    tensorizer would believe (``scan_headers``), so that what it allocates is what the records say.

    One pass reads the file's non-data bytes; the scan it returns carries the head hash ``check_index`` needs.
    """
    where = str(tensor_path)
    size = file_size(tensor_path)
    if size != ref.size:
        return [
            Problem(
                IntegrityError,
                where,
                f"{size} bytes, the manifest says {ref.size}: the file is truncated, padded or from another save",
            )
        ], None
    total = sum(r.nbytes for r in by_key.values())
    if total > size:
        claims = f"the manifest claims {total} bytes of tensors in a {size} byte file"
        return [Problem(IntegrityError, where, claims)], None
    recorded = _recorded_prefix(ref, where, size)
    if isinstance(recorded, Problem):
        return [recorded], None
    scan = scan_headers(tensor_path, by_key, size=size, encrypted=ref.encryption != "none", prefix_size=recorded)
    if recorded is not None:
        digest = scan.prefix_hash if scan.prefix_hash is not None else prefix_hash(tensor_path, recorded)
        if digest != ref.prefix_hash:
            return [
                Problem(
                    IntegrityError,
                    where,
                    "the file's header does not match the manifest (tensorizer's file header or index differs; "
                    "checked before tensorizer reads it): it belongs to another checkpoint or is damaged",
                )
            ], None
    return [Problem(IntegrityError, where, message) for message in scan.problems], scan


def check_index(
    ref: TensorFileRef,
    tensor_path: FileLocation,
    by_key: dict[str, TensorRecord],
    index: dict[str, IndexEntry],
    scan: HeaderScan | None = None,
) -> list[Problem]:
    """tensorizer's index of the file (already parsed) and the bytes around the data against the manifest.

    The head hash is the ``scan``'s when tensorizer parsed the same layout (no read); otherwise it is read again.
    """
    where, size = str(tensor_path), ref.size  # the size was checked before parsing
    problems: list[Problem] = []
    if ref.head_hash is not None and _head_hash(tensor_path, index, scan) != ref.head_hash:
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


def _head_hash(tensor_path: FileLocation, index: dict[str, IndexEntry], scan: HeaderScan | None) -> str:
    """The scan's head hash when its layout is tensorizer's (the same data spans), else read from the file."""
    if scan is not None and scan.head_hash is not None:
        if scan.data_spans == {key: (e.data_offset, e.data_length) for key, e in index.items()}:
            return scan.head_hash
    return head_hash(tensor_path, index)


def _recorded_prefix(ref: TensorFileRef, where: str, size: int) -> int | None | Problem:
    """The manifest's prefix size, checked for sense (None for manifests of 0.2.0 and older, which have none).

    tensorizer believes the size fields in its file header and index (a damaged index length makes it
    allocate what it claims), so the prefix's hash is checked before it opens the file.
    """
    if ref.prefix_size is None and ref.prefix_hash is None:
        return None
    if ref.prefix_size is None or ref.prefix_hash is None:
        return Problem(ManifestError, where, "prefix_size and prefix_hash are recorded together or not at all")
    if ref.prefix_size > size:
        return Problem(IntegrityError, where, f"the manifest's prefix_size {ref.prefix_size} is past the file's end")
    return ref.prefix_size


def check_hashes(
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
