"""``storage/remote/uris.py``: which URIs are remote and accepted (never one with a credential inside), and
which files of a model directory are not weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorizer_manifest.errors import ConfigurationError
from tensorizer_manifest.storage.remote import RemoteDir, RemoteFile, is_model_file, is_remote


def test_uris_are_recognised_and_refused_with_credentials_inside():
    assert is_remote("s3://bucket/p") and is_remote("HTTPS://host/p") and is_remote("http://h/x")
    assert not is_remote("./s3/bucket") and not is_remote(Path("s3://x")) and not is_remote("file:///x")
    with pytest.raises(ConfigurationError) as exc:
        RemoteDir("https://user:hunter2-password@host/prefix")
    assert "hunter2" not in str(exc.value) and "credentials may not be part of the URI" in str(exc.value)
    with pytest.raises(ConfigurationError):
        RemoteFile("https://host/model.manifest.json?X-Amz-Signature=abc")
    with pytest.raises(ConfigurationError):
        RemoteDir("s3:///no-bucket")


def test_model_files_are_config_not_weights():
    assert is_model_file("config.json") and is_model_file("tokenizer.model")
    for name in ("model.safetensors", "model.abc.tensors", "model.manifest.json", ".hidden", "pytorch_model.bin"):
        assert not is_model_file(name)
