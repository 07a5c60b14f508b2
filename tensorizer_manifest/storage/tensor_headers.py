"""tensorizer's file header, index and per-tensor headers, parsed with bounded plain reads before tensorizer does.

tensorizer believes the sizes it finds: the index's length (it reads that many bytes), each tensor header's own
length (it allocates that many), and each tensor's data length, dtype and shape (its buffer). A manifest re-made
consistent with a damaged file would let one flipped bit there allocate gigabytes. ``header_problems`` checks every
one of those fields against the manifest's records first, reading at most what the records allow, so that nothing
the loader or ``validate`` allocates is more than the recorded bytes plus a fixed bound (docs/validation.md).
Follows tensorizer 2.10-2.12's format (data versions 1-4); an unknown version is refused.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import blake3

from ..format.schema import TensorRecord
from .checkpoint import TENSORIZER_MAGIC
from .remote import RemoteFile
from .tensor_file import read_through_budget, request_groups, torch_dtype_name

#
# tensorizer believes the sizes it finds: the index's length (it reads that many bytes), each tensor header's own
# length (it allocates that many), and each tensor's data length, dtype and shape (its buffer). Its file header,
# index and tensor headers are never encrypted (only tensor data is), so an encrypted file is checked the same way;
# its tensor headers also hold the crypt info (a nonce and one 16-byte MAC per chunk of data).

#: Magic, data version, feature flags, total size, (unused), tensor count; then the index's length.
_FILE_HEADER = struct.Struct("<5sI32sQ8xQQ")
#: Data versions tensorizer 2.10-2.12 reads; 3 is always encrypted, 4 says so in its feature flags.
_DATA_VERSIONS = (1, 2, 3, 4)
#: An index entry beyond its name, dtype and dims: the lengths, the tensor type, header and data offsets, data length.
_INDEX_ENTRY_FIXED = 2 + 1 + 1 + 1 + 3 * 8
#: What tensorizer's index may hold past its entries: its writer reserves 256 KiB and zero-fills what is unused.
_INDEX_SLACK = 1 << 20
#: A tensor header beyond its name and dims: lengths, module index, tensor type, a dtype name (at most 255 bytes),
#: its checksums, the crypt info's fixed part. Its MACs come on top (``_header_limit``).
_HEADER_SLACK = 4 << 10
#: tensorizer's smallest encryption chunk, and the MAC each chunk has in the tensor header.
_MIN_CRYPT_CHUNK, _MAC_BYTES = 1024, 16
#: Bytes after the last tensor's data read along with the tensor headers (tensorizer writes a few); more are hashed
#: a chunk at a time.
_TAIL_IN_ONE_READ = 1 << 20
#: What every header problem ends with: what it means, and what to do.
_DAMAGED = "the tensor file is damaged or is not the one this manifest was saved with: restore it, or re-save"


class IndexedTensor(NamedTuple):
    """One entry of tensorizer's index, as ``read_layout`` parses it with plain reads."""

    name: bytes
    dtype: bytes
    """tensorizer's own dtype string (``<f4``, ``<V2\\x00torch.bfloat16``)."""
    shape: tuple[int, ...]
    header_offset: int
    data_offset: int
    data_length: int


class FileLayout(NamedTuple):
    """tensorizer's file header and index, parsed with bounded plain reads (never by tensorizer)."""

    version: int
    encrypted: bool
    tensor_count: int
    index_end: int
    """Where the index ends: where tensorizer expects the first tensor's header."""
    entries: list[IndexedTensor]
    """In index order, which is the order tensorizer reads the file in."""


class LayoutError(ValueError):
    """tensorizer's file header or index cannot be parsed within the bounds given."""


#: Ranged requests of one pass in flight at once: each is latency (a request per run of tensor headers, hundreds
#: on a large model), and what each holds is its spans' bytes and one transfer chunk.
_CONCURRENT_REQUESTS = 8


def _read_spans(path: Path | RemoteFile, spans: list[tuple[int, int]], size: int) -> Iterator[bytes]:
    """The bytes of each ``(begin, end)`` span, in order (sorted, disjoint, each small): what it holds at once is
    one span (and, remotely, the spans of the requests in flight and one transfer chunk each). A span past the end
    of the file comes back short. Remotely, spans share a ranged request when the data between them fits
    ``read_through_budget`` (of a ``size`` file), and up to ``_CONCURRENT_REQUESTS`` requests run at once."""
    if not isinstance(path, RemoteFile):
        with open(path, "rb") as f:
            for begin, end in spans:
                f.seek(begin)
                yield f.read(max(0, end - begin))
        return
    groups = request_groups(spans, read_through_budget(size))
    if len(groups) == 1:
        yield from _group_pieces(path, groups[0])
        return
    with ThreadPoolExecutor(min(_CONCURRENT_REQUESTS, len(groups)), thread_name_prefix="tm-headers") as pool:
        for pieces in pool.map(lambda group: list(_group_pieces(path, group)), groups):
            yield from pieces


def _group_pieces(path: RemoteFile, group: list[tuple[int, int]]) -> Iterator[bytes]:
    """Each span's bytes from one ranged request over the group (the data between them read and dropped)."""
    if group[-1][1] <= group[0][0]:  # nothing to read: read_range would yield no chunk
        yield from (b"" for _ in group)
        return
    pending = iter(group)
    begin, end = next(pending)
    piece, position = bytearray(), group[0][0]
    for chunk in path.read_range(group[0][0], group[-1][1]):
        chunk_end = position + len(chunk)
        while True:
            piece += chunk[max(begin - position, 0) : max(min(end, chunk_end) - position, 0)]
            if end > chunk_end:
                break
            yield bytes(piece)
            piece.clear()
            begin, end = next(pending, (chunk_end + 1, chunk_end + 1))
            if begin > chunk_end:
                break
        position = chunk_end


def _read_chunks(path: Path | RemoteFile, begin: int, end: int) -> Iterator[bytes]:
    """Bytes ``begin`` to ``end`` a chunk at a time (a span too long to hold at once)."""
    if isinstance(path, RemoteFile):
        yield from path.read_range(begin, end)
        return
    with open(path, "rb") as f:
        f.seek(begin)
        while begin < end and (chunk := f.read(min(end - begin, _TAIL_IN_ONE_READ))):
            begin += len(chunk)
            yield chunk


def _read_one(path: Path | RemoteFile, begin: int, end: int, size: int) -> bytes:
    (data,) = _read_spans(path, [(begin, min(end, size))], size)
    return data


def read_layout(
    path: Path | RemoteFile, size: int, index_limit: int, prefix_size: int | None = None
) -> tuple[FileLayout, bytes]:
    """tensorizer's file header and index (the file has ``size`` bytes), reading at most ``index_limit`` index
    bytes plus tensorizer's slack; with the bytes they take (the file's prefix, up to ``index_end``).

    With the manifest's ``prefix_size`` (within those bounds), the prefix is one read. An index longer than
    the bounds (or a file header that is not tensorizer's, or an index cut short) is a ``LayoutError``:
    nothing past the limit is read.
    """
    bound = _FILE_HEADER.size + index_limit + _INDEX_SLACK
    first = prefix_size if prefix_size is not None and _FILE_HEADER.size <= prefix_size <= bound else 0
    head = _read_one(path, 0, max(first, _FILE_HEADER.size), size)
    if len(head) < _FILE_HEADER.size:
        raise LayoutError(f"the file has {len(head)} bytes, fewer than tensorizer's file header")
    magic, version, flags, _, count, index_length = _FILE_HEADER.unpack_from(head)
    if magic != TENSORIZER_MAGIC:
        raise LayoutError("it is not a tensorizer file (its first bytes are not tensorizer's magic)")
    if version not in _DATA_VERSIONS:
        raise LayoutError(f"tensorizer data version {version}, not one of {list(_DATA_VERSIONS)}")
    if index_length > index_limit + _INDEX_SLACK:
        raise LayoutError(
            f"tensorizer's index claims {index_length} bytes, the manifest's records need at most {index_limit}"
        )
    index_end = _FILE_HEADER.size + index_length
    if len(head) < index_end:
        head += _read_one(path, len(head), index_end, size)
    raw = head[_FILE_HEADER.size : index_end]
    fields = _Fields(raw[:index_limit], "tensorizer's index")
    entries = []
    for _ in range(min(count, len(raw) // _INDEX_ENTRY_FIXED)):  # a count past what the bytes hold is cut short below
        name = fields.sized("<H")
        fields.unpack("<B")  # tensor type
        dtype = fields.sized("<B")
        (ndim,) = fields.unpack("<B")
        shape = fields.unpack(f"<{ndim}I")
        entries.append(IndexedTensor(name, dtype, shape, *fields.unpack("<QQQ")))
    if len(entries) < count:
        raise LayoutError(f"tensorizer's file header counts {count} tensors, its index holds {len(entries)}")
    encrypted = version == 3 or (version >= 4 and bool(int.from_bytes(flags, "little") & 1))
    return FileLayout(version, encrypted, count, index_end, entries), bytes(head[:index_end])


class _Fields:
    """tensorizer's fields read in order from bytes; one cut short is a ``LayoutError`` naming where."""

    def __init__(self, data: bytes, where: str):
        self.data, self.at, self.where = data, 0, where

    def unpack(self, fmt: str) -> tuple:
        try:
            values = struct.unpack_from(fmt, self.data, self.at)
        except struct.error:
            raise LayoutError(f"{self.where} is cut short at byte {self.at}") from None
        self.at += struct.calcsize(fmt)
        return values

    def sized(self, length_fmt: str) -> bytes:
        """A length, then that many bytes."""
        (length,) = self.unpack(length_fmt)
        if self.at + length > len(self.data):
            raise LayoutError(f"{self.where} is cut short: a {length} byte field at byte {self.at}")
        self.at += length
        return self.data[self.at - length : self.at]


def _index_limit(records: Mapping[str, TensorRecord]) -> int:
    """The most index bytes the records' entries can take (a dtype string is at most 255 bytes)."""
    return sum(_INDEX_ENTRY_FIXED + len(key.encode()) + 255 + 4 * len(r.shape) for key, r in records.items())


def _header_limit(key: str, record: TensorRecord, encrypted: bool) -> int:
    """The most bytes a tensor header for this record can take: its MACs (one per chunk, chunks of at least 1 KiB)."""
    macs = -(-record.nbytes // _MIN_CRYPT_CHUNK) * _MAC_BYTES if encrypted else 0
    return _HEADER_SLACK + len(key.encode()) + 4 * len(record.shape) + macs


def _dtype_name(tensorizer_dtype: bytes) -> str | None:
    try:
        return torch_dtype_name(tensorizer_dtype.decode())
    except Exception:  # numpy refuses a damaged dtype string in many ways
        return None


def _key_of(name: bytes) -> str:
    return name.decode("utf-8", "backslashreplace")


class HeaderScan(NamedTuple):
    """What one pass of plain reads over a file's non-data bytes found, before tensorizer parses any of it."""

    problems: list[str]
    """Each size field tensorizer would believe that does not match the records; empty when all do."""
    prefix_hash: str | None
    """blake3 of the file's first ``prefix_size`` bytes, when they were read in the pass (None otherwise)."""
    head_hash: str | None
    """``tensor_file.head_hash`` of the file, from the same bytes, when there were no problems."""
    data_spans: dict[str, tuple[int, int]]
    """Each tensor's data offset and length as the pass found them: the head hash holds for this layout."""


def header_problems(
    path: Path | RemoteFile,
    records: Mapping[str, TensorRecord],
    *,
    size: int,
    encrypted: bool,
    prefix_size: int | None = None,
) -> list[str]:
    """``scan_headers``'s problems alone."""
    return scan_headers(path, records, size=size, encrypted=encrypted, prefix_size=prefix_size).problems


def scan_headers(
    path: Path | RemoteFile,
    records: Mapping[str, TensorRecord],
    *,
    size: int,
    encrypted: bool,
    prefix_size: int | None = None,
) -> HeaderScan:
    """Every size field tensorizer will believe, against the manifest's ``records`` (by key), before it parses a byte;
    and the file's prefix and head hashes from the same reads, so the checks read each non-data byte once.

    With plain bounded reads: the file header and index (at most what the records' entries can take), then each
    tensor's own header (at most ``_header_limit`` bytes). tensorizer reads the index at open, then each tensor's
    header right after the previous tensor's data, allocates what the header says it holds and a buffer of the
    index's data length; so the index's length must fit the records, each entry must name a record with its dtype,
    shape and byte length, the headers must follow each other as tensorizer reads them, and each header must
    repeat its entry. Then nothing tensorizer allocates is more than the recorded bytes and a small bound.
    One message per mismatch; the first layout fault stops the check (what follows cannot be located).
    """
    try:
        layout, prefix = read_layout(path, size, _index_limit(records), prefix_size)
    except LayoutError as exc:
        return HeaderScan([f"{exc}: {_DAMAGED}"], None, None, {})
    prefix_digest = None
    if prefix_size is not None and prefix_size <= len(prefix):
        prefix_digest = "blake3:" + blake3.blake3(prefix[:prefix_size]).hexdigest()

    def failed(problems: list[str]) -> HeaderScan:
        return HeaderScan(problems, prefix_digest, None, {})

    if layout.encrypted != encrypted:
        return failed(
            [
                "the tensor file is encrypted, its manifest says it is not"
                if layout.encrypted
                else f"the tensor file is not encrypted, its manifest says it is: {_DAMAGED}"
            ]
        )
    problems = []
    if prefix_size is not None and prefix_size != layout.index_end:
        problems.append(
            f"tensorizer's index ends at byte {layout.index_end}, the manifest's prefix_size is {prefix_size}"
        )
    seen: set[str] = set()
    for entry in layout.entries:
        key = _key_of(entry.name)
        record = records.get(key)
        if record is None or key in seen:
            problems.append(
                f"tensor {key!r} is in tensorizer's index {'twice' if key in seen else 'but not in the manifest'}"
            )
            continue
        seen.add(key)
        problems += _entry_mismatches(key, record, "tensorizer's index", entry.dtype, entry.shape, entry.data_length)
    problems += [
        f"tensor {key!r} is in the manifest but not in tensorizer's index" for key in sorted(set(records) - seen)
    ]
    if problems:
        return failed([f"{p}: {_DAMAGED}" for p in problems])
    spans = []
    position = layout.index_end
    for entry in layout.entries:
        key = _key_of(entry.name)
        limit = _header_limit(key, records[key], encrypted)
        if entry.header_offset != position:
            return failed(
                [
                    f"tensor {key!r}: tensorizer's index puts its header at byte {entry.header_offset}, tensorizer "
                    f"reads it at byte {position} (after the index or the previous tensor's data): {_DAMAGED}"
                ]
            )
        header_length = entry.data_offset - entry.header_offset
        if not 0 < header_length <= limit:
            return failed(
                [
                    f"tensor {key!r}: tensorizer's index gives its header {header_length} bytes (from byte "
                    f"{entry.header_offset} to its data), a header for its record has at most {limit}: {_DAMAGED}"
                ]
            )
        position = entry.data_offset + entry.data_length
        if position > size:
            return failed([f"tensor {key!r} ends at byte {position}, past the file's {size} bytes: {_DAMAGED}"])
        spans.append((entry.header_offset, entry.data_offset))
    tail = (position, size)  # tensorizer's few bytes after the last tensor's data
    head = blake3.blake3(prefix)  # every byte that is not tensor data: the prefix, each tensor's header, the tail
    small_tail = size - position <= _TAIL_IN_ONE_READ
    pieces = _read_spans(path, [*spans, tail] if small_tail else spans, size)
    for entry, raw in zip(layout.entries, pieces, strict=False):
        key = _key_of(entry.name)
        head.update(raw)
        problems += _tensor_header_mismatches(key, records[key], entry, raw, encrypted)
    for piece in pieces if small_tail else _read_chunks(path, *tail):
        head.update(piece)
    if problems:
        return failed([f"{p}: {_DAMAGED}" for p in problems])
    data_spans = {_key_of(e.name): (e.data_offset, e.data_length) for e in layout.entries}
    return HeaderScan([], prefix_digest, "blake3:" + head.hexdigest(), data_spans)


def _entry_mismatches(
    key: str, record: TensorRecord, where: str, dtype: bytes, shape: tuple[int, ...], data_length: int
) -> list[str]:
    found: list[tuple[str, object, object]] = [
        ("dtype", _dtype_name(dtype) or repr(dtype.decode("utf-8", "backslashreplace")), record.dtype)
    ]
    found += [("shape", list(shape), record.shape), ("data length", data_length, record.nbytes)]
    return [
        f"tensor {key!r}: {where} says {field} {value}, the manifest records {recorded}"
        for field, value, recorded in found
        if value != recorded
    ]


def _tensor_header_mismatches(
    key: str, record: TensorRecord, entry: IndexedTensor, raw: bytes, encrypted: bool
) -> list[str]:
    """A tensor's own header (exactly the bytes its index entry gives it) against its entry and record."""
    where = f"the tensorizer header of tensor {key!r}"
    fields = _Fields(raw, where)
    try:
        (header_length,) = fields.unpack("<Q")
        if header_length != len(raw):
            return [f"{where} says it has {header_length} bytes, tensorizer's index gives it {len(raw)}"]
        fields.unpack("<HB")  # module index, tensor type
        name = fields.sized("<H")
        dtype = fields.sized("<B")
        (ndim,) = fields.unpack("<B")
        shape = fields.unpack(f"<{ndim}I")
        fields.sized("<H")  # its checksums
        if encrypted:
            fields.sized("<Q")  # its crypt info: nonce, chunk size, MACs
        if fields.at > len(raw) - 8:
            raise LayoutError(f"{where} is cut short: its fields run into its data length")
        (data_length,) = struct.unpack_from("<q", raw, len(raw) - 8)
    except LayoutError as exc:
        return [str(exc)]
    problems = [] if name == entry.name else [f"{where} names {_key_of(name)!r}"]
    if dtype != entry.dtype:
        problems.append(f"{where} says dtype {_dtype_name(dtype)}, tensorizer's index {_dtype_name(entry.dtype)}")
    return problems + _entry_mismatches(key, record, "its tensorizer header", dtype, shape, data_length)
