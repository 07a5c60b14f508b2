"""The main job of README.md: the demo on the embedded tiny model, through the CLI as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "tensorizer_manifest.cli"]


@pytest.mark.e2e
def test_demo_tells_its_story_without_vllm_info_logs(e2e_dir):
    """README's main job: the tiny model round trip, token for token, and vLLM's INFO lines kept out of it."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    proc = subprocess.run(
        [*CLI, "demo", "--kind", "llama", "--work-dir", str(e2e_dir), "--max-tokens", "8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "token-for-token identical to vLLM's default loader" in proc.stdout
    assert "INFO" not in out and "Initializing a V1 LLM engine" not in out, out[-4000:]
