"""Every crafted bad input is refused by `validate` (API and CLI) with its typed error and gist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from helpers.bad_inputs import BAD_INPUTS
from helpers.synthetic import FINGERPRINT, write_synthetic_checkpoint

from tensorizer_manifest import errors
from tensorizer_manifest.checkpoint import load_manifest
from tensorizer_manifest.validate import check_engine_settings, check_files, validate_checkpoint


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("pristine") / "ckpt")


def _damaged(pristine, tmp_path, case):
    d = tmp_path / "ckpt"
    shutil.copytree(pristine, d, symlinks=True)
    case.mutate(d)
    return d


def test_the_catalog_is_large_enough():
    assert len(BAD_INPUTS) >= 30
    assert len({c.name for c in BAD_INPUTS}) == len(BAD_INPUTS)


def test_pristine_checkpoint_is_valid(pristine):
    report = validate_checkpoint(pristine)
    assert report.ok, report.problems
    assert report.hashes_checked == report.stored > 0


@pytest.mark.parametrize("case", [c for c in BAD_INPUTS if c.scope == "offline"], ids=str)
def test_validate_refuses(pristine, tmp_path, case):
    d = _damaged(pristine, tmp_path, case)
    report = validate_checkpoint(d)
    assert not report.ok
    kinds = {p.kind.__name__ for p in report.problems}
    assert case.error in kinds, report.problems
    assert any(re.search(case.gist, str(p)) for p in report.problems if p.kind.__name__ == case.error), report.problems


@pytest.mark.parametrize("case", [c for c in BAD_INPUTS if c.scope == "offline"], ids=str)
def test_loader_checks_refuse_before_reading_weights_or_hashes_catch_it(pristine, tmp_path, case):
    """What the vLLM loader runs before building the model; data damage is caught by hashes while reading."""
    d = _damaged(pristine, tmp_path, case)
    expected = getattr(errors, case.error)
    with pytest.raises(errors.TensorizerManifestError) as info:
        manifest, path = load_manifest(d)
        check_files(manifest, path)
        report = validate_checkpoint(d)  # the content hashes, which the loader checks as it reads
        report.raise_for_problems()
    assert isinstance(info.value, expected), info.value
    assert re.search(case.gist, str(info.value)), str(info.value)


@pytest.mark.parametrize("case", [c for c in BAD_INPUTS if c.scope == "engine"], ids=str)
def test_validate_with_engine_settings_refuses(pristine, tmp_path, case):
    d = _damaged(pristine, tmp_path, case)
    assert validate_checkpoint(d).ok  # nothing is wrong with the files themselves
    problems = check_engine_settings(
        next(d.glob("*.manifest.json")),
        dtype=FINGERPRINT.dtype,
        quantization="none",
        tensor_parallel_size=FINGERPRINT.tensor_parallel_size,
    )
    assert [p.kind.__name__ for p in problems] == [case.error]
    assert re.search(case.gist, str(problems[0]))


@pytest.mark.parametrize(
    "case", [c for c in BAD_INPUTS if c.name in ("tensor-data-flipped", "manifest-not-json", "path-absolute")], ids=str
)
def test_validate_cli_one_line_per_problem_and_exit_1(pristine, tmp_path, case):
    d = _damaged(pristine, tmp_path, case)
    proc = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(d)],
        capture_output=True,
        text=True,
        env={"COLUMNS": "300", "PATH": ""},
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and case.error in proc.stderr
    as_json = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(d), "--json"], capture_output=True, text=True
    )
    assert as_json.returncode == 1
    doc = json.loads(as_json.stdout)
    assert doc["ok"] is False and any(p["error"] == case.error for p in doc["problems"])


def test_validate_cli_exit_codes(pristine, tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(pristine)], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    usage = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", "--no-such-flag", str(pristine)],
        capture_output=True,
        text=True,
    )
    assert usage.returncode == 2


@pytest.mark.e2e
def test_vllm_loader_refuses_every_bad_input_and_serves_nothing(scenarios, tmp_path):
    """The real loader, inside a real engine, on a checkpoint saved by real vLLM (W8A8: raw and processed layers)."""
    from conftest import run_script
    from helpers.bad_inputs import MODEL_BAD_INPUTS

    checkpoint = scenarios.e2e("w8a8-int8")["checkpoint"]
    results = run_script(
        "scenarios/bad_inputs_loader.py", checkpoint, str(tmp_path), marker="LOADER_RESULT", timeout=1800
    )
    cases = BAD_INPUTS + MODEL_BAD_INPUTS
    assert set(results) == {c.name for c in cases}
    for case in cases:
        outcome = results[case.name]
        assert outcome["tokens"] is None, f"{case}: tokens were served from a damaged checkpoint"
        assert outcome["error"] == case.error, (case.name, outcome)
        assert re.search(case.gist, outcome["message"]), (case.name, outcome["message"])
