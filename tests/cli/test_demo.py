"""The main job of README.md: the demo on the embedded tiny model, the installed script typed on a terminal."""

from __future__ import annotations

import pytest
from helpers.terminal import typed


@pytest.mark.e2e
def test_demo_tells_its_story_without_vllm_info_logs(e2e_dir):
    """README's main job (``make demo`` runs the installed script), on a real terminal where rich draws: the tiny
    model round trip, token for token, and vLLM's INFO lines kept out of it where the user set no level."""
    shown = typed("demo", "--kind", "llama", "--work-dir", str(e2e_dir), "--max-tokens", "8",
                  env={"VLLM_LOGGING_LEVEL": None}, timeout=900)  # fmt: skip
    assert shown.returncode == 0, shown.output[-4000:]
    assert "token-for-token identical to vLLM's default loader" in shown.flat, shown.output[-4000:]
    assert "INFO" not in shown.output and "Initializing a V1 LLM engine" not in shown.output, shown.output[-4000:]
    assert "Traceback" not in shown.output and "WARNING" not in shown.output, shown.output[-4000:]
