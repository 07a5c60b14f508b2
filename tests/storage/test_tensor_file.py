"""The tensor file through tensorizer: round trip, the index, the head hash, the reader."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from tensorizer_manifest.errors import IntegrityError
from tensorizer_manifest.live_model.tensors import hash_tensor
from tensorizer_manifest.storage.tensor_file import (
    TensorFileReader,
    head_hash,
    prefix_hash,
    prefix_size,
    read_index,
    write_tensor_file,
)

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


def _live_tensors_at(pointers: set[int]) -> list[torch.Tensor]:
    gc.collect()
    live = (o for o in gc.get_objects() if issubclass(type(o), torch.Tensor))  # type(): no proxy's __class__
    return [t for t in live if t.numel() and t.data_ptr() in pointers]


def _still_alive_after_a_moment(pointers: set[int], seconds: float = 2.0) -> int:
    """How many tensors at ``pointers`` are alive once tensorizer's copy threads had time to return.

    A copy thread holds the last tensor it read in its frame until its function
    returns, a moment after the caller got it (on a busy machine, after the
    caller's first look: seen in about 1 run in 6). A reference kept for the
    reader's lifetime, as tensorizer's cache kept every one, never goes away.
    """
    deadline = time.monotonic() + seconds
    while (alive := len(_live_tensors_at(pointers))) and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive


@pytest.mark.parametrize("how", ["stream", "read"])
def test_a_tensor_handed_out_lives_only_as_long_as_the_caller_holds_it(tensor_path, how):
    # vLLM's post-load step replaces a raw layer's weights: the reader must not keep the old ones alive.
    with TensorFileReader(tensor_path, num_readers=2) as reader:
        if how == "stream":
            pointers = {tensor.data_ptr() for _, tensor in reader.stream()}
        else:
            pointers = {reader.read(key).data_ptr() for key in sorted(TENSORS)}
        assert len(pointers) == len(TENSORS)
        assert _still_alive_after_a_moment(pointers) == 0


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

    from tensorizer_manifest.storage import tensor_file
    from tensorizer_manifest.storage.remote import RemoteFile

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
    from tensorizer_manifest.storage.remote import RemoteFile

    path = tmp_path / "big.tensors"
    write_tensor_file(path, [(f"t{i}", torch.full((256, 256), i, dtype=torch.float32)) for i in range(8)])
    index = read_index(path)
    cut = prefix_size(index, path.stat().st_size) + 600_000
    with RangeHTTPServer(tmp_path, cut_after=cut) as server:
        with pytest.raises(RemoteStorageError, match="cut short|closed the connection"):
            with TensorFileReader(RemoteFile(f"{server.url}/{path.name}"), num_readers=1) as reader:
                for _ in reader.stream():
                    pass


# --- tensorizer's encryption ----------------------------------------------------------------------


def _key(fill: bytes = b"k"):
    from tensorizer_manifest.format.schema import EncryptionKey

    return EncryptionKey(fill * 32)


def test_an_encrypted_file_holds_no_plaintext_bytes_and_reads_back_with_its_key(tmp_path):
    from tensorizer_manifest.errors import ConfigurationError

    row = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)  # an embedding
    tensors = {**TENSORS, "embed": row}
    before = row.clone()
    plain, secret = tmp_path / "plain.tensors", tmp_path / "secret.tensors"
    write_tensor_file(plain, tensors.items())
    written: list[tuple[str, int]] = []
    write_tensor_file(secret, tensors.items(), _key(), on_written=lambda k, n: written.append((k, n)))
    assert written == [(k, t.numel() * t.element_size()) for k, t in tensors.items()]
    assert torch.equal(row, before)  # tensorizer encrypts in place: never the caller's tensor
    run = row[7].view(torch.uint8).numpy().tobytes()[:64]  # 64 bytes of one embedding row
    assert run in plain.read_bytes()  # the control
    assert run not in secret.read_bytes()
    with TensorFileReader(secret, encryption_key=_key()) as reader:
        got = dict(reader.stream())
    assert set(got) == set(tensors) and all(torch.equal(got[k], t) for k, t in tensors.items())
    with pytest.raises(ConfigurationError, match="encrypted; pass its key file"):
        TensorFileReader(secret)
    with pytest.raises(IntegrityError, match="decryption failed: the encryption key is not the one"):
        with TensorFileReader(secret, encryption_key=_key(b"j")) as reader:
            list(reader.stream())
    with pytest.raises(IntegrityError, match="not encrypted"):
        TensorFileReader(plain, encryption_key=_key())


def test_headers_and_index_of_an_encrypted_file_stay_plain_so_prefix_and_head_hash_work(tmp_path):
    """tensorizer encrypts tensor data only: the index is read without the key, and the prefix and head
    hash cover the same parts (the head hash also covers the nonces and MACs in the tensor headers)."""
    secret = tmp_path / "secret.tensors"
    write_tensor_file(secret, TENSORS.items(), _key())
    with pytest.raises(IntegrityError, match="encrypted, its manifest says it is not"):
        read_index(secret)
    index = read_index(secret, encrypted=True)
    assert {k: (e.dtype, e.shape) for k, e in index.items()} == {
        k: (str(t.dtype).removeprefix("torch."), list(t.shape)) for k, t in TENSORS.items()
    }
    size = secret.stat().st_size
    assert 0 < prefix_size(index, size) < min(e.data_offset for e in index.values())
    head = head_hash(secret, index)
    assert prefix_hash(secret, prefix_size(index, size)).startswith("blake3:")
    data = bytearray(secret.read_bytes())
    entry = index["a"]
    data[entry.data_offset] ^= 1  # a ciphertext byte: not in the head hash, caught by tensorizer's MAC
    secret.write_bytes(bytes(data))
    assert head_hash(secret, index) == head
    with pytest.raises(IntegrityError, match="decryption failed"):
        with TensorFileReader(secret, encryption_key=_key()) as reader:
            list(reader.stream())


def _bytes_read_by_this_process() -> int:
    """``rchar`` of /proc/self/io: every byte this process's read calls returned, from disk or page cache."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.parametrize("num_readers", [1, 2])
def test_a_stream_of_some_keys_seeks_past_the_others_bytes(tmp_path, num_readers):
    """A layer's other form is skipped in the file, not read and dropped: the process reads a fraction of it."""
    from tensorizer_manifest.storage.tensor_file import TensorFileReader, write_tensor_file

    big = 32 << 20
    tensors = [("a", torch.arange(1024, dtype=torch.float32)), ("other:a", torch.ones(big // 4, dtype=torch.float32)),
               ("b", torch.arange(2048, dtype=torch.int32))]  # fmt: skip
    path = tmp_path / "t.tensors"
    write_tensor_file(path, iter(tensors))
    with TensorFileReader(path, num_readers=num_readers) as reader:
        before = _bytes_read_by_this_process()
        got = dict(reader.stream(keys=["a", "b"]))
        read = _bytes_read_by_this_process() - before
    assert sorted(got) == ["a", "b"] and torch.equal(got["b"], tensors[2][1])
    assert read < big // 8, f"{read} bytes read for 12 KB of wanted tensors beside 32 MB of others"
    with TensorFileReader(path, num_readers=num_readers) as reader:
        before = _bytes_read_by_this_process()
        assert len(dict(reader.stream())) == 3
        assert _bytes_read_by_this_process() - before >= big  # the measure sees a full read
