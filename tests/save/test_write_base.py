"""Writing the base: the source read again must be the source the engine loaded, tensor for tensor."""

from __future__ import annotations

import pytest
import torch
from helpers.sources import Toy, source

from tensorizer_manifest.errors import NotReproducibleError
from tensorizer_manifest.format.generation import BASE_DOCUMENT, Layout, decode_base
from tensorizer_manifest.live_model.sources import SourceObserver
from tensorizer_manifest.save.write_base import write_base
from tensorizer_manifest.storage.tensor_file import TensorFileReader


def observed_load():
    model, observer = Toy(), SourceObserver(Layout())
    with observer.watching(model):
        model.load_weights(observer.source(iter(source())))
    return observer.observed


def test_the_base_holds_every_source_tensor_by_name_with_its_consumers(tmp_path):
    name, document = write_base(observed_load(), source(), tmp_path)
    assert name == BASE_DOCUMENT and decode_base((tmp_path / name).read_bytes()) == document
    assert [t.name for t in document.tensors] == [n for n, _ in source()]
    assert document.consumers["proj.b"] == ["proj"] and "rotary.inv_freq" not in document.consumers
    assert document.loaded == {"proj": ["weight"], "norm": ["weight"]}
    with TensorFileReader(tmp_path / document.tensor_file.path) as reader:
        stored = dict(reader.stream())
    for n, tensor in source():
        assert torch.equal(stored[n], tensor), n
    assert document.tensor_file.size == (tmp_path / document.tensor_file.path).stat().st_size


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda s: [(n, t + 1 if n == "norm.weight" else t) for n, t in s], "source tensor 'norm.weight' is not"),
        (lambda s: s[:-1], "the source now has 3 tensors, this engine loaded 4"),
        (lambda s: [*s, ("extra", torch.ones(1))], "source tensor 'extra' is not"),
        (lambda s: [s[1], s[0], *s[2:]], "tensor #0 \\('rotary.inv_freq', the engine loaded 'proj.a'\\)"),
    ],
    ids=["changed", "fewer", "more", "reordered"],
)
def test_a_source_that_changed_since_the_engine_loaded_it_writes_no_base(tmp_path, change, words):
    with pytest.raises(NotReproducibleError, match=words):
        write_base(observed_load(), change(source()), tmp_path)
    assert not (tmp_path / BASE_DOCUMENT).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tensors")]
