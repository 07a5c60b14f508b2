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
    monkeypatch.setattr(_vllm_compat, "PRIVATE_NAMES", (*_vllm_compat.PRIVATE_NAMES, ("vllm", "_no_such_name", ())))
    assert _vllm_compat.missing_private_names() == ["vllm._no_such_name"]
    from vllm import _custom_ops

    monkeypatch.delattr(_custom_ops, "_supports_onednn")
    with pytest.raises(Exception, match=f"vLLM {_vllm_compat.vllm_version()} has no"):
        _vllm_compat.disable_onednn()


def test_a_private_function_whose_signature_changed_is_a_typed_error_before_it_is_called(monkeypatch):
    """vLLM 0.31's ``_hash_quant_config`` takes no ``runtime_quant_config``: a TypeError deep in a save, once."""
    from types import SimpleNamespace

    from vllm.model_executor.model_loader.weight_cache import protocol

    from tensorizer_manifest.errors import UnsupportedVLLMError

    calls = []
    monkeypatch.setattr(protocol, "_hash_quant_config", lambda quant_config: calls.append(quant_config))
    name = "vllm.model_executor.model_loader.weight_cache.protocol._hash_quant_config"
    assert _vllm_compat.missing_private_names() == [f"{name} (takes no runtime_quant_config)"]
    quantized = SimpleNamespace(hf_config=SimpleNamespace(quantization_config={"quant_method": "x"}))
    with pytest.raises(UnsupportedVLLMError) as raised:
        _vllm_compat.quant_config_hash(quantized)
    message = str(raised.value)
    assert f"vLLM {_vllm_compat.vllm_version()} " in message and name in message
    assert _vllm_compat.SUPPORTED_VLLM in message
    assert calls == []  # refused before the call
    unquantized = SimpleNamespace(hf_config=SimpleNamespace(), quantization=None)
    assert _vllm_compat.quant_config_hash(unquantized) is None  # a model that never calls it is not refused


def test_engine_facts_outside_an_engine():
    assert _vllm_compat.parallel_ranks() == (0, 0)
    assert isinstance(_vllm_compat.onednn_enabled(), bool)


def test_logged_engine_arguments_hide_credential_options(caplog):
    import logging

    from tensorizer_manifest import _vllm_compat

    _vllm_compat.redact_logged_options(frozenset({"s3_secret_access_key"}))
    _vllm_compat.redact_logged_options(frozenset({"s3_secret_access_key"}))  # once only
    _vllm_compat.redact_logged_options(frozenset({"other_secret"}))  # joins the same filter
    logger = logging.getLogger(_vllm_compat.ENGINE_ARGS_LOGGER)
    assert sum(isinstance(f, _vllm_compat.RedactOptions) for f in logger.filters) == 1
    with caplog.at_level(logging.INFO, logger=_vllm_compat.ENGINE_ARGS_LOGGER):
        logger.info("non-default args: %s", {"model_loader_extra_config": {"s3_secret_access_key": "s3cr3t-xyz",
                                                                          "other_secret": "0th3r"}})  # fmt: skip
    assert "s3cr3t-xyz" not in caplog.text and "'s3_secret_access_key': '***'" in caplog.text
    assert "0th3r" not in caplog.text


def test_load_numel_is_vllms_count_of_what_weight_loaders_fill():
    import torch

    padded = torch.empty(4, 8)
    assert _vllm_compat.load_numel(padded) == 32
    padded.weight_loader_numel = 24  # a MoE weight whose creator padded it, as vLLM's unquantized MoE does
    assert _vllm_compat.load_numel(padded) == 24
