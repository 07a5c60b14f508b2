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


def test_no_checkpoint_an_eager_engine_an_s3_checkpoint_or_a_layout_option_are_refused(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="not a tensorizer-manifest checkpoint"):
        add_form(tmp_path, compile=True)
    checkpoint = shutil.copytree(FIXTURES / "v3-checkpoint", tmp_path / "ckpt")
    with pytest.raises(ConfigurationError, match="enforce_eager is off"):
        add_form(checkpoint, compile=True, engine_args={"enforce_eager": True})
    with pytest.raises(ConfigurationError, match="writes a local checkpoint"):
        add_form("s3://bucket/prefix", compile=True)
    with pytest.raises(ConfigurationError, match="layout from engine_args"):
        add_form(checkpoint, compile=True, tensor_parallel_size=2)
