"""`validate --engine`: the loader's pre-weight checks on the model vLLM would build (meta device, no weights)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_a_pristine_checkpoint_passes_the_engine_check(scenarios):
    checkpoint = scenarios.e2e("llama")["checkpoint"]
    proc = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", checkpoint, "--engine", "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["ok"] is True


def test_validate_engine_option_sees_a_renamed_kernel(scenarios, tmp_path):
    from helpers.bad_inputs import MODEL_BAD_INPUTS
    from helpers.checkpoints import copy_as_version_2

    case = next(c for c in MODEL_BAD_INPUTS if c.name == "renamed-kernel")
    # Saved without a base: a version-2 copy (whose manifest may be edited) has no base to feed layers from.
    saved, d = tmp_path / "saved", tmp_path / "ckpt"
    model_dir = scenarios.e2e("llama")["model_dir"]
    save = [sys.executable, "-m", "tensorizer_manifest.cli", "save", model_dir, str(saved), "--base", "none"]
    subprocess.run(save + ["--dtype", "bfloat16"], check=True, capture_output=True)
    copy_as_version_2(saved, d)
    case.mutate(d)
    offline = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(d)], capture_output=True, text=True
    )
    assert offline.returncode == 0, offline.stderr  # the files are fine
    proc = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(d), "--engine", "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert [p["error"] for p in doc["problems"]] == ["CompatibilityError"]
    assert "layer.impl" in doc["problems"][0]["message"]
