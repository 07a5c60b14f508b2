"""Loading from the base: only this rank's layers' tensors are read, checked, and every parameter those
layers took at the save is filled again, or nothing is served (``helpers.sources``' toy model)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from helpers.sources import Stacked, Toy, source

from tensorizer_manifest import _vllm_compat
from tensorizer_manifest.checks.validate import open_checked_base
from tensorizer_manifest.errors import IntegrityError
from tensorizer_manifest.format.generation import BASE_DOCUMENT, Layout
from tensorizer_manifest.format.schema import ModuleRecord
from tensorizer_manifest.live_model.sources import SourceObserver
from tensorizer_manifest.live_model.tensors import make_record
from tensorizer_manifest.load.from_base import feed_layers, load_from_base
from tensorizer_manifest.save.write_base import write_base


class PPMissingLayer(torch.nn.Module):
    """vLLM's stand-in, on a pipeline stage, for a layer another stage holds (matched by its class name)."""


class Config:
    quantization = None


@pytest.fixture
def base(tmp_path):
    model, observer = Toy(), SourceObserver(Layout())
    with observer.watching(model):
        model.load_weights(observer.source(iter(source())))
    _, document = write_base(observer.observed, source(), tmp_path)
    return tmp_path, document


def load(folder, document, model=None, **options):
    model = model or Toy()
    with open_checked_base(document, folder / BASE_DOCUMENT, folder / document.tensor_file.path) as reader:
        return model, load_from_base(model, document, reader, Config(), torch.device("cpu"), **options)


def test_a_model_loaded_from_the_base_holds_the_source(base):
    model, report = load(*base)
    expected = dict(source())
    assert torch.equal(model.proj.weight, torch.cat([expected["proj.a"], expected["proj.b"]]))
    assert torch.equal(model.norm.weight, expected["norm.weight"])
    assert (report["tensors_read"], report["tensors_in_base"]) == (3, 4)  # the rotary table no layer took: not read
    assert report["layers_fed"] == ["norm", "proj"]


def test_a_pipeline_stage_reads_only_its_own_layers_tensors(base):
    stage = Toy()
    stage.norm = PPMissingLayer()
    model, report = load(*base, model=stage)
    assert report["tensors_read"] == 2 and report["layers_fed"] == ["proj"]
    assert report["bytes_read"] == 2 * 2 * 3 * 4


def test_a_damaged_base_tensor_is_refused_naming_it(base):
    folder, document = base
    path = folder / document.tensor_file.path
    data = bytearray(path.read_bytes())
    record = next(t for t in document.tensors if t.name == "norm.weight")
    start = bytes(data).find(dict(source())["norm.weight"].numpy().tobytes())
    assert start > 0 and record.nbytes == 12
    data[start] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="content hash of base tensor 'norm.weight'"):
        load(folder, document)


def test_a_base_that_lacks_a_tensor_a_layer_took_is_refused_naming_both(base):
    folder, document = base
    consumers = {name: paths for name, paths in document.consumers.items() if name != "norm.weight"}
    lacking = msgspec.structs.replace(document, consumers=consumers)
    with pytest.raises(IntegrityError, match="layer 'norm' took weight from the source.*did not fill it"):
        load(folder, lacking)


def test_an_unquantized_parameter_the_base_never_fills_is_refused_as_vllms_loader_refuses_it(base):
    folder, document = base
    grown = Toy()
    grown.extra = torch.nn.Module()
    grown.extra.bias = torch.nn.Parameter(torch.zeros(2), requires_grad=False)  # a newer release's parameter
    with pytest.raises(IntegrityError, match="the base lacks a tensor that layer 'extra' needs .*'bias'"):
        load(folder, document, model=grown)


def test_edited_records_are_refused_before_reading(base):
    folder, document = base
    edited = msgspec.structs.replace(
        document, tensors=[msgspec.structs.replace(t, hash="blake3:" + "0" * 64) for t in document.tensors]
    )
    with pytest.raises(IntegrityError, match="do not match the digest bound to its tensor file"):
        load(folder, edited)


class Deeper(Toy):
    """Another release's model: ``proj``'s parameter one module deeper (as 0.31 keeps a MoE's experts under
    ``experts.routed_experts``), and optionally a ``load_weights`` that never reaches it."""

    def __init__(self, fills_proj: bool = True):
        super().__init__()
        self.proj = torch.nn.Module()
        self.proj.inner = Stacked()
        self.fills_proj = fills_proj

    def load_weights(self, weights):
        params, loaded = dict(self.named_parameters()), set()
        for name, tensor in weights:
            if name in ("proj.a", "proj.b") and self.fills_proj:
                param = params["proj.inner.weight"]
                param.weight_loader(param, tensor, 0 if name.endswith("a") else 1)
                loaded.add("proj.inner.weight")
            elif name == "norm.weight":
                getattr(params[name], "weight_loader", _vllm_compat.default_weight_loader())(params[name], tensor)
                loaded.add(name)
        return loaded


def test_a_parameter_another_release_keeps_one_module_deeper_is_fed_and_checked_there(base):
    model, report = load(*base, model=Deeper())
    expected = dict(source())
    assert torch.equal(model.proj.inner.weight, torch.cat([expected["proj.a"], expected["proj.b"]]))
    assert report["layers_fed"] == ["norm", "proj.inner"]
    with pytest.raises(IntegrityError, match=r"layer 'proj' took inner\.weight from the source.*did not fill it"):
        load(*base, model=Deeper(fills_proj=False))


def test_parameters_vllm_exempts_from_its_own_completeness_check_are_exempt_here_too(base):
    """vLLM's ``track_weights_loading`` skips a module whose quant method has a post-load step (it may build
    them there); the base's check is no stricter than the loader it stands in for."""

    class Method:
        def process_weights_after_loading(self, layer):
            pass

    grown = Toy()
    grown.extra = torch.nn.Module()
    grown.extra.quant_method = Method()
    grown.extra.scale = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    _, report = load(*base, model=grown)
    assert report["layers_fed"] == ["norm", "proj"]


def test_a_tensor_another_rank_reads_is_not_read_here(base):
    """With expert parallelism vLLM's default loader reads only this rank's experts; the base is read the same way
    (``not_this_ranks``, vLLM's own filter in ``_vllm_compat.other_ranks_experts``)."""
    model, report = load(*base, not_this_ranks=lambda name: name == "proj.b")
    assert report["tensors_read"] == 2 and report["bytes_read"] == (2 * 3 + 3) * 4
    assert torch.equal(model.proj.weight[:2], dict(source())["proj.a"]) and not model.proj.weight[2:].any()


def layer_records(model: torch.nn.Module, path: str) -> ModuleRecord:
    """The record a save writes for a layer it leaves to the base: its parameters as the source made them, with
    no key (``schema.held_by_base``)."""
    module = model.get_submodule(path)
    tensors = [
        make_record(name, p, kind="parameter", persistent=True, key=None) for name, p in module.named_parameters()
    ]
    return ModuleRecord(path=path, module_class="Toy", state="raw", replay="post_load", tensors=tensors)


def feed(folder, document, records, model=None, **options):
    model = model or Toy()
    with open_checked_base(document, folder / BASE_DOCUMENT, folder / document.tensor_file.path) as reader:
        return model, feed_layers(model, document, reader, records, **options)


def test_a_form_set_layer_left_to_the_base_is_fed_alone_and_holds_what_was_saved(base):
    """One layer of a form set is fed from the base (the other comes from the form set's own file): only the
    tensors that layer took are read, it holds the source's bytes, the other layer is untouched, no step runs."""
    saved, _ = load(*base)
    model, report = feed(*base, [layer_records(saved, "norm")])
    assert torch.equal(model.norm.weight, saved.norm.weight)
    assert not model.proj.weight.any()  # not fed: the form set restores it
    assert report == {"layers_fed": ["norm"], "base_tensors_read": 1, "base_bytes_read": 12}


def test_a_fed_layer_that_does_not_come_back_as_saved_is_refused_naming_it(base):
    """The save recorded the layer as the saving release's weight loaders made it; a loader that makes something
    else (another release, a loader that leaves a region unwritten) is refused, by content hash, or by form."""
    saved, _ = load(*base)
    record = layer_records(saved, "proj")
    other_bytes = msgspec.structs.replace(record.tensors[0], hash="blake3:" + "0" * 64)
    with pytest.raises(IntegrityError, match=r"layer 'proj' was fed from the base, and its 'weight'.*content hash"):
        feed(*base, [msgspec.structs.replace(record, tensors=[other_bytes])])
    other_form = msgspec.structs.replace(record.tensors[0], shape=[2, 6], stride=[6, 1])
    with pytest.raises(IntegrityError, match=r"layer 'proj' .*its form differs"):
        feed(*base, [msgspec.structs.replace(record, tensors=[other_form])])
    feed(*base, [msgspec.structs.replace(record, tensors=[other_bytes])], verify_hashes=False)  # form only


@pytest.fixture
def by_reference(tmp_path):
    """The toy's source as safetensors files, and a base that names them (``save --base reference``)."""
    from safetensors.torch import save_file

    source_dir, folder = tmp_path / "source", tmp_path / "generation"
    source_dir.mkdir()
    folder.mkdir()
    save_file(dict(source()), source_dir / "model.safetensors")
    model, observer = Toy(), SourceObserver(Layout())
    with observer.watching(model):
        model.load_weights(observer.source(iter(source())))
    _, document = write_base(observer.observed, source(), folder, source_dir=source_dir)
    return folder, document, source_dir


def test_a_base_by_reference_writes_no_tensor_file_and_loads_from_the_source(by_reference):
    folder, document, source_dir = by_reference
    assert document.tensor_file is None and not list(folder.glob("*.tensors"))
    assert [(f.name, f.tensors) for f in document.source.files] == [
        ("model.safetensors", ["proj.a", "rotary.inv_freq", "norm.weight", "proj.b"])
    ]
    model = Toy()
    with open_checked_base(document, folder / BASE_DOCUMENT, source_dir) as reader:
        report = load_from_base(model, document, reader, Config(), torch.device("cpu"))
    assert torch.equal(model.norm.weight, dict(source())["norm.weight"]) and report["tensors_read"] == 3


def test_a_source_changed_under_a_base_by_reference_is_refused_by_content_hash(by_reference):
    """Same size, one value changed: the file check passes, the tensor's content hash does not."""
    from safetensors.torch import save_file

    folder, document, source_dir = by_reference
    changed = dict(source())
    changed["norm.weight"] = changed["norm.weight"] + 1
    save_file(changed, source_dir / "model.safetensors")
    with open_checked_base(document, folder / BASE_DOCUMENT, source_dir) as reader:
        with pytest.raises(IntegrityError, match="content hash of base tensor 'norm.weight' does not match the base"):
            load_from_base(Toy(), document, reader, Config(), torch.device("cpu"))
