"""Replay on a model with no post-load steps of its own, and the checks that follow it (doubles)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from helpers.synthetic import FINGERPRINT

from tensorizer_manifest.errors import ReplayError
from tensorizer_manifest.format import schema
from tensorizer_manifest.load.replay import replay_model

pytest.importorskip("vllm")


def _manifest(*modules: schema.ModuleRecord) -> schema.Manifest:
    ref = schema.TensorFileRef(path="t", size=0, tensor_count=0, digest="blake3:" + "0" * 64)
    return schema.Manifest(
        format_version=1, producer="test", fingerprint=FINGERPRINT, tensor_file=ref, modules=list(modules)
    )


def _norm_record(**changes) -> schema.ModuleRecord:
    record = schema.ModuleRecord(path="norm", module_class="torch.nn.modules.module.Module", state="processed",
                                 replay="none")  # fmt: skip
    return msgspec.structs.replace(record, **changes)


def _model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.norm = torch.nn.Module()
    model.norm.eps = 1e-6
    return model


def test_nothing_to_replay_is_an_empty_report():
    report = replay_model(_model(), _manifest(_norm_record()), None, torch.device("cpu"))
    assert report.to_dict() == {"post_load": [], "restored": {}, "kernel_changes": []}


def test_a_missing_runtime_attribute_is_a_replay_error():
    attr = schema.RuntimeAttr(owner="layer", name="handle", type="builtins.object", rebuilt_by="post_load")
    with pytest.raises(ReplayError, match="norm.*layer.handle is missing after replay"):
        replay_model(_model(), _manifest(_norm_record(runtime_state=[attr])), None, torch.device("cpu"))


def test_a_runtime_value_that_differs_from_the_saved_one_is_a_replay_error():
    attr = schema.RuntimeAttr(owner="layer", name="eps", type="builtins.float", rebuilt_by="x", value=1e-5)
    with pytest.raises(ReplayError, match="layer.eps is 1e-06 after replay, the saving engine had 1e-05"):
        replay_model(_model(), _manifest(_norm_record(runtime_state=[attr])), None, torch.device("cpu"))


def test_a_kernel_that_changed_under_a_kernel_specific_layer_is_a_replay_error():
    kernel = schema.KernelRecord(owner="layer", attr="cpu_linear", kernel_class="some.Kernel")
    with pytest.raises(ReplayError, match="saved as some.Kernel, now None; re-save"):
        replay_model(_model(), _manifest(_norm_record(kernels=[kernel])), None, torch.device("cpu"))
    raw = _norm_record(kernels=[kernel], state="raw", replay="post_load")
    report = replay_model(_model(), _manifest(raw), None, torch.device("cpu"))
    assert report.kernel_changes == ["norm: layer.cpu_linear saved as some.Kernel, now None"]


def _model_with_steps() -> tuple[torch.nn.Module, list[str]]:
    """Layers ``a`` and ``b``, each with a quant method that records when vLLM's step would run on it."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    calls: list[str] = []

    class Method(QuantizeMethodBase):  # a double that records when vLLM's step would run
        def __init__(self, name):
            self.name = name

        def create_weights(self, *args, **kwargs):
            pass

        def apply(self, *args, **kwargs):
            pass

        def process_weights_after_loading(self, layer):
            calls.append(self.name)

    model = torch.nn.Module()
    for name in ("a", "b"):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        layer.quant_method = Method(name)
        setattr(model, name, layer)
    return model, calls


def _raw(path: str) -> schema.ModuleRecord:
    return schema.ModuleRecord(path=path, module_class="x.Y", state="raw", replay="post_load")


def test_raw_steps_run_as_layers_arrive_and_tied_layers_wait_for_finish():
    """A layer another layer aliases keeps its tensors as loaded until every tensor is in place."""
    from tensorizer_manifest.load.replay import Replayer

    model, calls = _model_with_steps()
    model.c = torch.nn.Module()
    tied = schema.TensorRecord(name="weight", kind="parameter", dtype="float32", shape=[2], stride=[1], nbytes=8,
                               hash="blake3:" + "0" * 64, alias_of="b.weight")  # fmt: skip
    c = schema.ModuleRecord(path="c", module_class="x.Y", state="processed", replay="none", tensors=[tied])
    manifest = _manifest(_raw("a"), _raw("b"), c)
    replayer = Replayer(model, manifest, None, torch.device("cpu"))
    checked = []
    for record in manifest.modules:
        replayer.layer_ready(record, model.get_submodule(record.path), checked.append)
    assert calls == ["a"] and checked == ["a"]  # b waits: c aliases its weight; a raw step waits for hashes
    report = replayer.finish()
    assert calls == ["a", "b"]
    assert report.post_load == ["a:quant_method", "b:quant_method"]


def test_a_restorer_that_never_writes_its_tensors_does_not_wait_for_their_hashes():
    from tensorizer_manifest.load.replay import Replayer
    from tensorizer_manifest.restorers import RESTORERS

    assert RESTORERS["cpu_unquantized_gemm"].writes_tensors is False
    assert RESTORERS["attention_scales"].writes_tensors is False
    model = _model()
    record = _norm_record(replay="attention_scales")
    replayer = Replayer(model, _manifest(record), None, torch.device("cpu"))
    replayer._early.add("norm")  # as if norm had a quant-method step
    checked: list[str] = []
    replayer.layer_ready(record, model.norm, checked.append)
    assert checked == [] and replayer.report.restored == {"norm": "attention_scales"}


def test_without_overlap_raw_steps_wait_for_finish_and_run_in_vllms_order():
    from tensorizer_manifest.load.replay import Replayer

    model, calls = _model_with_steps()
    manifest = _manifest(*(_raw(path) for path in ("a", "b")))
    replayer = Replayer(model, manifest, None, torch.device("cpu"), overlap_raw_steps=False)
    checked: list[str] = []
    for record in manifest.modules:
        replayer.layer_ready(record, model.get_submodule(record.path), checked.append)
    assert calls == [] and checked == [] and replayer.step_seconds == 0.0
    assert replayer.finish().post_load == ["a:quant_method", "b:quant_method"]
    assert calls == ["a", "b"]
