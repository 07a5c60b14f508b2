"""The layout-free base (#34) of quantized and MoE models: W8A8 (int8) and Qwen3-MoE saved at TP=1 load at TP=2
through the base, as vLLM's default loader loads their source at TP=2 (tokens and every rank's whole state)."""

from __future__ import annotations

import pytest
from conftest import run_script
from test_e2e_base_layouts import loaded_from_the_base, same_as_the_default_loader

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def quantized(e2e_dir):
    return run_script("scenarios/base_layouts.py", str(e2e_dir), "quantized", marker="BASE_RESULT", timeout=1800)


@pytest.mark.parametrize("kind", ["w8a8-int8", "qwen3-moe"])
def test_saved_at_tp1_loads_at_tp2_through_the_base_token_exact(quantized, kind):
    same_as_the_default_loader(quantized[kind])
    reports = loaded_from_the_base(quantized[kind])
    assert len(reports) == 2
