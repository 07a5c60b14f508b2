"""The source observer (for the base): which source tensor filled which module, seen through the weight loaders
(``helpers.sources``' toy model)."""

from __future__ import annotations

import pytest
import torch
from helpers.sources import Toy, source

from tensorizer_manifest.errors import UnsupportedModelError
from tensorizer_manifest.format.generation import Layout
from tensorizer_manifest.live_model.sources import SourceObserver, source_record
from tensorizer_manifest.live_model.tensors import hash_tensor


def test_each_source_tensor_is_recorded_with_the_modules_its_weight_loaders_filled():
    model, observer = Toy(), SourceObserver(Layout(tp=2))
    with observer.watching(model):
        model.load_weights(observer.source(iter(source())))
    seen = observer.observed
    assert [r.name for r in seen.records] == ["proj.a", "rotary.inv_freq", "norm.weight", "proj.b"]
    assert [r.hash for r in seen.records] == [hash_tensor(t) for _, t in source()]
    assert seen.consumers == {"proj.a": ["proj"], "norm.weight": ["norm"], "proj.b": ["proj"]}
    assert seen.loaded == {"proj": ["weight"], "norm": ["weight"]}
    assert seen.layout == Layout(tp=2) and seen.unattributed == []
    assert torch.equal(model.norm.weight, source()[2][1])  # the observed load loads


def test_the_weight_loaders_are_put_back_after_the_load():
    model, observer = Toy(), SourceObserver(Layout())
    bound = model.proj.weight.weight_loader
    with observer.watching(model):
        assert model.proj.weight.weight_loader is not bound
        assert hasattr(model.norm.weight, "weight_loader")  # the default loader, observed
        model.load_weights(observer.source(iter(source())))
    assert model.proj.weight.weight_loader == bound
    assert not hasattr(model.norm.weight, "weight_loader")


def test_a_parameter_filled_after_the_source_is_spent_cannot_be_attributed_and_a_base_of_it_is_refused():
    model, observer = Toy(buffers_everything=True), SourceObserver(Layout())
    with observer.watching(model):
        model.load_weights(observer.source(iter(source())))
    assert sorted(observer.observed.unattributed) == ["norm.weight", "proj.weight", "proj.weight"]
    with pytest.raises(UnsupportedModelError, match="cannot be observed.*--base none"):
        observer.observed.refuse_unattributed()


def test_a_source_record_is_contiguous_under_its_own_name():
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous
    record = source_record("x", tensor)
    assert (record.name, record.key, record.shape, record.stride) == ("x", "x", [4, 3], [3, 1])
    assert record.hash == hash_tensor(tensor.contiguous()) and record.nbytes == 48
