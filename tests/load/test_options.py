"""The load's options (pydantic) and what they make of vLLM's ``model_loader_extra_config``, ``TensorizerConfig``
names included, without starting an engine."""

from __future__ import annotations

import pytest

from tensorizer_manifest.errors import ConfigurationError

pytest.importorskip("vllm")


def test_loader_options_are_validated():
    from tensorizer_manifest.load.options import LoadOptions

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
    from tensorizer_manifest.load.options import LoadOptions

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


def test_vllm_tensorizer_config_names_mean_the_same():
    from vllm.model_executor.model_loader.tensorizer import TensorizerConfig

    from tensorizer_manifest.load.options import LoadOptions

    class LoadConfig:
        model_loader_extra_config = {
            "tensorizer_dir": "s3://bucket/prefix",
            "verify_hash": False,
            "encryption_keyfile": "/keys/data.key",
            "num_readers": 3,
            "s3_endpoint": "http://127.0.0.1:9000",
        }

    options = LoadOptions.from_load_config(LoadConfig())
    assert options.checkpoint_dir == "s3://bucket/prefix"
    assert options.verify_hashes is False
    assert options.encryption_key_file == "/keys/data.key"
    assert options.num_readers == 3
    assert options.checkpoint_location("unused-model-path") == ("s3://bucket/prefix", None)
    # a TensorizerConfig object, as stock users pass it in Python
    LoadConfig.model_loader_extra_config = TensorizerConfig(tensorizer_uri="/ckpt/model.0123456789abcdef.tensors")
    options = LoadOptions.from_load_config(LoadConfig())
    assert options.checkpoint_location("model-id") == ("/ckpt", "model.0123456789abcdef.tensors")
    # made with tensorizer_dir, as docs/migrating.md shows (vLLM derives a stock file name from it)
    LoadConfig.model_loader_extra_config = TensorizerConfig(tensorizer_dir="/ckpt/dir", verify_hash=True)
    options = LoadOptions.from_load_config(LoadConfig())
    assert options.checkpoint_location("model-id") == ("/ckpt/dir", None)
    assert options.verify_hashes is True
    LoadConfig.model_loader_extra_config = {"tensorizer_uri": "s3://b/p/model-rank-%03d.tensors"}
    assert LoadOptions.from_load_config(LoadConfig()).checkpoint_location("m") == ("s3://b/p", None)
    LoadConfig.model_loader_extra_config = {}
    assert LoadOptions.from_load_config(LoadConfig()).checkpoint_location("org/model") == ("org/model", None)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"vllm_tensorized": True}, "vllm_tensorized means nothing here"),
        (
            {"serialization_kwargs": {"limit_cpu_concurrency": 1}},
            "serialization_kwargs means nothing here.*tensorizer-manifest save",
        ),
        ({"deserialization_kwargs": {"plaid_mode": True}}, "deserialization_kwargs means nothing here"),
        ({"stream_kwargs": {"force_http": True}}, "stream_kwargs means nothing here.*s3_endpoint"),
        ({"verify_hash": True, "verify_hashes": False}, "verify_hash .vLLM's name. and verify_hashes are one option"),
        ({"tensorizer_dir": "/a", "checkpoint_dir": "/b"}, "tensorizer_dir .vLLM's name. and checkpoint_dir"),
    ],
)
def test_tensorizer_config_options_that_mean_nothing_here_are_refused(extra, match):
    from tensorizer_manifest.load.options import LoadOptions

    class LoadConfig:
        model_loader_extra_config = extra

    with pytest.raises(ConfigurationError, match=match):
        LoadOptions.from_load_config(LoadConfig())


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"tensorizer_uri": "/ckpt/model.manifest.json"}, "tensorizer_uri must name a .tensors file"),
        ({"tensorizer_uri": "/a/model.tensors", "tensorizer_dir": "/b"}, "name two directories"),
    ],
)
def test_a_tensorizer_uri_that_names_no_tensor_file_here_is_refused(extra, match):
    from tensorizer_manifest.load.options import LoadOptions

    class LoadConfig:
        model_loader_extra_config = extra

    with pytest.raises(ConfigurationError, match=match):
        LoadOptions.from_load_config(LoadConfig()).checkpoint_location("m")
