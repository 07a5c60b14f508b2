"""Save options and the source lookup, without starting an engine."""

from __future__ import annotations

import pytest

from tensorizer_manifest.errors import CheckpointNotFoundError, ConfigurationError
from tensorizer_manifest.save import SaveOptions, engine_kwargs, resolve_model_dir


def test_bad_options_are_configuration_errors_naming_the_option():
    with pytest.raises(ConfigurationError, match="tensor_parallel_size"):
        SaveOptions.parse({"tensor_parallel_size": 0})
    with pytest.raises(ConfigurationError, match="tensr_parallel_size"):
        SaveOptions.parse({"tensr_parallel_size": 2})


def test_engine_args_pass_through_and_win():
    kwargs = engine_kwargs(SaveOptions.parse({"dtype": "bfloat16", "engine_args": {"kv_cache_dtype": "fp8"}}))
    assert kwargs["dtype"] == "bfloat16" and kwargs["kv_cache_dtype"] == "fp8" and kwargs["enforce_eager"]


def test_a_source_that_is_neither_a_directory_nor_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(CheckpointNotFoundError, match="not a local directory and not in the Hugging Face cache"):
        resolve_model_dir("no-such-org/no-such-model")
