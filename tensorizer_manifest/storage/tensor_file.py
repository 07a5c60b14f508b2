"""The tensor file on disk: writing it with tensorizer, reading it back, its index, prefix and head hash.

The only module that uses tensorizer's serialization (``remote`` uses its
``stream_io`` to move bytes); tensorizer's names, public and private, and the
wording of its messages it reads, are behind ``tensorizer_names``, the one
module that imports tensorizer.
Tensors go in contiguous and with their dtype untouched; the manifest
(``tensors.py``) carries everything else about their form. A tensor file is a
local ``Path`` or a ``remote.RemoteFile``: the reader then streams it from
storage, and the checks before it read their bytes with ranged requests.
With an ``EncryptionKey``, tensorizer encrypts each tensor's data (XSalsa20-Poly1305
per chunk, authenticated); its file header, index and per-tensor headers stay
plain, so the prefix and head hashes are taken, and checked, the same way.
tensorizer believes every size field it parses, so ``tensor_headers.header_problems``
parses them first, with bounded plain reads, against the manifest's records.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import blake3
import torch

from ..errors import ConfigurationError, IntegrityError, TensorizerManifestError
from ..format.schema import EncryptionKey
from . import tensorizer_names
from .remote import RemoteFile, transfer_error

#: Bytes read at a time when hashing the non-data parts of a tensor file.
_CHUNK = 1 << 20
#: Remote checks read through tensor data shorter than this rather than make another request (within a budget).
_REMOTE_MERGE = 4 << 20
#: The least tensor data a remote check may read through in all (``read_through_budget``).
_READ_THROUGH_MIN = 1 << 20


class IndexEntry(NamedTuple):
    """One tensor in tensorizer's index."""

    dtype: str
    """torch dtype name without ``torch.``."""
    shape: list[int]
    data_offset: int
    data_length: int
    header_offset: int
    """Where tensorizer's own per-tensor header starts."""


def write_tensor_file(
    path: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    encryption_key: EncryptionKey | None = None,
    on_written: Callable[[str, int], None] | None = None,
) -> None:
    """Write ``(key, tensor)`` pairs with tensorizer, contiguous, dtype untouched; encrypted with ``encryption_key``.

    Each tensor is in the file before the next is taken from ``tensors``
    (tensorizer's ``write_tensor`` waits for its writes), so an iterator may
    hand out views of one reused buffer. ``on_written(key, nbytes)`` is called
    after each tensor is written.
    """
    encryption = (
        tensorizer_names.EncryptionParams(encryption_key.tensorizer_key()) if encryption_key is not None else None
    )
    serializer = tensorizer_names.TensorSerializer(str(path), encryption=encryption)
    try:
        for key, tensor in tensors:
            data = tensor.detach()
            if data.device.type != "cpu":
                data = data.cpu()
            data = data.contiguous()
            if encryption is not None and data.data_ptr() == tensor.data_ptr():
                # tensorizer encrypts in place and decrypts back after writing: never on a tensor a model holds.
                data = data.clone()
            serializer.write_tensor(0, key, tensorizer_names.TensorType.STATE_DICT, data)
            if on_written is not None:
                on_written(key, data.numel() * data.element_size())
    finally:
        serializer.close()


def _decryption(encryption_key: EncryptionKey | None):
    if encryption_key is None:
        return None
    return tensorizer_names.DecryptionParams.from_key(encryption_key.tensorizer_key())


def _crypto_error(name: str, exc: Exception) -> Exception | None:
    """The package's error for a tensorizer cryptography failure, None for other exceptions."""
    if not isinstance(exc, tensorizer_names.CryptographyError):
        return None
    text = str(exc)
    if tensorizer_names.DECRYPTION_NOT_REQUESTED in text:
        return ConfigurationError(
            f"{name}: the tensor file is encrypted; pass its key file (encryption_key_file in "
            "model_loader_extra_config, --encryption-key-file, or $TENSORIZER_MANIFEST_ENCRYPTION_KEY)"
        )
    if tensorizer_names.NOT_FLAGGED_ENCRYPTED in text or tensorizer_names.PREDATING_ENCRYPTION in text:
        return IntegrityError(
            f"{name}: an encryption key was given but the tensor file is not encrypted: "
            "it is not the file the manifest describes"
        )
    return IntegrityError(
        f"{name}: decryption failed: the encryption key is not the one the checkpoint was saved with, "
        "or the data was changed after it was saved"
    )


def default_num_readers() -> int:
    """Parallel readers for this machine: one per core, at most 8 (reading from page cache is memory-bound)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


class TensorFileReader:
    """Reads stored tensors: by key (``read``), or all of them in file order (``stream``), in parallel.

    Use it as a context manager. Nothing is read until asked for; tensorizer's
    parallel readers each read one contiguous span of the file into freshly
    allocated tensors, which become the model's tensors without another copy.
    """

    def __init__(
        self,
        path: Path | RemoteFile,
        device: str = "cpu",
        num_readers: int | None = None,
        encryption_key: EncryptionKey | None = None,
    ):
        self.path = path if isinstance(path, RemoteFile) else Path(path)
        self.num_readers = num_readers or default_num_readers()
        source: object = str(self.path)
        if isinstance(self.path, RemoteFile):
            source = self.path.open()
            headers = getattr(source, "response_headers", None) or {}
            if headers.get("accept-ranges") != "bytes":
                self.num_readers = 1  # parallel readers need range requests
        try:
            self._deserializer = tensorizer_names.TensorDeserializer(
                source,
                device=device,
                lazy_load=True,
                verify_hash=False,
                num_readers=self.num_readers,
                encryption=_decryption(encryption_key),
            )
        except Exception as exc:  # tensorizer raises many kinds on a damaged file
            if not isinstance(source, str):
                source.close()  # type: ignore[attr-defined]
            raise self._failure(
                exc, "opening it", f"tensorizer cannot open the file ({type(exc).__name__}: {exc})"
            ) from None
        self.keys = set(self._deserializer.keys())

    def _failure(self, exc: BaseException, doing: str, damaged: str) -> TensorizerManifestError:
        """A decryption failure names the key; a remote transfer that failed is a ``RemoteStorageError``;
        anything else means a damaged file."""
        crypto = _crypto_error(self.path.name, exc) if isinstance(exc, Exception) else None
        if crypto is not None:
            return crypto  # type: ignore[return-value]
        if isinstance(self.path, RemoteFile):
            typed = transfer_error(exc, str(self.path), doing)
            if typed is not None:
                return typed
        return IntegrityError(f"{self.path.name}: {damaged}")

    def index(self) -> dict[str, IndexEntry]:
        """tensorizer's index of the file as parsed when the reader opened it: ``read_index`` without a second parse."""
        return _index_of(self._deserializer)

    def read(self, key: str) -> torch.Tensor:
        if key not in self.keys:
            raise IntegrityError(f"{self.path.name}: tensor {key!r} named in the manifest is not in the file")
        try:
            tensor = self._deserializer[key]
        except Exception as exc:  # tensorizer raises many kinds on a damaged file
            raise self._failure(
                exc,
                f"reading {key!r}",
                f"tensor {key!r} cannot be read ({type(exc).__name__}: {exc}); the file is damaged",
            ) from None
        self._forget(key)
        return tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor

    def _forget(self, key: str) -> None:
        """Drop tensorizer's own reference to a tensor once it is handed out: the caller's is then the only one.

        A lazy ``TensorDeserializer`` keeps every tensor it read in a private
        cache for as long as it lives, so a raw layer's pre-step weights would
        outlive vLLM's post-load step, which replaces them: the load held both
        forms of every raw layer (on CPU, 0.8 GB more peak memory on the 1 GB
        model, and oneDNN's packing could never reuse the freed pages; on
        accelerators, device memory). Without that cache (another tensorizer),
        nothing is dropped, one warning says so, and loading still works
        (``tensorizer_names.forget_cached``).
        """
        tensorizer_names.forget_cached(self._deserializer, key)

    def stream(self, keys: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stored tensor as ``(key, tensor)``, in file order, while the readers go on reading.

        With ``keys``, only those: tensorizer's readers seek past the others' bytes instead of reading them
        (a layer's other form), and a reader whose span holds none of them never starts.
        """
        wanted = None if keys is None else frozenset(keys)
        filter_func = None if wanted is None else wanted.__contains__
        try:
            for _, _, key, tensor in self._deserializer.read_tensors(filter_func=filter_func):
                self._forget(str(key))
                yield str(key), (tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor)
        except Exception as exc:  # tensorizer raises many kinds on a damaged file
            raise self._failure(
                exc, "reading tensors", f"the file cannot be read ({type(exc).__name__}: {exc}); the file is damaged"
            ) from None

    def close(self) -> None:
        self._deserializer.close()

    def __enter__(self) -> TensorFileReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def torch_dtype_name(tensorizer_dtype: str) -> str:
    if "torch." in tensorizer_dtype:
        return tensorizer_dtype.rsplit("torch.", 1)[1]
    import numpy as np

    return str(np.dtype(tensorizer_dtype))


#: tensorizer refuses to open an encrypted file without decryption parameters, even to read its plain index;
#: no data is read here, so any key of the right length does (it is never used to decrypt).
_INDEX_ONLY_KEY = bytes(32)


def read_index(path: Path | RemoteFile, encrypted: bool = False) -> dict[str, IndexEntry]:
    """tensorizer's index of a file, by tensor name. Reads no tensor data, so needs no key when ``encrypted``."""
    encryption = tensorizer_names.DecryptionParams.from_key(_INDEX_ONLY_KEY) if encrypted else None
    name = path.name if isinstance(path, RemoteFile) else Path(path).name
    stream = path.open() if isinstance(path, RemoteFile) else None
    try:
        deserializer = tensorizer_names.TensorDeserializer(
            stream if stream is not None else str(path),
            device="cpu",
            lazy_load=True,
            verify_hash=False,
            encryption=encryption,
            **({"num_readers": 1} if stream is not None else {}),
        )
    except Exception as exc:
        if stream is not None:
            stream.close()
        crypto = _crypto_error(name, exc)
        if isinstance(crypto, ConfigurationError):  # the file is encrypted, and its manifest says it is not
            raise IntegrityError(f"{name}: the tensor file is encrypted, its manifest says it is not") from None
        if crypto is not None:
            raise crypto from None
        if stream is not None:
            typed = transfer_error(exc, str(path), "reading its index")
            if typed is not None:
                raise typed from None
        raise
    try:
        return _index_of(deserializer)
    finally:
        deserializer.close()


def _index_of(deserializer) -> dict[str, IndexEntry]:
    """The index an open ``TensorDeserializer`` parsed (a private name of tensorizer's:
    ``tensorizer_names.tensor_index``, a typed error where this tensorizer keeps it elsewhere).
    """
    index = {}
    for key, entry in tensorizer_names.tensor_index(deserializer).items():
        name = key if isinstance(key, str) else ".".join(entry.name)
        index[name] = IndexEntry(
            torch_dtype_name(entry.dtype),
            list(entry.shape),
            int(entry.data_offset),
            int(entry.data_length),
            int(entry.offset),
        )
    return index


def head_hash(path: Path | RemoteFile, index: dict[str, IndexEntry] | None = None) -> str:
    """blake3 of every byte of the file that is not tensor data.

    That is tensorizer's file header, its index and each tensor's own header
    (names, dtypes, shapes, offsets, tensorizer's checksums): a few KiB per
    tensor, so checking it costs little, and with the content hashes it covers
    every byte of the file. It binds the manifest to this exact file.
    """
    if index is None:
        index = read_index(path)
    size = path.size() if isinstance(path, RemoteFile) else path.stat().st_size
    # Clamped: a damaged index may claim offsets past the end (reported elsewhere); never seek there.
    spans = sorted(
        (min(max(e.data_offset, 0), size), min(max(e.data_offset + e.data_length, 0), size)) for e in index.values()
    )
    if isinstance(path, RemoteFile):
        return _remote_head_hash(path, spans, size)
    h = blake3.blake3()
    position = 0
    with open(path, "rb") as f:
        for start, end in [*spans, (size, size)]:
            f.seek(position)
            remaining = max(0, start - position)
            while remaining:
                chunk = f.read(min(remaining, _CHUNK))
                if not chunk:
                    break
                h.update(chunk)
                remaining -= len(chunk)
            position = max(position, end)
    return "blake3:" + h.hexdigest()


def prefix_size(index: dict[str, IndexEntry], file_size: int) -> int:
    """Bytes before the first tensor's own header: tensorizer's file header and index.

    Everything ``TensorDeserializer`` reads when it opens a file lies there (its
    magic, version, counts, the index's length and the index), so a check of
    these bytes with plain reads vouches for what tensorizer will parse.
    """
    return min((e.header_offset for e in index.values()), default=file_size)


def _keep_ranges(spans: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The parts of the file that are not tensor data, in order."""
    keep, position = [], 0
    for start, end in [*spans, (size, size)]:
        if start > position:
            keep.append((position, start))
        position = max(position, end)
    return keep


def read_through_budget(file_size: int) -> int:
    """Bytes of tensor data a remote check may read through (and throw away) to save requests: 1% of the file,
    at least 1 MiB. The checks then fetch the file's non-data bytes plus at most this, so a load is one full
    read of the file and a bounded remainder, however small its tensors are."""
    return max(_READ_THROUGH_MIN, file_size // 100)


def request_groups(ranges: list[tuple[int, int]], budget: int | None = None) -> list[list[tuple[int, int]]]:
    """Sorted ranges as ranged requests: one per run, reading through gaps shorter than ``_REMOTE_MERGE``
    while the gaps read through add up to at most ``budget`` bytes (no limit when None)."""
    requests: list[list[tuple[int, int]]] = []
    spent = 0
    for begin, end in ranges:
        gap = begin - requests[-1][-1][1] if requests else None
        if gap is not None and gap < _REMOTE_MERGE and (budget is None or spent + max(gap, 0) <= budget):
            spent += max(gap, 0)
            requests[-1].append((begin, end))
        else:
            requests.append([(begin, end)])
    return requests


def _remote_head_hash(path: RemoteFile, spans: list[tuple[int, int]], size: int) -> str:
    """``head_hash`` with ranged requests: one per run of header bytes, reading through short tensor data."""
    h = blake3.blake3()
    for group in request_groups(_keep_ranges(spans, size), read_through_budget(size)):
        position = group[0][0]
        wanted = iter(group)
        current: tuple[int, int] | None = next(wanted)
        for chunk in path.read_range(group[0][0], group[-1][1]):
            offset = 0
            while offset < len(chunk) and current is not None:
                absolute = position + offset
                if absolute < current[0]:
                    offset = min(len(chunk), current[0] - position)
                    continue
                take = min(len(chunk) - offset, current[1] - absolute)
                h.update(chunk[offset : offset + take])
                offset += take
                if position + offset >= current[1]:
                    current = next(wanted, None)
            position += len(chunk)
    return "blake3:" + h.hexdigest()


def prefix_hash(path: Path | RemoteFile, length: int) -> str:
    """blake3 of the first ``length`` bytes, read in bounded chunks: never more than ``length`` bytes, no tensorizer.

    The caller caps ``length`` at the file's size; a file shorter than that hashes what it has.
    """
    h = blake3.blake3()
    if isinstance(path, RemoteFile):
        for chunk in path.read_range(0, length):
            h.update(chunk)
        return "blake3:" + h.hexdigest()
    remaining = length
    with open(path, "rb") as f:
        while remaining > 0:
            chunk = f.read(min(remaining, _CHUNK))
            if not chunk:
                break
            h.update(chunk)
            remaining -= len(chunk)
    return "blake3:" + h.hexdigest()
