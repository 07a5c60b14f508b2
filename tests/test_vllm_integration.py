"""The loader's options (pydantic) and the plugin entry point, without starting an engine."""

from __future__ import annotations

import pytest

from tensorizer_manifest.errors import ConfigurationError

pytest.importorskip("vllm")


def test_loader_options_are_validated():
    from tensorizer_manifest.vllm_integration import LoadOptions

    class LoadConfig:
        model_loader_extra_config = {"verify_hashes": "no"}

    assert LoadOptions.from_load_config(LoadConfig()).verify_hashes is False
    LoadConfig.model_loader_extra_config = {"verfy_hashes": False}
    with pytest.raises(ConfigurationError, match="verfy_hashes"):
        LoadOptions.from_load_config(LoadConfig())
    LoadConfig.model_loader_extra_config = {"signing_key_file": "/keys/model.key"}
    assert LoadOptions.from_load_config(LoadConfig()).signing_key_file == "/keys/model.key"
    LoadConfig.model_loader_extra_config = {"signing_key": "abc"}  # the key itself is not an option
    with pytest.raises(ConfigurationError, match="signing_key"):
        LoadOptions.from_load_config(LoadConfig())


def test_remote_credentials_are_options_never_shown():
    from tensorizer_manifest.vllm_integration import LoadOptions

    class LoadConfig:
        model_loader_extra_config = {
            "checkpoint_dir": "s3://bucket/prefix",
            "s3_access_key_id": "AKIAEXAMPLEKEYID",
            "s3_secret_access_key": "s3cr3t-value-xyz",
            "s3_endpoint": "http://127.0.0.1:9000",
        }

    options = LoadOptions.from_load_config(LoadConfig())
    remote = options.remote()
    assert (remote.access_key_id, remote.secret_access_key, remote.endpoint) == (
        "AKIAEXAMPLEKEYID",
        "s3cr3t-value-xyz",
        "http://127.0.0.1:9000",
    )
    for text in (repr(options), str(options), repr(remote)):
        assert "s3cr3t-value-xyz" not in text and "AKIAEXAMPLEKEYID" not in text
    LoadConfig.model_loader_extra_config = {"s3_secret_key": "s3cr3t-value-xyz"}  # unknown: refused, not echoed
    with pytest.raises(ConfigurationError, match="s3_secret_key") as exc:
        LoadOptions.from_load_config(LoadConfig())
    assert "s3cr3t-value-xyz" not in str(exc.value)


def test_plugin_registers_both_load_formats_once():
    from vllm.model_executor.model_loader import get_model_loader  # noqa: F401  (public API)

    from tensorizer_manifest import _vllm_compat
    from tensorizer_manifest._constants import CAPTURE_LOAD_FORMAT, LOAD_FORMAT
    from tensorizer_manifest.vllm_integration import CaptureModelLoader, ManifestModelLoader, register

    register()
    assert not _vllm_compat.register_model_loader_once(LOAD_FORMAT, ManifestModelLoader)
    assert not _vllm_compat.register_model_loader_once(CAPTURE_LOAD_FORMAT, CaptureModelLoader)


def test_overlap_policy_defers_vllms_steps_on_cpu_only_and_an_explicit_choice_wins():
    import torch

    from tensorizer_manifest.vllm_integration import LoadOptions, overlap_policy

    assert LoadOptions().overlap_steps is None
    assert overlap_policy(None, torch.device("cpu")) == {"raw_steps": False, "restorers": True}
    assert overlap_policy(None, torch.device("cuda", 0)) == {"raw_steps": True, "restorers": True}
    assert overlap_policy(True, torch.device("cpu")) == {"raw_steps": True, "restorers": True}
    assert overlap_policy(False, torch.device("cuda")) == {"raw_steps": False, "restorers": False}
