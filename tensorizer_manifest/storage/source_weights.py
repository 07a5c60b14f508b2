"""The source model's safetensors, read for a save without mapping the files.

vLLM's default loader reads safetensors through ``mmap``: every page of the
file it has touched counts in the process's resident memory until the file is
closed, beside the parameters the tensors are copied into. For a save, which
then snapshots and processes the model, that made vLLM's own load the peak of
the whole save (about twice the model's bytes). ``iter_safetensors`` yields the
same ``(name, tensor)`` pairs in the same order (sorted names, as
``safe_open.keys()``), each read with positional reads into fresh memory that
is freed once vLLM has copied it into its parameter: the peak is the model plus
one tensor.

A file this reader does not understand (a dtype it has no torch type for, a
header it cannot parse) is left to vLLM's own iterator, which raises what it
raises today; a file shorter than its header says is an ``IntegrityError``.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import IntegrityError

#: safetensors dtype names with an exact torch dtype (same bytes, same element size).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
}
#: Largest header safetensors itself accepts (100 MB); a larger length is a damaged file.
_MAX_HEADER = 100_000_000


class UnreadableHeader(ValueError):
    """The header is not one this reader understands; the file goes to vLLM's own reader."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are (absolute offsets) and what they are."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: str | os.PathLike) -> list[TensorEntry]:
    """The tensors of one file, sorted by name, with absolute byte offsets, checked against the file's size."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as file:
        prefix = file.read(8)
        if len(prefix) != 8:
            raise UnreadableHeader(f"{path} is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_HEADER, size - 8):
            raise UnreadableHeader(f"{path} declares a header of {length} bytes")
        try:
            header = json.loads(file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UnreadableHeader(f"{path}: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise UnreadableHeader(f"{path}: header is not a JSON object")
    base = 8 + length
    entries = []
    for name in sorted(header):
        if name == "__metadata__":
            continue
        info = header[name]
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UnreadableHeader(f"{path}: tensor {name!r} has an entry this reader does not know") from exc
        numel = 1
        for n in shape:
            numel *= n
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
            raise UnreadableHeader(f"{path}: tensor {name!r} has inconsistent offsets for its shape")
        if base + end > size:
            raise IntegrityError(
                f"{path} is {size} bytes, but its header places tensor {name!r} at bytes "
                f"[{base + begin}, {base + end}): the file is truncated; download or copy it again"
            )
        entries.append(TensorEntry(name, dtype, shape, base + begin, base + end))
    return entries


def read_tensor(fd: int, entry: TensorEntry) -> torch.Tensor:
    """One tensor's bytes, read with ``pread`` into freshly allocated memory."""
    buffer = torch.empty(entry.end - entry.start, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], entry.start + done)
        if count == 0:
            raise IntegrityError(f"tensor {entry.name!r} ends early: the file shrank while it was read")
        done += count
    return buffer.view(entry.dtype).view(entry.shape)


def shard_order(path: str | os.PathLike) -> list:
    """Sort key for shard files, numbers compared as numbers (``model-2-of-10`` before ``model-10-of-10``).

    vLLM's safetensors iterator reads shards in this order; reading them in the same one keeps the save's
    load identical to vLLM's.
    """
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", os.path.basename(path))]


def iter_safetensors(
    files: Iterable[str | os.PathLike],
    skip: Callable[[str], bool] = lambda name: False,
    fallback: Callable[[str], Iterator[tuple[str, torch.Tensor]]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of ``files`` whose name ``skip`` does not reject.

    ``fallback(file)`` reads a file whose header this reader does not understand
    (vLLM's own iterator, for the save); without one, such a file raises ``UnreadableHeader``.
    """
    for file in sorted(files, key=shard_order):
        try:
            entries = read_header(file)
        except UnreadableHeader:
            if fallback is None:
                raise
            yield from fallback(str(file))
            continue
        fd = os.open(file, os.O_RDONLY)
        try:
            for entry in entries:
                if not skip(entry.name):
                    yield entry.name, read_tensor(fd, entry)
        finally:
            os.close(fd)
