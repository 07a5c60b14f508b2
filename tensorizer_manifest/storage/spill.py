"""Pre-step tensors kept on disk instead of in memory while a model is saved.

The capture must keep every tensor of a layer with a post-load step as it was
before the step (a raw layer is saved in that form, and the diff compares bytes).
A ``SpillFile`` takes those tensors one at a time, writes their bytes (row-major,
dtype untouched) to a temporary file and gives back a small ``StoredTensor``
handle with the bytes' blake3 hash; ``read`` brings one tensor back into fresh
memory with positional reads (never an mmap, whose pages would count as the
process's memory), so at most one tensor's bytes are held at a time.

Crash safety: the file has no name. On Linux it is created with ``O_TMPFILE``,
elsewhere it is unlinked as soon as it is created (``tempfile.TemporaryFile``),
so it is never visible in the directory and the kernel frees its blocks when it
is closed, when its owner is collected, or when the process dies, ``kill -9``
included.
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import torch

from .._constants import SPILL_DIR_ENV
from ..errors import TensorizerManifestError

#: Bytes written or read per system call.
_CHUNK = 64 << 20
#: Bytes compared at a time when a pre-step copy is compared with a live tensor.
_COMPARE_CHUNK = 8 << 20


def spill_dir(directory: str | os.PathLike | None = None) -> Path:
    """Where pre-step copies go: ``directory``, else ``$TENSORIZER_MANIFEST_SPILL_DIR``, else the temp dir.

    ``save_checkpoint`` sets the variable to the output directory's filesystem
    (for vLLM's worker processes too), so that the copies never land on a
    RAM-backed ``/tmp``.
    """
    return Path(directory or os.environ.get(SPILL_DIR_ENV) or tempfile.gettempdir())


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """One tensor's bytes in a ``SpillFile``: where they are, what they are, their content hash."""

    spill: SpillFile = field(repr=False)
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    hash: str
    """``blake3:<hex>`` of the row-major bytes, as ``tensors.hash_tensor`` computes it."""

    def read(self, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """A contiguous CPU tensor holding the stored bytes (in ``buffer`` when given: see ``SpillFile.read``)."""
        return self.spill.read(self, buffer)

    def same_bytes(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` holds exactly the stored bytes (dtype and shape included)."""
        return self.spill.same_bytes(self, tensor)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: same dtype, shape and row-major bytes (a NaN equals itself, -0.0 is not 0.0), whatever
    the strides. The one comparison of tensors in memory (``StoredTensor.same_bytes`` compares one on disk)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)))


class SpillFile:
    """An append-only, nameless temporary file of tensors; use it as a context manager (or ``close`` it)."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = spill_dir(directory)
        try:
            self._file = tempfile.TemporaryFile(dir=self.directory, prefix=".tensorizer-manifest-spill-")
        except OSError as exc:
            raise TensorizerManifestError(
                f"cannot create the temporary file for pre-step tensors in {self.directory} ({exc}); "
                f"point {SPILL_DIR_ENV} at a writable directory with room for the model"
            ) from None
        self._fd = self._file.fileno()
        self._end = 0
        self._lock = threading.Lock()
        self._scratch: torch.Tensor | None = None
        self.count = 0

    @property
    def nbytes(self) -> int:
        """Bytes written so far."""
        return self._end

    @property
    def closed(self) -> bool:
        return self._file.closed

    def put(self, tensor: torch.Tensor) -> StoredTensor:
        """Append ``tensor``'s elements in row-major order; only a non-contiguous tensor is copied first."""
        self._check_open()
        flat = tensor.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        flat = flat.contiguous()
        nbytes = flat.numel() * flat.element_size()
        view = flat.view(torch.uint8).numpy().data if nbytes else memoryview(b"")
        digest = blake3.blake3(view).hexdigest()
        with self._lock:
            offset = self._end
            self._end += nbytes
        done = 0
        try:
            while done < nbytes:
                done += os.pwrite(self._fd, view[done : done + _CHUNK], offset + done)
        except OSError as exc:
            raise TensorizerManifestError(
                f"cannot write pre-step tensors to a temporary file in {self.directory} ({exc}); "
                f"point {SPILL_DIR_ENV} at a directory with room for the model"
            ) from None
        self.count += 1
        return StoredTensor(self, offset, nbytes, tensor.dtype, tuple(tensor.shape), "blake3:" + digest)

    def read(self, stored: StoredTensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """``stored``'s tensor, contiguous: in fresh memory, or in ``buffer``.

        ``buffer`` is a uint8 tensor of at least ``stored.nbytes`` bytes that the
        caller reuses from one tensor to the next (the result is a view of it), so
        that reading many tensors in turn costs one allocation of the largest.
        """
        if stored.spill is not self:
            raise ValueError("this tensor is stored in another spill file")
        self._check_open()
        if buffer is None:
            out = torch.empty(stored.shape, dtype=stored.dtype)
        else:
            if buffer.dtype != torch.uint8 or not buffer.is_contiguous() or buffer.numel() < stored.nbytes:
                raise ValueError(f"the buffer must be a contiguous uint8 tensor of at least {stored.nbytes} bytes")
            out = buffer.view(-1)[: stored.nbytes].view(stored.dtype).view(stored.shape)
        if stored.nbytes:
            self._read_into(out.view(-1).view(torch.uint8).numpy().data, stored.offset)
        return out

    def same_bytes(self, stored: StoredTensor, tensor: torch.Tensor) -> bool:
        """Compare ``tensor``'s row-major bytes with the stored ones, a chunk at a time (no full read back)."""
        if stored.spill is not self:
            raise ValueError("this tensor is stored in another spill file")
        self._check_open()
        if tensor.dtype != stored.dtype or tuple(tensor.shape) != stored.shape:
            return False
        flat = tensor.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        live = flat.contiguous().view(torch.uint8)
        if self._scratch is None:
            self._scratch = torch.empty(_COMPARE_CHUNK, dtype=torch.uint8)
        for start in range(0, stored.nbytes, _COMPARE_CHUNK):
            n = min(_COMPARE_CHUNK, stored.nbytes - start)
            chunk = self._scratch[:n]
            self._read_into(chunk.numpy().data, stored.offset + start)
            if not torch.equal(chunk, live[start : start + n]):
                return False
        return True

    def _read_into(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done : done + _CHUNK]], offset + done)
            if got <= 0:
                raise TensorizerManifestError(
                    f"the spill file in {self.directory} ended {len(view) - done} bytes early"
                )
            done += got

    def _check_open(self) -> None:
        if self._file.closed:
            raise TensorizerManifestError(
                "the pre-step copies of this capture were released (the spill file is closed); "
                "save with keep_capture=True to save the same engine more than once"
            )

    def close(self) -> None:
        """Free the file's blocks (it has no name, so nothing is left behind)."""
        self._scratch = None
        self._file.close()

    def __enter__(self) -> SpillFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
