"""Choosing each layer's form before reading (``forms``), on manifests and modules built here, without vLLM.

The restorers are stand-ins registered for the test: the claims about vLLM's own kernels (the fallback loads
token-exact, vLLM's step runs once on it) are ``test_e2e_fallbacks.py``'s.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from tensorizer_manifest.format import schema
from tensorizer_manifest.load import layer_forms as forms
from tensorizer_manifest.restorers import RESTORERS, Restorer

H = "blake3:" + "0" * 64


class _LayoutRestorer(Restorer):
    """Lays tensors out by the module's ``isa`` attribute, as a CPU kernel lays them out by the machine's."""

    name = "test_layout"
    verified_on = frozenset({"cpu"})

    def form(self, module):
        return {"isa": module.isa}


class _PortableRestorer(_LayoutRestorer):
    name = "test_portable"
    kernel_independent = True

    def form(self, module):
        return {}


@pytest.fixture(autouse=True)
def restorers(monkeypatch):
    monkeypatch.setitem(RESTORERS, "test_layout", _LayoutRestorer())
    monkeypatch.setitem(RESTORERS, "test_portable", _PortableRestorer())


def _record(name: str, key: str, nbytes: int = 8) -> schema.TensorRecord:
    return schema.TensorRecord(name=name, kind="parameter", dtype="float32", shape=[nbytes // 4], stride=[1],
                               nbytes=nbytes, hash=H, key=key)  # fmt: skip


def _fingerprint(**changes) -> schema.Fingerprint:
    base = dict(vllm_version="0.32.0", torch_version="2.13.0", tensorizer_version="2.10.1", architectures=["X"],
                model_class="X", dtype="bfloat16", quantization=None, quant_config_hash=None, kv_cache_dtype="auto",
                tensor_parallel_size=1, tensor_parallel_rank=0, pipeline_parallel_size=1, pipeline_parallel_rank=0,
                device_type="cpu")  # fmt: skip
    return schema.Fingerprint(**{**base, **changes})


class _Layer(torch.nn.Module):
    def __init__(self, isa: str):
        super().__init__()
        self.isa = isa
        self.weight = torch.nn.Parameter(torch.zeros(2))


def _model(isa: str = "vec") -> torch.nn.Module:
    model = torch.nn.Module()
    model.experts = _Layer(isa)
    model.norm = _Layer(isa)
    return model


def _module(path: str, replay: str, form: dict, fallback: bool = True) -> schema.ModuleRecord:
    return schema.ModuleRecord(
        path=path,
        module_class=schema.qualified_class(_Layer),
        state="processed",
        replay=replay,
        tensors=[_record("packed", f"{path}.packed", 16)],
        runtime_state=[schema.RuntimeAttr(owner="layer", name="kernel", type="K", rebuilt_by=replay)],
        form=form,
        verified=True,
        fallback=[_record("weight", schema.fallback_name(f"{path}.weight"))] if fallback else [],
    )


def _manifest(*modules: schema.ModuleRecord, **fingerprint) -> schema.Manifest:
    ref = schema.TensorFileRef(path="model.x.tensors", size=0, tensor_count=0, digest=H)
    return schema.Manifest(format_version=2, producer="test", fingerprint=_fingerprint(**fingerprint),
                           tensor_file=ref, modules=list(modules))  # fmt: skip


def test_a_form_that_fits_loads_processed_and_its_fallback_is_not_read():
    manifest = _manifest(_module("experts", "test_layout", {"isa": "vec"}))
    choice = forms.choose_forms(manifest, _model("vec"), _fingerprint())
    (record,) = choice.manifest.modules
    assert record.state == "processed" and record.fallback == [] and record.tensors == manifest.modules[0].tensors
    assert choice.fallbacks == () and choice.processed == 1


def test_another_machines_form_loads_the_fallback_as_a_raw_layer():
    saved = _module("experts", "test_layout", {"isa": "amx"})
    manifest = _manifest(saved, _module("norm", "test_layout", {"isa": "vec"}))
    choice = forms.choose_forms(manifest, _model("vec"), _fingerprint())
    experts, norm = choice.manifest.modules
    assert (experts.state, experts.replay) == ("raw", schema.REPLAY_POST_LOAD)
    assert experts.tensors == saved.fallback and experts.fallback == [] and experts.runtime_state == []
    assert norm.state == "processed"
    assert choice.fallbacks == (forms.Fallback("experts", "form {'isa': 'amx'} recorded, this machine gives "
                                                          "{'isa': 'vec'}"),)  # fmt: skip
    assert choice.to_dict()["fallback_layers"] == ["experts"] and choice.to_dict()["processed_with_fallback"] == 1
    assert manifest.modules[0] is saved and saved.state == "processed"  # the saved manifest is left as it was


def test_a_kernel_specific_form_from_another_vllm_falls_back_and_a_portable_one_does_not():
    manifest = _manifest(
        _module("experts", "test_layout", {"isa": "vec"}),
        _module("norm", "test_portable", {}),
        vllm_version="0.31.0",
    )
    choice = forms.choose_forms(manifest, _model("vec"), _fingerprint())
    assert [f.path for f in choice.fallbacks] == ["experts"]
    assert "vllm_version '0.31.0' (this engine: '0.32.0')" in choice.fallbacks[0].reason
    assert choice.manifest.modules[1].state == "processed"


def test_a_kernel_the_engine_builds_differently_falls_back(monkeypatch):
    record = _module("experts", "test_layout", {"isa": "vec"})
    record.kernels = [schema.KernelRecord(owner="layer", attr="impl", kernel_class="a.Saved")]
    built = [schema.KernelRecord(owner="layer", attr="impl", kernel_class="b.Other")]
    monkeypatch.setattr(forms, "find_kernels", lambda module: built)
    reason = forms.why_not_processed(record, _model("vec").experts, _fingerprint(), _fingerprint())
    assert reason == "kernel layer.impl a.Saved recorded, this engine builds b.Other"


def test_without_a_fallback_or_a_matching_module_nothing_is_chosen():
    """The refusal stays ``restore.check_forms``' and ``check_model``'s, with their messages."""
    no_fallback = _module("experts", "test_layout", {"isa": "amx"}, fallback=False)
    missing = _module("gone", "test_layout", {"isa": "amx"})
    manifest = _manifest(no_fallback, missing)
    choice = forms.choose_forms(manifest, _model("vec"), _fingerprint())
    assert choice.manifest.modules == manifest.modules and choice.fallbacks == ()


def test_an_unverified_restorer_here_falls_back_unless_the_saver_opted_in():
    record = _module("experts", "test_layout", {"isa": "vec"})
    layer = _model("vec").experts
    gpu = _fingerprint(device_type="cuda")
    reason = forms.why_not_processed(record, layer, gpu, gpu)
    assert reason == "restorer test_layout is not verified on cuda"
    opted_in = msgspec.structs.replace(record, verified=False)
    assert forms.why_not_processed(opted_in, layer, gpu, gpu) is None
