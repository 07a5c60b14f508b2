"""Every private vLLM name the package touches exists in the installed vLLM."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tensorizer_manifest import _vllm_compat  # noqa: E402


def test_every_private_vllm_name_is_there():
    missing = _vllm_compat.missing_private_names()
    assert not missing, f"vLLM {_vllm_compat.vllm_version()} lacks {missing}: update _vllm_compat.py"


def test_observe_post_load_calls_the_observer_and_puts_the_step_back():
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    seen = []
    with _vllm_compat.observe_post_load(lambda model, run_step: seen.append(model)):
        assert base_loader.process_weights_after_loading is not original
        base_loader.process_weights_after_loading("model", None, None)
    assert seen == ["model"]
    assert base_loader.process_weights_after_loading is original


def test_a_missing_name_is_reported_with_the_vllm_version(monkeypatch):
    monkeypatch.setattr(_vllm_compat, "PRIVATE_NAMES", (*_vllm_compat.PRIVATE_NAMES, ("vllm", "_no_such_name")))
    assert _vllm_compat.missing_private_names() == ["vllm._no_such_name"]
    from vllm import _custom_ops

    monkeypatch.delattr(_custom_ops, "_supports_onednn")
    with pytest.raises(Exception, match=f"vLLM {_vllm_compat.vllm_version()} has no"):
        _vllm_compat.disable_onednn()


def test_engine_facts_outside_an_engine():
    assert _vllm_compat.parallel_ranks() == (0, 0)
    assert isinstance(_vllm_compat.onednn_enabled(), bool)
