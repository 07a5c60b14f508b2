"""The loaders' options (pydantic) and what they make of them, without starting an engine."""

from __future__ import annotations

import pytest

from tensorizer_manifest.errors import ConfigurationError

pytest.importorskip("vllm")


def test_loader_options_are_validated():
    from tensorizer_manifest.vllm_integration.loaders import LoadOptions

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
    from tensorizer_manifest.vllm_integration.loaders import LoadOptions

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


def test_overlap_policy_defers_vllms_steps_on_cpu_only_and_an_explicit_choice_wins():
    import torch

    from tensorizer_manifest.vllm_integration.loaders import LoadOptions, overlap_policy

    assert LoadOptions().overlap_steps is None
    assert overlap_policy(None, torch.device("cpu")) == {"raw_steps": False, "restorers": True}
    assert overlap_policy(None, torch.device("cuda", 0)) == {"raw_steps": True, "restorers": True}
    assert overlap_policy(True, torch.device("cpu")) == {"raw_steps": True, "restorers": True}
    assert overlap_policy(False, torch.device("cuda")) == {"raw_steps": False, "restorers": False}


def test_vllm_tensorizer_config_names_mean_the_same():
    from vllm.model_executor.model_loader.tensorizer import TensorizerConfig

    from tensorizer_manifest.vllm_integration.loaders import LoadOptions

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
    from tensorizer_manifest.vllm_integration.loaders import LoadOptions

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
    from tensorizer_manifest.vllm_integration.loaders import LoadOptions

    class LoadConfig:
        model_loader_extra_config = extra

    with pytest.raises(ConfigurationError, match=match):
        LoadOptions.from_load_config(LoadConfig()).checkpoint_location("m")


def test_a_tensorizer_uri_must_be_a_tensor_file_its_manifest_names(tmp_path):
    from helpers.synthetic import write_synthetic_checkpoint

    from tensorizer_manifest.storage.checkpoint import check_named_tensor_file, load_manifest

    manifest, path = load_manifest(write_synthetic_checkpoint(tmp_path / "ckpt"))
    check_named_tensor_file(manifest, path, manifest.tensor_file.path)
    with pytest.raises(
        ConfigurationError, match=f"names model.tensors.*names its tensor file {manifest.tensor_file.path}"
    ):
        check_named_tensor_file(manifest, path, "model.tensors")


def test_a_form_set_another_vllm_release_made_sends_the_rank_to_the_base_before_anything_is_read(tmp_path):
    """Its processed tensors and raw fallbacks are in that release's names and shapes; the base is in the source's.
    Decided from the generation alone: the rank's manifest (here, a path with nothing behind it) is not read."""
    import msgspec
    from helpers.synthetic import FINGERPRINT

    from tensorizer_manifest.format import generation as g
    from tensorizer_manifest.vllm_integration.loaders import LoadOptions, _why_not_its_forms

    manifest = g.FileRef(path="generations/none/model.manifest.json", size=1, hash="blake3:" + "0" * 64)
    older = msgspec.structs.replace(FINGERPRINT, vllm_version="0.31.0")
    generation = g.Generation(
        format_version=3,
        id="20261204T000000Z-" + "0" * 32,
        producer="tensorizer-manifest test",
        made_by="save",
        form_sets=[g.FormSet(layout=g.Layout(), fingerprint=older, ranks=[g.RankRef(stem="model", manifest=manifest)])],
    )

    def why(options, fingerprint=FINGERPRINT):
        return _why_not_its_forms(tmp_path, generation, "model", fingerprint, None, options, None)

    assert why(LoadOptions()) == (
        "its form sets at this layout were made by vLLM 0.31.0 (this engine: 0.32.0; `tensorizer-manifest add-form` "
        "on this release adds its own)"
    )
    assert why(LoadOptions(source="base")) == "the load options ask for the base (source='base')"
    from tensorizer_manifest.errors import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError, match="model.manifest.json"):  # the same release: read next
        why(LoadOptions(), older)


@pytest.mark.parametrize("loader", ["ManifestModelLoader", "CaptureModelLoader"])
def test_a_vllm_release_neither_run_nor_read_checked_is_refused_before_anything_is_read(monkeypatch, loader):
    """Both loaders refuse it first: the engine's config is never looked at (None here), no file is opened."""
    from tensorizer_manifest import _vllm_compat
    from tensorizer_manifest.errors import UnsupportedVLLMError
    from tensorizer_manifest.vllm_integration import loaders

    monkeypatch.setattr(_vllm_compat, "vllm_version", lambda: "0.35.0")
    cls = getattr(loaders, loader)
    with pytest.raises(UnsupportedVLLMError, match=r"vLLM 0\.35\.0 is not one tensorizer-manifest supports"):
        cls.load_model(object.__new__(cls), None, None)
