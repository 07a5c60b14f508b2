"""Verification records: written and read back as JSON, damaged files named, only passing records count."""

from __future__ import annotations

import pytest

from tensorizer_manifest.errors import ManifestError
from tensorizer_manifest.format import verification_records as verification
from tensorizer_manifest.format.verification_records import (
    VerificationRecord,
    load_records,
    read_records,
    write_records,
)


def _record(**changes) -> VerificationRecord:
    fields = dict(
        restorer="cpu_wna16",
        result="pass",
        device_type="cuda",
        device_name="NVIDIA H200",
        device_capability="9.0",
        vllm_version="0.32.0",
        tensorizer_manifest_version="0.3.0",
        model="tiny gptq-w4",
        layers=8,
        kernel_classes=["vllm.model_executor.kernels.linear.mixed_precision.marlin.MarlinLinearKernel"],
        form=[{"use_w4a8": False}],
        date="2026-11-30",
    )
    fields.update(changes)
    return VerificationRecord(**fields)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(verification.VERIFIED_DIR_ENV, str(tmp_path / "verified"))
    verification._passing.cache_clear()
    yield tmp_path / "verified"
    verification._passing.cache_clear()


def test_records_round_trip_and_a_passing_one_verifies_its_device_kind(user_dir):
    assert not verification.recorded_verified("cpu_wna16", "cuda")
    path = write_records([_record()], user_dir / "h200.json")
    assert read_records(path) == [_record()]
    assert _record() in load_records()
    assert verification.recorded_verified("cpu_wna16", "cuda")
    assert not verification.recorded_verified("cpu_wna16", "rocm")
    assert not verification.recorded_verified("cpu_unquantized_moe", "cuda")


def test_a_failing_record_verifies_nothing(user_dir):
    write_records([_record(result="fail", detail="tokens differ")], user_dir / "failed.json")
    assert not verification.recorded_verified("cpu_wna16", "cuda")


def test_a_damaged_records_file_is_named(user_dir):
    user_dir.mkdir(parents=True)
    (user_dir / "bad.json").write_text('[{"restorer": "x"}]')
    with pytest.raises(ManifestError, match="bad.json: not a list of verification records"):
        load_records()


def test_the_user_folder_follows_xdg_when_not_set(monkeypatch, tmp_path):
    monkeypatch.delenv(verification.VERIFIED_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert verification.user_records_dir() == tmp_path / "tensorizer-manifest" / "verified"
