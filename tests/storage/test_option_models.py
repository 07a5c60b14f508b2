"""The option models' shared parts: S3 fields to RemoteOptions, errors that never show a value given."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from tensorizer_manifest.storage.option_models import S3Options, describe_validation_error


def test_s3_fields_become_remote_options_and_the_secret_stays_hidden():
    options = S3Options(s3_access_key_id="AKIDEXAMPLE", s3_secret_access_key="wJalrXUtnFEMI-secret", s3_endpoint="x")
    remote = options.remote()
    assert (remote.access_key_id, remote.secret_access_key, remote.endpoint) == (
        "AKIDEXAMPLE",
        "wJalrXUtnFEMI-secret",
        "x",
    )
    assert "wJalrXUtnFEMI" not in repr(options) and "wJalrXUtnFEMI" not in repr(remote)
    assert S3Options().remote().secret_access_key is None


def test_validation_errors_are_described_without_the_values_given():
    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        s3_endpoint: str | None = None

    with pytest.raises(ValidationError) as exc:
        Options(s3_secret_acces_key="wJalrXUtnFEMI-secret")  # misspelled: refused, value not shown
    text = describe_validation_error(exc.value)
    assert "s3_secret_acces_key" in text and "wJalrXUtnFEMI" not in text


def test_inspect_and_validate_start_without_pydantic_or_torch():
    """They answer in a fraction of a second; pydantic alone costs about 0.2 s to import and set up."""
    code = (
        "import sys, tensorizer_manifest.cli.summary, tensorizer_manifest.storage.checkpoint, "
        "tensorizer_manifest.storage.remote; "
        "print(sorted(m for m in ('pydantic', 'torch', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
