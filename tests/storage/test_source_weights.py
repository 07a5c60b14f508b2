"""The save's safetensors reader: what safetensors itself reads, in vLLM's order, without mapping the file."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tensorizer_manifest.errors import IntegrityError
from tensorizer_manifest.storage.source_weights import UnreadableHeader, iter_safetensors, read_header, shard_order

TENSORS = {
    "model.layers.0.weight": torch.randn(8, 4).to(torch.bfloat16),
    "a.bias": torch.tensor([0.0, -0.0, float("nan")], dtype=torch.float16),  # bytes, not values
    "b.int": torch.arange(20, dtype=torch.int32).reshape(4, 5),
    "c.scalar": torch.tensor(3, dtype=torch.int8),
    "d.empty": torch.empty(0, 5, dtype=torch.float32),
    "e.mask": torch.tensor([True, False, True]),
    "f.fp8": torch.randn(4, 4).to(torch.float8_e4m3fn),
    "g.long": torch.tensor([2**40, -1], dtype=torch.int64),
    "h.u16": torch.tensor([1, 65535], dtype=torch.uint16),
}


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _safetensors_reads(path) -> list[tuple[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return [(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118


def test_reads_what_safetensors_reads_in_the_same_order(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, str(path), metadata={"format": "pt"})
    expected = _safetensors_reads(path)
    got = list(iter_safetensors([path]))
    assert [name for name, _ in got] == [name for name, _ in expected]
    for (name, ours), (_, theirs) in zip(got, expected, strict=True):
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), name
        assert _bytes(ours) == _bytes(theirs), name


def test_shards_in_vllms_order_and_skipped_names_never_read(tmp_path):
    for n in (10, 2, 1):
        save_file({f"w{n}": torch.full((2,), n, dtype=torch.float32)}, str(tmp_path / f"model-{n}-of-10.safetensors"))
    files = list(tmp_path.iterdir())
    assert [p.name for p in sorted(files, key=shard_order)][:2] == [
        "model-1-of-10.safetensors",
        "model-2-of-10.safetensors",
    ]
    got = list(iter_safetensors(files, skip=lambda name: name == "w2"))
    assert [(name, t.tolist()) for name, t in got] == [("w1", [1.0, 1.0]), ("w10", [10.0, 10.0])]


def test_the_file_is_never_mapped(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(256, 256)}, str(path))

    def mapped() -> bool:
        with open("/proc/self/maps") as maps:
            return str(path) in maps.read()

    with safe_open(str(path), framework="pt") as f:  # the control: safetensors maps it
        f.get_tensor("w")
        control = mapped()
    for _, tensor in iter_safetensors([path]):
        assert not mapped()
        assert tensor.untyped_storage().nbytes() == 256 * 256 * 4  # its own memory, nothing shared
    assert control, "safetensors no longer maps files; this test no longer shows a difference"


def test_a_truncated_file_is_an_integrity_error_naming_the_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(4), "b": torch.zeros(1024)}, str(path))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(IntegrityError, match="truncated") as info:
        list(iter_safetensors([path]))
    assert "'b'" in str(info.value)


def _raw_file(path, header: dict, data: bytes = b"") -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


@pytest.mark.parametrize(
    "header",
    [
        {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}},  # a dtype without a torch twin here
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},  # offsets disagree with the shape
        {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}},
        {"w": "not an entry"},
        ["not", "an", "object"],
    ],
)
def test_headers_this_reader_does_not_know_go_to_the_fallback(tmp_path, header):
    path = tmp_path / "odd.safetensors"
    _raw_file(path, header, b"\0" * 8)
    with pytest.raises(UnreadableHeader):
        read_header(path)
    sentinel = torch.ones(1)
    got = list(iter_safetensors([path], fallback=lambda file: iter([(file, sentinel)])))
    assert got == [(str(path), sentinel)]


def test_a_header_longer_than_the_file_is_not_read(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(UnreadableHeader, match="header of"):
        read_header(path)
