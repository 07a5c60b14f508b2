"""A base by reference: the source's safetensors files named at the save, checked and read at load."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tensorizer_manifest.errors import CheckpointNotFoundError, ConfigurationError, IntegrityError
from tensorizer_manifest.storage.source_files import SourceFilesReader, source_files_of


@pytest.fixture
def source(tmp_path):
    generator = torch.Generator().manual_seed(0)
    first = {"a.weight": torch.randn(4, 3, generator=generator), "b.weight": torch.randn(2, generator=generator)}
    second = {"c.weight": torch.randn(3, 3, generator=generator).to(torch.bfloat16)}
    save_file(first, tmp_path / "model-00001-of-00002.safetensors")
    save_file(second, tmp_path / "model-00002-of-00002.safetensors")
    return tmp_path, {**first, **second}


def test_each_tensor_is_named_in_its_file_and_read_back_as_it_was(source):
    folder, tensors = source
    named = source_files_of(folder, ["c.weight", "a.weight", "b.weight"])
    assert named.root == str(folder.resolve())
    assert {f.name: f.tensors for f in named.files} == {
        "model-00002-of-00002.safetensors": ["c.weight"],
        "model-00001-of-00002.safetensors": ["a.weight", "b.weight"],
    }
    assert all(f.size == (folder / f.name).stat().st_size for f in named.files)
    with SourceFilesReader(named) as reader:
        read = dict(reader.stream(["b.weight", "c.weight"]))
    assert list(read) == ["b.weight", "c.weight"]
    assert all(torch.equal(read[name], tensors[name]) for name in read)
    assert read["c.weight"].dtype == torch.bfloat16


def test_a_source_that_cannot_be_named_is_refused_at_the_save(source, tmp_path_factory):
    folder, _ = source
    with pytest.raises(ConfigurationError, match=r"1 tensor\(s\) that no safetensors file there holds.*--base inside"):
        source_files_of(folder, ["a.weight", "lm_head.weight"])
    with pytest.raises(ConfigurationError, match="no \\*.safetensors files"):
        source_files_of(tmp_path_factory.mktemp("empty"), ["a.weight"])


def test_a_missing_or_changed_source_file_is_refused_before_a_tensor_is_read(source, tmp_path_factory):
    folder, tensors = source
    named = source_files_of(folder, ["a.weight", "b.weight", "c.weight"])
    moved = tmp_path_factory.mktemp("moved")
    for f in named.files:
        (folder / f.name).rename(moved / f.name)
    with pytest.raises(CheckpointNotFoundError, match="put the source back, or name where it is now.*base_source_dir"):
        SourceFilesReader(named)
    with SourceFilesReader(named, moved) as reader:  # named where it is now
        assert torch.equal(dict(reader.stream(["a.weight"]))["a.weight"], tensors["a.weight"])
    save_file({"a.weight": torch.zeros(4, 4)}, moved / "model-00001-of-00002.safetensors")  # rewritten: its size
    with pytest.raises(IntegrityError, match=r"has changed \(\d+ bytes, \d+ at the save\): nothing was served"):
        SourceFilesReader(named, moved)
