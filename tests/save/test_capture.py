"""Deciding raw or processed from what the post-load step did (layers are plain torch doubles)."""

from __future__ import annotations

import pytest
import torch

from tensorizer_manifest.errors import UnsupportedModelError
from tensorizer_manifest.live_model.layers import PreStepCopies, snapshot_module
from tensorizer_manifest.save.capture import Recorder, classify
from tensorizer_manifest.storage.spill import SpillFile

pytest.importorskip("vllm")


@pytest.fixture
def copies(tmp_path):
    with SpillFile(tmp_path) as spill:
        yield PreStepCopies(spill)


def _layer():
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.ones(4, 4), requires_grad=False)
    return layer


def test_a_layer_the_step_did_not_touch_is_processed_with_nothing_to_replay(copies):
    layer = _layer()
    before = snapshot_module(layer, copies)
    captured = classify("norm", layer, before, snapshot_module(layer, None))
    assert (captured.state, captured.replay) == ("processed", "none")


def test_a_layer_no_restorer_covers_is_raw_and_keeps_its_pre_step_tensors(copies):
    layer = _layer()
    before = snapshot_module(layer, copies)
    layer.weight = torch.nn.Parameter(torch.zeros(0), requires_grad=False)
    layer.register_buffer("azp_adj", torch.ones(4))
    layer.handle = object()
    captured = classify("proj", layer, before, snapshot_module(layer, None))
    assert (captured.state, captured.replay) == ("raw", "post_load")
    assert torch.equal(captured.tensors["weight"].data(), torch.ones(4, 4))
    assert "no restorer" in captured.reason
    assert {(a.owner, a.name) for a in captured.runtime_state} == {("layer", "azp_adj"), ("layer", "handle")}
    assert all(a.rebuilt_by == "post_load" for a in captured.runtime_state)


def test_a_model_level_hook_is_refused_before_the_step():
    model = torch.nn.Module()
    model.process_weights_after_loading = lambda *a: None
    with pytest.raises(UnsupportedModelError, match="model-level post-load hook"):
        Recorder(model)


def test_a_layer_changed_without_a_step_of_its_own_is_refused():
    model = torch.nn.Module()
    model.norm = _layer()
    recorder = Recorder(model)
    with torch.no_grad():
        model.norm.weight.fill_(2.0)  # in place, as a model-level hook would
    with pytest.raises(UnsupportedModelError, match="no post-load step of its own"):
        recorder.finish(fingerprint=None)
    assert recorder.spill.closed  # the pre-step copies are freed on error


def test_pre_step_copies_go_to_a_nameless_file_the_capture_owns(tmp_path):
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    class _Method(QuantizeMethodBase):
        def create_weights(self, *args, **kwargs): ...

        def apply(self, *args, **kwargs): ...

        def process_weights_after_loading(self, layer):
            layer.weight = torch.nn.Parameter(torch.zeros(0), requires_grad=False)
            layer.handle = object()

    model = torch.nn.Module()
    model.proj = _layer()
    model.proj.quant_method = _Method()
    model.norm = _layer()
    recorder = Recorder(model, spill_dir=str(tmp_path))
    assert recorder.spill.count == 1 and list(tmp_path.iterdir()) == []  # only the layer with a step
    model.proj.quant_method.process_weights_after_loading(model.proj)
    capture = recorder.finish(fingerprint=None)
    proj = next(layer for layer in capture.layers if layer.path == "proj")
    assert proj.state == "raw" and proj.tensors["weight"].tensor.is_meta
    assert torch.equal(proj.tensors["weight"].data(), torch.ones(4, 4))
    capture.close()
    assert capture.spill.closed and list(tmp_path.iterdir()) == []


def _linear_after_dispatch(copies):
    """An unquantized linear layer whose step only built the ``cpu_linear`` dispatch (the torch fallback)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    layer = _layer()
    layer.quant_method = UnquantizedLinearMethod()
    before = snapshot_module(layer, copies)
    layer.cpu_linear = torch.nn.functional.linear
    return layer, before, snapshot_module(layer, None)


def test_policy_portable_saves_a_covered_layer_raw(copies):
    from tensorizer_manifest.save.capture import CapturePolicy

    layer, before, after = _linear_after_dispatch(copies)
    assert classify("proj", layer, before, after).replay == "cpu_unquantized_gemm"
    portable = classify("proj", layer, before, after, CapturePolicy(portable=True))
    assert (portable.state, portable.replay, portable.form) == ("raw", "post_load", {})
    assert "--portable" in portable.reason


def test_policy_unverified_restorers_save_raw_unless_the_user_opts_in(copies):
    from tensorizer_manifest.save.capture import CapturePolicy

    layer, before, after = _linear_after_dispatch(copies)
    verified = classify("proj", layer, before, after, CapturePolicy(device_type="cpu"))
    assert (verified.state, verified.verified) == ("processed", True)
    refused = classify("proj", layer, before, after, CapturePolicy(device_type="tpu"))
    assert refused.state == "raw" and "not verified on tpu" in refused.reason
    opted_in = classify("proj", layer, before, after, CapturePolicy(device_type="tpu", allow_unverified=True))
    assert (opted_in.state, opted_in.replay, opted_in.verified) == ("processed", "cpu_unquantized_gemm", False)


def test_a_layer_in_a_machine_or_kernel_specific_form_keeps_its_pre_step_tensors_as_a_fallback(copies, monkeypatch):
    """``cpu_unquantized_gemm`` is kernel-independent with an empty form: nothing to fall back to. Made
    machine-specific (a form) or kernel-specific, the same layer keeps its pre-step copies, unless told not to."""
    from tensorizer_manifest.restorers import RESTORERS
    from tensorizer_manifest.save.capture import CapturePolicy

    layer, before, after = _linear_after_dispatch(copies)
    assert classify("proj", layer, before, after).fallback == {}
    gemm = type(RESTORERS["cpu_unquantized_gemm"])
    monkeypatch.setattr(gemm, "form", lambda self, module: {"isa": "vec"})
    kept = classify("proj", layer, before, after)
    assert kept.state == "processed" and kept.fallback is before.tensors
    assert kept.fallback["weight"].stored is not None, "the pre-step copy, not the live (processed) tensor"
    assert classify("proj", layer, before, after, CapturePolicy(fallbacks=False)).fallback == {}
    monkeypatch.setattr(gemm, "form", lambda self, module: {})
    monkeypatch.setattr(gemm, "kernel_independent", False)
    assert classify("proj", layer, before, after).fallback is before.tensors
