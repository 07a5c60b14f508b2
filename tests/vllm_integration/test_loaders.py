"""The loaders vLLM calls, without starting an engine: what they refuse before anything is read, and that a
tensor file ``tensorizer_uri`` names is the one its manifest names (the options themselves: ``load/test_options``)."""

from __future__ import annotations

import pytest

from tensorizer_manifest.errors import ConfigurationError

pytest.importorskip("vllm")


def test_a_tensorizer_uri_must_be_a_tensor_file_its_manifest_names(tmp_path):
    from helpers.synthetic import write_synthetic_checkpoint

    from tensorizer_manifest.storage.checkpoint import check_named_tensor_file, load_manifest

    manifest, path = load_manifest(write_synthetic_checkpoint(tmp_path / "ckpt"))
    check_named_tensor_file(manifest, path, manifest.tensor_file.path)
    with pytest.raises(
        ConfigurationError, match=f"names model.tensors.*names its tensor file {manifest.tensor_file.path}"
    ):
        check_named_tensor_file(manifest, path, "model.tensors")


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
