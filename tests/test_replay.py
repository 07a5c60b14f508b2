"""Replay on a model with no post-load steps of its own, and the checks that follow it (doubles)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from helpers.synthetic import FINGERPRINT

from tensorizer_manifest import schema
from tensorizer_manifest.errors import ReplayError
from tensorizer_manifest.replay import replay_model

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
