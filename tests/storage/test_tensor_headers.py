"""tensorizer's size fields, parsed with bounded plain reads and checked against the records before tensorizer
parses the file (``tensor_headers``); the fuzz suite (``test_validate_fuzz.py``) runs the same checks on damaged
files with their peak memory measured."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tensorizer_manifest.format.schema import EncryptionKey
from tensorizer_manifest.live_model.tensors import make_record
from tensorizer_manifest.storage.tensor_file import head_hash, prefix_hash, prefix_size, read_index, write_tensor_file
from tensorizer_manifest.storage.tensor_headers import LayoutError, header_problems, read_layout, scan_headers

TENSORS = {
    "a": torch.randn(3, 5).to(torch.bfloat16),
    "b": torch.randint(-100, 100, (4, 4), dtype=torch.int8),
    "c": torch.tensor([1.5], dtype=torch.float32),
}


def test_every_size_field_tensorizer_believes_is_checked_against_the_records_plain_or_encrypted(tmp_path):
    """Before tensorizer parses a byte: its index and each tensor's own header (plain in an encrypted file too,
    its crypt info inside) against the records, each mismatch named by tensor and field."""
    records = {k: make_record(k, t, kind="buffer", persistent=True, key=k) for k, t in TENSORS.items()}
    for encrypted in (False, True):
        path = tmp_path / f"encrypted-{encrypted}.tensors"
        write_tensor_file(path, TENSORS.items(), EncryptionKey(b"k" * 32) if encrypted else None)
        size, index = path.stat().st_size, read_index(path, encrypted=encrypted)
        checks = {"size": size, "encrypted": encrypted}
        assert header_problems(path, records, **checks, prefix_size=prefix_size(index, size)) == []
        [problem] = header_problems(path, records, size=size, encrypted=not encrypted)
        assert problem.startswith("the tensor file is " + ("encrypted" if encrypted else "not encrypted"))
        reshaped = {**records, "b": msgspec.structs.replace(records["b"], shape=[16], stride=[1])}
        [problem] = header_problems(path, reshaped, **checks)
        assert problem.startswith("tensor 'b': tensorizer's index says shape [4, 4], the manifest records [16]")
        data = bytearray(path.read_bytes())
        data[index["b"].header_offset + 4] ^= 1  # the header's own length, plus 4 GiB
        path.write_bytes(bytes(data))
        [problem] = header_problems(path, records, **checks)
        assert problem.startswith("the tensorizer header of tensor 'b' says it has 4294967")
        assert problem.endswith("restore it, or re-save")


def test_the_layout_is_read_within_the_limit_and_an_index_claiming_more_is_refused(tmp_path):
    path = tmp_path / "x.tensors"
    write_tensor_file(path, TENSORS.items())
    size = path.stat().st_size
    layout, prefix = read_layout(path, size, index_limit=1 << 16)
    assert prefix == path.read_bytes()[: layout.index_end]
    assert [entry.name for entry in layout.entries] == [k.encode() for k in TENSORS]
    assert layout.index_end == prefix_size(read_index(path), size)
    assert [list(entry.shape) for entry in layout.entries] == [list(t.shape) for t in TENSORS.values()]
    claims = r"tensorizer's index claims \d+ bytes, the manifest's records need at most -2097152"
    with pytest.raises(LayoutError, match=claims):
        read_layout(path, size, index_limit=-(2 << 20))  # any index is longer than that
    (tmp_path / "y.tensors").write_bytes(b"N" * 128)
    with pytest.raises(LayoutError, match="not a tensorizer file"):
        read_layout(tmp_path / "y.tensors", 128, index_limit=1 << 16)
    with pytest.raises(LayoutError, match="the file has 16 bytes, fewer than tensorizer's file header"):
        read_layout(tmp_path / "y.tensors", 16, index_limit=1 << 16)


def test_one_pass_gives_the_prefix_and_head_hashes_the_separate_reads_give_locally_and_over_http(tmp_path):
    """The checks read each non-data byte once: ``scan_headers``'s hashes are ``prefix_hash`` and ``head_hash``
    of the same file (plain and encrypted, local and with ranged reads), and a changed header byte changes
    the head hash it gives."""
    from helpers.servers import RangeHTTPServer

    from tensorizer_manifest.storage.remote import RemoteFile

    records = {k: make_record(k, t, kind="buffer", persistent=True, key=k) for k, t in TENSORS.items()}
    with RangeHTTPServer(tmp_path) as server:
        for encrypted in (False, True):
            path = tmp_path / f"encrypted-{encrypted}.tensors"
            write_tensor_file(path, TENSORS.items(), EncryptionKey(b"k" * 32) if encrypted else None)
            size, index = path.stat().st_size, read_index(path, encrypted=encrypted)
            expected = (prefix_hash(path, prefix_size(index, size)), head_hash(path, index))
            for where in (path, RemoteFile(f"{server.url}/{path.name}")):
                scan = scan_headers(
                    where, records, size=size, encrypted=encrypted, prefix_size=prefix_size(index, size)
                )
                assert (scan.problems, scan.prefix_hash, scan.head_hash) == ([], *expected)
                assert scan.data_spans == {k: (e.data_offset, e.data_length) for k, e in index.items()}
        data = bytearray(path.read_bytes())
        data[index["c"].data_offset - 9] ^= 1  # tensorizer's checksum field in tensor c's header
        path.write_bytes(bytes(data))
        scan = scan_headers(path, records, size=size, encrypted=True, prefix_size=prefix_size(index, size))
        assert scan.problems == [] and scan.prefix_hash == expected[0] and scan.head_hash != expected[1]
        assert scan.head_hash == head_hash(path, index)
