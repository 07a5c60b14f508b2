"""Save options and the source lookup, without starting an engine."""

from __future__ import annotations

import os

import pytest

from tensorizer_manifest.errors import CheckpointNotFoundError, ConfigurationError
from tensorizer_manifest.save.from_source import SAVING_CONTEXT_LEN, SaveOptions, engine_kwargs, resolve_model_dir


def test_bad_options_are_configuration_errors_naming_the_option():
    with pytest.raises(ConfigurationError, match="tensor_parallel_size"):
        SaveOptions.parse({"tensor_parallel_size": 0})
    with pytest.raises(ConfigurationError, match="tensr_parallel_size"):
        SaveOptions.parse({"tensr_parallel_size": 2})


def test_engine_args_pass_through_and_win(tmp_path):
    options = {"dtype": "bfloat16", "engine_args": {"kv_cache_dtype": "fp8", "max_model_len": 4096}}
    kwargs = engine_kwargs(SaveOptions.parse(options), tmp_path)
    assert kwargs["dtype"] == "bfloat16" and kwargs["kv_cache_dtype"] == "fp8" and kwargs["enforce_eager"]
    assert kwargs["max_model_len"] == 4096


def _model_dir(tmp_path, config: dict):
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"max_position_embeddings": 131072}, SAVING_CONTEXT_LEN),  # Llama 3: never the model's own 128k
        ({"n_positions": 16}, 16),  # shorter than the saving context: vLLM would refuse a longer one
        ({"text_config": {"max_position_embeddings": 8}, "max_position_embeddings": 4096}, 8),
        ({}, SAVING_CONTEXT_LEN),
    ],
)
def test_the_saving_engine_gets_a_short_context_whatever_the_model_s(tmp_path, config, expected):
    kwargs = engine_kwargs(SaveOptions.parse({}), _model_dir(tmp_path, config))
    assert kwargs["max_model_len"] == expected


def test_a_context_asked_for_is_the_one_the_saving_engine_gets(tmp_path):
    model_dir = _model_dir(tmp_path, {"max_position_embeddings": 131072})
    assert engine_kwargs(SaveOptions.parse({"max_model_len": 512}), model_dir)["max_model_len"] == 512


def test_a_source_that_is_neither_a_directory_nor_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(CheckpointNotFoundError, match="not a local directory and not in the Hugging Face cache"):
        resolve_model_dir("no-such-org/no-such-model")


def test_a_signing_key_file_is_checked_before_an_engine_starts(tmp_path, monkeypatch):
    from tensorizer_manifest.save.from_source import signing_key_file_path

    monkeypatch.delenv("TENSORIZER_MANIFEST_SIGNING_KEY", raising=False)
    assert signing_key_file_path(None) is None
    key = tmp_path / "key"
    key.write_bytes(b"k" * 32)
    assert signing_key_file_path(str(key)) == str(key.resolve())
    monkeypatch.setenv("TENSORIZER_MANIFEST_SIGNING_KEY", str(key))
    assert signing_key_file_path(None) == str(key.resolve())  # the workers get a path, never the key
    with pytest.raises(ConfigurationError, match="cannot be read"):
        signing_key_file_path(str(tmp_path / "missing"))
    assert SaveOptions.parse({"signing_key_file": str(key)}).signing_key_file == str(key)


def test_the_engine_spills_pre_step_tensors_beside_the_output_and_the_environment_is_put_back(tmp_path, monkeypatch):
    vllm = pytest.importorskip("vllm")
    from tensorizer_manifest._constants import SPILL_DIR_ENV
    from tensorizer_manifest.save.from_source import existing_parent, save_checkpoint

    seen = []

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.append(os.environ.get(SPILL_DIR_ENV))  # what the engine and its workers inherit

        def collective_rpc(self, *args, **kwargs):
            return []

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.delenv(SPILL_DIR_ENV, raising=False)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    out = tmp_path / "new" / "out"
    assert existing_parent(out) == tmp_path
    save_checkpoint(src, out)
    assert seen == [str(tmp_path)]
    assert SPILL_DIR_ENV not in os.environ
    monkeypatch.setenv(SPILL_DIR_ENV, str(tmp_path / "mine"))
    save_checkpoint(src, out)
    assert seen[-1] == str(tmp_path / "mine") and os.environ[SPILL_DIR_ENV] == str(tmp_path / "mine")


def test_remote_outputs_are_checked_before_an_engine_starts(tmp_path):
    from tensorizer_manifest.save.from_source import save_checkpoint

    with pytest.raises(ConfigurationError, match="read-only"):
        save_checkpoint(tmp_path, "https://host/prefix")
    with pytest.raises(ConfigurationError, match="credentials may not be part of the URI"):
        save_checkpoint(tmp_path, "s3://key:secret-in-uri@bucket/prefix")
    with pytest.raises(ConfigurationError, match="for an s3:// output"):
        save_checkpoint(tmp_path, tmp_path / "out", s3_endpoint="http://127.0.0.1:1")


@pytest.mark.parametrize(
    "options, words",
    [
        ({"format_version": 2}, "needs format_version=3"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=1 and without expert parallelism"),
        ({"engine_args": {"enable_expert_parallel": True}}, "without expert parallelism"),
    ],
)
def test_a_base_the_saving_engine_cannot_observe_is_refused_before_it_starts(tmp_path, options, words):
    from tensorizer_manifest.save.from_source import save_checkpoint

    with pytest.raises(ConfigurationError, match=words):
        save_checkpoint(tmp_path / "no-model-here", tmp_path / "out", base="inside", **options)
    assert not (tmp_path / "out").exists()


def test_save_options_never_show_a_credential():
    options = SaveOptions.parse({"s3_access_key_id": "AKIAEXAMPLEKEYID", "s3_secret_access_key": "s3cr3t-value-xyz"})
    assert "s3cr3t-value-xyz" not in repr(options) and "AKIAEXAMPLEKEYID" not in repr(options)
    assert options.remote().secret_access_key == "s3cr3t-value-xyz"
    with pytest.raises(ConfigurationError) as exc:
        SaveOptions.parse({"s3_secret_acess_key": "s3cr3t-value-xyz"})  # misspelled
    assert "s3_secret_acess_key" in str(exc.value) and "s3cr3t-value-xyz" not in str(exc.value)


def test_an_encryption_key_file_is_checked_before_an_engine_starts(tmp_path, monkeypatch):
    from tensorizer_manifest.save.from_source import encryption_key_file_path

    monkeypatch.delenv("TENSORIZER_MANIFEST_ENCRYPTION_KEY", raising=False)
    assert encryption_key_file_path(None) is None
    key = tmp_path / "key"
    key.write_bytes(b"e" * 32)
    assert encryption_key_file_path(str(key)) == str(key.resolve())
    monkeypatch.setenv("TENSORIZER_MANIFEST_ENCRYPTION_KEY", str(key))
    assert encryption_key_file_path(None) == str(key.resolve())  # the workers get a path, never the key
    short = tmp_path / "short"
    short.write_bytes(b"e" * 8)
    with pytest.raises(ConfigurationError, match="encryption key has 8 bytes"):
        encryption_key_file_path(str(short))
    options = SaveOptions.parse({"encryption_key_file": str(key), "progress": True})
    assert options.encryption_key_file == str(key) and options.progress


def test_the_saving_kv_cache_holds_two_cache_blocks_of_any_model(tmp_path):
    """vLLM's CPU cache blocks are 128 tokens (256 on some backends) and one sequence must fit: 64 MiB hold
    256 tokens of an 8B model in float32, not of a 405B one (126 layers, 8 KV heads of 128: 1 MiB a token)."""
    llama_8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    llama_405b = {"num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
                  "hidden_size": 16384}  # fmt: skip
    assert engine_kwargs(SaveOptions.parse({}), _model_dir(tmp_path, llama_8b))["kv_cache_memory_bytes"] == 64 << 20
    big = engine_kwargs(SaveOptions.parse({}), _model_dir(tmp_path, llama_405b))["kv_cache_memory_bytes"]
    assert big == 126 * 2 * 8 * 128 * 4 * 256
    asked = SaveOptions.parse({"kv_cache_memory_bytes": 32 << 20})
    assert engine_kwargs(asked, _model_dir(tmp_path, llama_405b))["kv_cache_memory_bytes"] == 32 << 20
    assert (
        engine_kwargs(SaveOptions.parse({}), _model_dir(tmp_path, {"n_layer": 2}))["kv_cache_memory_bytes"] == 64 << 20
    )


def test_the_signature_shows_every_option_keyword_only():
    import inspect

    from tensorizer_manifest.save.from_source import save_checkpoint

    parameters = inspect.signature(save_checkpoint).parameters
    assert list(parameters)[:2] == ["src", "out"]
    options = {n: p for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert list(options) == list(SaveOptions.model_fields)
    assert options["dtype"].default == "auto" and options["format_version"].default == 3


@pytest.mark.parametrize(
    ("options", "writes"),
    [
        ({}, True),
        ({"base": "none"}, False),
        ({"pipeline_parallel_size": 2}, False),
        ({"engine_args": {"enable_expert_parallel": True}}, False),
        ({"format_version": 2}, False),
        ({"tensor_parallel_size": 2}, True),
        ({"base": "inside"}, True),
    ],
)
def test_a_save_writes_the_base_by_default_wherever_it_can_be_observed(tmp_path, options, writes):
    """``auto``: a base costs about nothing on disk for dense kinds now that the form set stores only what vLLM's
    step changed (docs/performance.md), so it is written wherever the saving engine can observe it; a save at
    ``pipeline_parallel_size>1``, with expert parallelism or in format version 2 writes none (``inside`` there is
    refused by name, before an engine starts)."""
    parsed = SaveOptions.parse(options)
    assert parsed.writes_base() is writes
    assert (
        engine_kwargs(parsed, _model_dir(tmp_path, {"model_type": "llama"}))["model_loader_extra_config"]["base"]
        is writes
    )


@pytest.mark.parametrize(
    "out, options",
    [
        ("s3://bucket/prefix", {}),
        (None, {"encryption_key_file": "KEY"}),
        (None, {"format_version": 2}),
    ],
    ids=["s3", "encrypted", "format-2"],
)
def test_a_base_by_reference_where_the_checkpoint_must_hold_its_own_is_refused_before_an_engine_starts(
    tmp_path, out, options
):
    from tensorizer_manifest.save.from_source import save_checkpoint

    if options.get("encryption_key_file") == "KEY":
        (tmp_path / "key").write_bytes(os.urandom(32))
        options = {"encryption_key_file": str(tmp_path / "key")}
    with pytest.raises(ConfigurationError, match=r"base='inside'|needs format_version=3"):
        save_checkpoint(tmp_path / "no-model-here", out or tmp_path / "out", base="reference", **options)
    assert not (tmp_path / "out").exists()
