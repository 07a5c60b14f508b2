"""The tensor file through tensorizer: round trip, the index, the head hash, the reader."""

from __future__ import annotations

import pytest
import torch

from tensorizer_manifest.errors import IntegrityError
from tensorizer_manifest.tensor_file import (
    TensorFileReader,
    head_hash,
    prefix_hash,
    prefix_size,
    read_index,
    write_tensor_file,
)
from tensorizer_manifest.tensors import hash_tensor

TENSORS = {
    "a": torch.randn(3, 5).to(torch.bfloat16),
    "b": torch.randint(-100, 100, (4, 4), dtype=torch.int8),
    "c": torch.tensor([1.5], dtype=torch.float32),
    "d": torch.arange(6, dtype=torch.int32),
}


@pytest.fixture
def tensor_path(tmp_path):
    path = tmp_path / "x.tensors"
    write_tensor_file(path, TENSORS.items())
    return path


def test_round_trip_keeps_dtypes_and_bytes(tensor_path):
    with TensorFileReader(tensor_path) as reader:
        assert reader.keys == set(TENSORS)
        for key, tensor in TENSORS.items():
            got = reader.read(key)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor)
            assert hash_tensor(got) == hash_tensor(tensor)


def test_non_contiguous_tensors_are_written_contiguous(tmp_path):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    write_tensor_file(tmp_path / "t.tensors", [("t", t)])
    with TensorFileReader(tmp_path / "t.tensors") as reader:
        assert torch.equal(reader.read("t"), t)


def test_each_tensor_is_written_before_the_next_is_asked_for(tmp_path):
    """The save path hands out views of one reused buffer (``write.stored_tensors``)."""
    buffer = torch.empty(16, dtype=torch.uint8)

    def reused():
        for i in range(3):
            buffer.fill_(i)
            yield f"t{i}", buffer.view(torch.int32)

    write_tensor_file(tmp_path / "r.tensors", reused())
    with TensorFileReader(tmp_path / "r.tensors") as reader:
        for i in range(3):
            assert torch.equal(reader.read(f"t{i}").view(torch.uint8), torch.full((16,), i, dtype=torch.uint8))


def test_index_describes_every_tensor_without_reading_data(tensor_path):
    index = read_index(tensor_path)
    assert set(index) == set(TENSORS)
    size = tensor_path.stat().st_size
    for key, tensor in TENSORS.items():
        entry = index[key]
        assert entry.dtype == str(tensor.dtype).removeprefix("torch.")
        assert entry.shape == list(tensor.shape)
        assert entry.data_length == tensor.numel() * tensor.element_size()
        assert entry.header_offset < entry.data_offset and entry.data_offset + entry.data_length <= size


def test_head_hash_covers_headers_but_not_data(tensor_path):
    before = head_hash(tensor_path)
    entry = read_index(tensor_path)["a"]
    data = bytearray(tensor_path.read_bytes())
    data[entry.data_offset] ^= 0xFF  # tensor data: the content hash's job, not the head hash's
    tensor_path.write_bytes(bytes(data))
    assert head_hash(tensor_path) == before
    data[entry.header_offset + 8] ^= 0xFF  # tensorizer's own per-tensor header
    tensor_path.write_bytes(bytes(data))
    assert head_hash(tensor_path) != before


def test_reader_names_a_missing_key(tensor_path):
    with TensorFileReader(tensor_path) as reader, pytest.raises(IntegrityError, match="'nope' named in the manifest"):
        reader.read("nope")


def test_reader_refuses_a_file_that_is_not_tensorizer(tmp_path):
    path = tmp_path / "garbage.tensors"
    path.write_bytes(b"\0" * 4096)
    with pytest.raises(IntegrityError, match="tensorizer cannot open the file"):
        TensorFileReader(path)


def test_the_prefix_is_all_tensorizer_reads_when_it_opens_a_file(tensor_path, tmp_path):
    """tensorizer's file header and index end before the first tensor's own header: a file cut there still
    opens, so a check of the prefix vouches for everything tensorizer parses before it reads a tensor."""
    index = read_index(tensor_path)
    size = tensor_path.stat().st_size
    prefix = prefix_size(index, size)
    assert 0 < prefix == min(e.header_offset for e in index.values()) < size
    cut = tmp_path / "cut.tensors"
    cut.write_bytes(tensor_path.read_bytes()[:prefix])
    assert read_index(cut) == index


def test_prefix_hash_reads_no_more_than_asked(tensor_path, tmp_path):
    data = tensor_path.read_bytes()
    changed = tmp_path / "changed.tensors"
    changed.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    assert prefix_hash(changed, 100) == prefix_hash(tensor_path, 100) != prefix_hash(changed, 101)
    assert prefix_hash(tensor_path, 10 * len(data)) == prefix_hash(tensor_path, len(data))  # a short file


def test_a_remote_tensor_file_reads_and_hashes_as_the_local_one(tensor_path, monkeypatch):
    """Over HTTP (Range support, 127.0.0.1): the index, the prefix and head hashes with ranged reads (one request,
    and one per header run), and the reader streaming every tensor."""
    from helpers.servers import RangeHTTPServer

    from tensorizer_manifest import tensor_file
    from tensorizer_manifest.remote import RemoteFile

    index = read_index(tensor_path)
    local_head = head_hash(tensor_path, index)
    size = prefix_size(index, tensor_path.stat().st_size)
    with RangeHTTPServer(tensor_path.parent) as server:
        remote = RemoteFile(f"{server.url}/{tensor_path.name}")
        assert read_index(remote) == index
        assert prefix_hash(remote, size) == prefix_hash(tensor_path, size)
        assert head_hash(remote, index) == local_head
        monkeypatch.setattr(tensor_file, "_REMOTE_MERGE", 0)  # one request per run of header bytes
        assert head_hash(remote, index) == local_head
        with TensorFileReader(remote, num_readers=2) as reader:
            got = dict(reader.stream())
        assert set(got) == set(TENSORS)
        for key, tensor in TENSORS.items():
            assert hash_tensor(got[key]) == hash_tensor(tensor)


def test_a_remote_reader_cut_off_mid_file_raises_a_remote_error(tmp_path):
    from helpers.servers import RangeHTTPServer

    from tensorizer_manifest.errors import RemoteStorageError
    from tensorizer_manifest.remote import RemoteFile

    path = tmp_path / "big.tensors"
    write_tensor_file(path, [(f"t{i}", torch.full((256, 256), i, dtype=torch.float32)) for i in range(8)])
    index = read_index(path)
    cut = prefix_size(index, path.stat().st_size) + 600_000
    with RangeHTTPServer(tmp_path, cut_after=cut) as server:
        with pytest.raises(RemoteStorageError, match="cut short|closed the connection"):
            with TensorFileReader(RemoteFile(f"{server.url}/{path.name}"), num_readers=1) as reader:
                for _ in reader.stream():
                    pass
