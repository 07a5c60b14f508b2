"""``add-form --compile`` refuses what it cannot make a compile form of before an engine starts (the e2e tests
make and use real ones: ``tests/e2e/test_e2e_compile_forms.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tensorizer_manifest.errors import CheckpointNotFoundError, ConfigurationError
from tensorizer_manifest.save.add_form import add_form

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_a_checkpoint_of_format_version_2_is_refused_with_what_to_do(tmp_path):
    checkpoint = shutil.copytree(FIXTURES / "v2-checkpoint", tmp_path / "ckpt")
    with pytest.raises(ConfigurationError, match="format version 3; save it again"):
        add_form(checkpoint, compile=True)


def test_no_checkpoint_an_eager_engine_or_a_layout_given_twice_are_refused(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="not a tensorizer-manifest checkpoint"):
        add_form(tmp_path, compile=True)
    checkpoint = shutil.copytree(FIXTURES / "v3-checkpoint", tmp_path / "ckpt")
    with pytest.raises(ConfigurationError, match="enforce_eager is off"):
        add_form(checkpoint, compile=True, engine_args={"enforce_eager": True})
    with pytest.raises(ConfigurationError, match="tensor_parallel_size is given twice, as 2 and in engine_args as 1"):
        add_form(checkpoint, compile=True, tensor_parallel_size=2, engine_args={"tensor_parallel_size": 1})
    with pytest.raises(ConfigurationError, match="the s3_\\* options are for an s3:// checkpoint"):
        add_form(checkpoint, compile=True, s3_endpoint="http://127.0.0.1:1")
    with pytest.raises(ConfigurationError, match="for_server is an option of compile forms"):
        add_form(checkpoint, for_server=True)


def test_an_http_checkpoint_is_refused_and_an_s3_one_of_an_older_format_names_what_to_do(moto_s3, tmp_path):
    from helpers.remote import fresh_prefix, options_for

    from tensorizer_manifest.storage.remote_checkpoint import upload_checkpoint

    with pytest.raises(ConfigurationError, match="only s3:// checkpoints can be written"):
        add_form("https://example.invalid/ckpt", compile=True)
    uri = fresh_prefix("compile-v2")
    upload_checkpoint(FIXTURES / "v2-checkpoint", uri, options_for(moto_s3))
    remote = options_for(moto_s3)
    credentials = {"s3_access_key_id": remote.access_key_id, "s3_secret_access_key": remote.secret_access_key}
    with pytest.raises(CheckpointNotFoundError, match="not a checkpoint of format version 3"):
        add_form(uri, compile=True, s3_endpoint=remote.endpoint, **credentials)
