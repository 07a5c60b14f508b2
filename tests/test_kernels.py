"""The kernel inventory, built from the installed vLLM: classes found, strategies, status, Markdown."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tensorizer_manifest.kernels import (  # noqa: E402
    STRATEGY_NONE,
    STRATEGY_RAW,
    STRATEGY_RESTORER,
    STRATEGY_VLLM_BRANCH,
    build_inventory,
    to_markdown,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def inventory():
    return build_inventory()


def _entry(inventory, suffix):
    matches = [e for e in inventory.entries if e.vllm_class.endswith(suffix)]
    assert len(matches) == 1, (suffix, matches)
    return matches[0]


def test_the_cpu_classes_our_restorers_replay_are_verified_on_cpu(inventory):
    for suffix, restorer in [
        ("mixed_precision.cpu.CPUWNA16LinearKernel", "cpu_wna16"),
        ("auto_gptq.AutoGPTQLinearMethod", "cpu_wna16"),
        ("unquantized_fused_moe_method.UnquantizedFusedMoEMethod", "cpu_unquantized_moe"),
        ("cpu_moe.X86CPUUnquantizedExperts", "cpu_unquantized_moe"),
        ("linear.UnquantizedLinearMethod", "cpu_unquantized_gemm"),
        ("compressed_tensors.CompressedTensorsKVCacheMethod", "attention_scales"),
    ]:
        entry = _entry(inventory, suffix)
        assert (entry.strategy, entry.restorer, entry.status) == (STRATEGY_RESTORER, restorer, "verified on cpu")


def test_other_strategies_are_read_from_vllm_code(inventory):
    # MXFP4 MoE has vLLM's own pre-processed branch (and no restorer of ours: its kernels hold opaque objects);
    # the CPU int8 method has a step and no restorer.
    assert _entry(inventory, "quantization.mxfp4.Mxfp4MoEMethod").strategy == STRATEGY_VLLM_BRANCH
    int8 = [e for e in inventory.entries if "W8A8Int8" in e.vllm_class or "Int8ScaledMM" in e.vllm_class]
    assert int8 and all(e.strategy == STRATEGY_RAW and e.status == "-" for e in int8), int8
    assert any(e.strategy == STRATEGY_NONE for e in inventory.entries)
    families = {e.family for e in inventory.entries}
    assert {"quant method", "moe experts", "attention", "kv cache", "linear kernel"} <= families


def test_the_published_inventory_is_what_this_vllm_generates(inventory):
    """docs/kernels-inventory.md is generated (`tensorizer-manifest kernels --markdown`); regenerate it."""
    published = (ROOT / "docs" / "kernels-inventory.md").read_text()
    shown = type(inventory)(inventory.vllm_version, [e for e in inventory.entries if e.strategy != STRATEGY_NONE], [])
    rows = [line for line in to_markdown(shown).splitlines() if line.startswith("| ")]
    assert rows == [line for line in published.splitlines() if line.startswith("| ")]
