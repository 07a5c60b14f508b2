"""``add_form``'s refusals, which come before an engine starts (no vLLM here: the e2e tests run it for real,
``test_e2e_fallbacks.py``), and the engine settings it takes from the checkpoint."""

from __future__ import annotations

import pytest
from helpers.synthetic import FINGERPRINT, write_synthetic_checkpoint

from tensorizer_manifest.errors import CheckpointNotFoundError, ConfigurationError
from tensorizer_manifest.save.add_form import add_form, engine_settings


def test_a_checkpoint_without_fallbacks_is_refused_saying_how_to_get_them(tmp_path):
    checkpoint = write_synthetic_checkpoint(tmp_path / "c")
    with pytest.raises(ConfigurationError, match="no layer has a raw fallback.*Re-save it from the source weights"):
        add_form(checkpoint)


def test_what_is_not_a_local_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="not a tensorizer-manifest checkpoint"):
        add_form(tmp_path)
    with pytest.raises(ConfigurationError, match="only s3:// checkpoints can be written"):
        add_form("http://host/prefix")
    with pytest.raises(ConfigurationError, match="invalid add-form option"):
        add_form(tmp_path, max_model_len=4)


def test_the_engine_gets_the_settings_the_checkpoint_was_saved_with(tmp_path):
    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    assert engine_settings(checkpoint / "model.manifest.json") == {
        "dtype": FINGERPRINT.dtype,
        "quantization": None,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "kv_cache_dtype": "auto",
        "enable_expert_parallel": False,
    }


def test_another_layout_without_a_base_is_refused_before_an_engine_starts(tmp_path):
    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    with pytest.raises(ConfigurationError, match="tensor_parallel_size other than the saved one \\(1\\) needs a "
                       "checkpoint with a base"):  # fmt: skip
        add_form(checkpoint, tensor_parallel_size=2)


def test_s3_options_for_a_local_checkpoint_are_refused(tmp_path):
    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    with pytest.raises(ConfigurationError, match="s3_\\* options are for an s3:// checkpoint"):
        add_form(checkpoint, s3_endpoint="http://127.0.0.1:1")


def test_the_signature_shows_every_option_keyword_only():
    import inspect

    from tensorizer_manifest.save.add_form import AddFormOptions

    parameters = inspect.signature(add_form).parameters
    assert list(parameters)[0] == "checkpoint"
    keyword_only = [n for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == list(AddFormOptions.model_fields)
