"""The spill file of pre-step tensors: bytes back exactly, hashes as the manifest's, nothing left behind."""

from __future__ import annotations

import os

import pytest
import torch

from tensorizer_manifest._constants import SPILL_DIR_ENV
from tensorizer_manifest.errors import TensorizerManifestError
from tensorizer_manifest.live_model.tensors import hash_tensor
from tensorizer_manifest.storage.spill import SpillFile, spill_dir

TENSORS = [
    torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4),
    torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # non-contiguous: stored row-major
    torch.arange(20, dtype=torch.int32)[5:13].reshape(2, 4),  # storage offset
    torch.tensor([0.0, -0.0, float("nan")], dtype=torch.float16),  # bytes, not values
    torch.tensor(3, dtype=torch.int8),  # zero dimensions
    torch.empty(0, 5, dtype=torch.bfloat16),  # no elements
    torch.tensor([True, False, True]),
]


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def test_tensors_come_back_with_the_same_bytes_dtype_and_shape_and_the_manifest_hash(tmp_path):
    with SpillFile(tmp_path) as spill:
        stored = [spill.put(t) for t in TENSORS]
        assert spill.count == len(TENSORS)
        assert spill.nbytes == sum(t.numel() * t.element_size() for t in TENSORS)
        for original, handle in reversed(list(zip(TENSORS, stored, strict=True))):  # any order
            back = handle.read()
            assert (back.dtype, back.shape) == (original.dtype, original.shape)
            assert back.is_contiguous()
            assert _bytes(back) == _bytes(original)
            assert handle.hash == hash_tensor(original)


def test_a_read_is_fresh_memory_and_the_stored_bytes_outlive_the_original(tmp_path):
    with SpillFile(tmp_path) as spill:
        t = torch.ones(4, 4)
        handle = spill.put(t)
        t.fill_(7.0)  # what the post-load step may do to a live tensor
        first = handle.read()
        first.fill_(9.0)
        assert torch.equal(handle.read(), torch.ones(4, 4))


def test_reads_and_writes_span_many_chunks(tmp_path, monkeypatch):
    from tensorizer_manifest.storage import spill as spill_module

    monkeypatch.setattr(spill_module, "_CHUNK", 7)
    t = torch.randn(33, 5)
    with SpillFile(tmp_path) as spill:
        spill.put(torch.zeros(3))
        assert torch.equal(spill.put(t).read(), t)


def test_the_file_never_has_a_name_and_is_gone_when_closed(tmp_path):
    spill = SpillFile(tmp_path)
    spill.put(torch.ones(1000))
    assert list(tmp_path.iterdir()) == []  # O_TMPFILE, or unlinked at once
    fd = spill._file.fileno()
    assert os.fstat(fd).st_nlink == 0 and os.fstat(fd).st_size == 4000
    spill.close()
    assert spill.closed
    with pytest.raises(OSError):
        os.fstat(fd)  # the descriptor, and with it the blocks, are released
    assert list(tmp_path.iterdir()) == []


def test_an_error_inside_the_block_still_closes_the_file(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with SpillFile(tmp_path) as spill:
            handle = spill.put(torch.ones(3))
            raise RuntimeError("boom")
    assert spill.closed and list(tmp_path.iterdir()) == []
    with pytest.raises(TensorizerManifestError, match="released"):
        handle.read()
    with pytest.raises(TensorizerManifestError, match="released"):
        spill.put(torch.ones(1))


def test_a_handle_reads_only_from_its_own_file(tmp_path):
    with SpillFile(tmp_path) as a, SpillFile(tmp_path) as b:
        handle = a.put(torch.ones(2))
        with pytest.raises(ValueError, match="another spill file"):
            b.read(handle)


def test_an_unusable_directory_is_a_clear_error(tmp_path):
    with pytest.raises(TensorizerManifestError, match=SPILL_DIR_ENV):
        SpillFile(tmp_path / "missing")


def test_a_failed_write_is_a_clear_error(tmp_path, monkeypatch):
    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with SpillFile(tmp_path) as spill:
        with pytest.raises(TensorizerManifestError, match="No space left"):
            spill.put(torch.ones(3))


def test_the_directory_is_the_argument_then_the_environment_then_the_temp_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(SPILL_DIR_ENV, raising=False)
    import tempfile

    assert spill_dir() == spill_dir(None) == type(tmp_path)(tempfile.gettempdir())
    monkeypatch.setenv(SPILL_DIR_ENV, str(tmp_path / "env"))
    assert spill_dir() == tmp_path / "env"
    assert spill_dir(tmp_path) == tmp_path


def test_reads_into_one_reused_buffer(tmp_path):
    with SpillFile(tmp_path) as spill:
        stored = [spill.put(t) for t in TENSORS]
        buffer = torch.empty(max(s.nbytes for s in stored), dtype=torch.uint8)
        for original, handle in zip(TENSORS, stored, strict=True):
            back = handle.read(buffer)
            assert back.data_ptr() == buffer.data_ptr() or back.numel() == 0
            assert (back.dtype, back.shape) == (original.dtype, original.shape)
            assert _bytes(back) == _bytes(original)
        with pytest.raises(ValueError, match="at least"):
            stored[0].read(torch.empty(1, dtype=torch.uint8))


@pytest.mark.parametrize("chunk", [7, 8 << 20])
def test_same_bytes_compares_bytes_chunk_by_chunk(tmp_path, monkeypatch, chunk):
    from tensorizer_manifest.storage import spill as spill_module

    monkeypatch.setattr(spill_module, "_COMPARE_CHUNK", chunk)
    t = torch.randn(10, 9)
    with SpillFile(tmp_path) as spill:
        handle = spill.put(t)
        assert handle.same_bytes(t.clone())
        assert handle.same_bytes(t.t().contiguous().t())  # another layout, same elements
        other = t.clone()
        other[9, 8] = torch.nextafter(other[9, 8], torch.tensor(float("inf")))  # the very last byte(s)
        assert not handle.same_bytes(other)
        assert not handle.same_bytes(t.to(torch.float64))
        assert not handle.same_bytes(t.reshape(9, 10))
        zeros = spill.put(torch.zeros(3))
        assert not zeros.same_bytes(torch.tensor([0.0, -0.0, 0.0]))  # equal values, other bytes
        assert spill.put(torch.empty(0)).same_bytes(torch.empty(0))


def test_bit_identity_of_tensors_in_memory_sees_every_bit_and_no_more():
    from tensorizer_manifest.storage.spill import same_bytes

    a = torch.tensor([1.0, float("nan"), -0.0])
    assert same_bytes(a, a.clone())  # NaN equals itself bit for bit
    assert not same_bytes(a, torch.tensor([1.0, float("nan"), 0.0]))  # -0.0 is not 0.0
    assert same_bytes(torch.tensor(2.0), torch.tensor(2.0))  # 0-dim
    assert not same_bytes(torch.tensor(2.0), torch.tensor([2.0]))  # shape
    assert not same_bytes(torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float16))
    assert same_bytes(torch.empty(0), torch.empty(0))
    t = torch.arange(6.0).reshape(2, 3)
    assert same_bytes(t.t(), t.t().contiguous())  # the values, whatever the strides
