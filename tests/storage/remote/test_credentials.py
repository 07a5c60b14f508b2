"""``storage/remote/credentials.py``: credentials from options, from ~/.s3cfg and from AWS_* variables (against
moto's S3 server on 127.0.0.1), never shown in a repr; the stall timeout in effect and the boto3 client's."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.remote import fresh_prefix, write_model_checkpoint

from tensorizer_manifest._constants import STALL_TIMEOUT_ENV
from tensorizer_manifest.errors import ConfigurationError
from tensorizer_manifest.storage.remote import RemoteDir, RemoteFile, RemoteOptions, credentials
from tensorizer_manifest.storage.remote_checkpoint import upload_checkpoint


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return write_model_checkpoint(tmp_path / "ckpt")


def test_no_repr_or_str_shows_a_credential():
    options = RemoteOptions("AKIAEXAMPLEKEYID", "wJalrXUtnFEMI-secret", "http://127.0.0.1:1")
    for text in (repr(options), str(options), repr(RemoteFile("s3://b/x", options)), str(RemoteDir("s3://b", options))):
        assert "AKIAEXAMPLEKEYID" not in text and "wJalrXUtnFEMI-secret" not in text
    assert "<set>" in repr(options)


def test_credentials_from_s3cfg_and_from_the_environment(moto_s3, checkpoint, tmp_path, monkeypatch):
    uri = fresh_prefix()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / ".s3cfg").write_text(
        f"[default]\naccess_key = {moto_s3.key_id}\nsecret_key = {moto_s3.secret}\n"
        f"host_base = {moto_s3.endpoint.removeprefix('http://')}\nuse_https = False\n"
    )
    upload_checkpoint(checkpoint, uri)  # nothing given: ~/.s3cfg
    assert RemoteDir(uri).list_names()
    (home / ".s3cfg").unlink()
    for name, value in moto_s3.env().items():
        monkeypatch.setenv(name, value)
    assert (RemoteDir(uri) / "config.json").read_bytes() == (checkpoint / "config.json").read_bytes()


def test_the_stall_timeout_setting(monkeypatch):
    monkeypatch.delenv(STALL_TIMEOUT_ENV, raising=False)
    assert RemoteOptions().stall_timeout() == credentials.STALL_TIMEOUT_S == 60.0
    monkeypatch.setenv(STALL_TIMEOUT_ENV, "5")
    assert RemoteOptions().stall_timeout() == 5.0
    options = RemoteOptions("AKIDEXAMPLE", "a-secret-value", "http://127.0.0.1:9", stall_timeout_s=2.5)
    assert options.stall_timeout() == 2.5  # the option before the environment
    assert "stall_timeout_s=2.5" in repr(options) and "a-secret-value" not in repr(options)
    resolved = credentials.resolve(options)
    assert resolved.stall_timeout_s == 2.5
    assert credentials.s3_client(resolved).meta.config.read_timeout == 2.5  # HEADs and listings
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv(STALL_TIMEOUT_ENV, bad)
        with pytest.raises(ConfigurationError, match=STALL_TIMEOUT_ENV):
            RemoteOptions().stall_timeout()
    for bad in (0, -2.0, float("nan"), True):
        with pytest.raises(ConfigurationError, match="stall_timeout_s"):
            RemoteOptions(stall_timeout_s=bad)
