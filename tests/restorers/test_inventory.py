"""The kernel inventory, built from the installed vLLM: classes found, strategies, status, Markdown."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tensorizer_manifest.restorers.inventory import (  # noqa: E402
    STRATEGY_NONE,
    STRATEGY_RAW,
    STRATEGY_RESTORER,
    STRATEGY_VLLM_BRANCH,
    build_inventory,
    to_markdown,
)

ROOT = Path(__file__).resolve().parents[2]


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
    # the CPU int8 linear layers have a step and no restorer (oneDNN keeps their weight); int8 MoE has ours.
    assert _entry(inventory, "quantization.mxfp4.Mxfp4MoEMethod").strategy == STRATEGY_VLLM_BRANCH
    int8 = [e for e in inventory.entries if "W8A8Int8" in e.vllm_class or "Int8ScaledMM" in e.vllm_class]
    int8 = [e for e in int8 if e.strategy != STRATEGY_NONE]  # the abstract Int8ScaledMMLinearKernel has none
    moe = [e for e in int8 if e.vllm_class.endswith("CompressedTensorsW8A8Int8MoEMethod")]
    assert [(e.strategy, e.restorer) for e in moe] == [(STRATEGY_RESTORER, "cpu_int8_moe")], moe
    linear = [e for e in int8 if e not in moe]
    assert linear and all(e.strategy == STRATEGY_RAW and e.status == "-" for e in linear), linear
    assert any(e.strategy == STRATEGY_NONE for e in inventory.entries)
    families = {e.family for e in inventory.entries}
    assert {"quant method", "moe experts", "attention", "kv cache", "mixed-precision linear kernel"} <= families


def test_scaled_mm_and_block_scaled_kernels_have_their_families(inventory):
    # The W8A8 int8 layers' kernel on CPU keeps its processed weight in a oneDNN handle: raw only.
    cpu_int8 = _entry(inventory, "scaled_mm.cpu.CPUInt8ScaledMMLinearKernel")
    assert (cpu_int8.family, cpu_int8.strategy, cpu_int8.status) == ("scaled-mm linear kernel", STRATEGY_RAW, "-")
    for suffix in (
        "scaled_mm.marlin.MarlinFP8ScaledMMLinearKernel",
        "scaled_mm.cutlass.CutlassFP8ScaledMMLinearKernel",
    ):
        assert _entry(inventory, suffix).family == "scaled-mm linear kernel"
    for suffix in ("scaled_mm.cpu.CPUFp8BlockScaledMMKernel", "scaled_mm.deep_gemm.DeepGemmFp8BlockScaledMMKernel"):
        assert _entry(inventory, suffix).family == "block-scaled linear kernel"


def test_a_class_with_a_step_in_no_family_is_listed_as_other(inventory):
    # A parameter and a transform module define a step of their own and derive from no family's base.
    for suffix in ("parameter.SharedWeightParameter", "transform.module.HadamardTransform"):
        assert (_entry(inventory, suffix).family, _entry(inventory, suffix).strategy) == ("other", STRATEGY_RAW)


def test_the_published_inventory_is_what_this_vllm_generates(inventory):
    """docs/kernels-inventory.md is generated (`tensorizer-manifest kernels --markdown`); regenerate it."""
    published = (ROOT / "docs" / "kernels-inventory.md").read_text()
    shown = type(inventory)(inventory.vllm_version, [e for e in inventory.entries if e.strategy != STRATEGY_NONE], [])
    rows = [line for line in to_markdown(shown).splitlines() if line.startswith("| ")]
    assert rows == [line for line in published.splitlines() if line.startswith("| ")]


#: Where the installed vLLM defines ``process_weights_after_loading`` (``grep -rl "def process_weights_after_loading"``
#: over the package): model_executor (layers, kernels, parameters, the models' own hooks), v1.attention (the
#: backends' impls) and models (the per-model packages, with model-level hooks and their own attention layers).
STEP_PACKAGES = ("vllm.model_executor", "vllm.v1.attention", "vllm.models")


def _classes_defining_a_step() -> tuple[dict[str, type], list[str]]:
    """Every class whose own body defines ``process_weights_after_loading``, from a walk of our own (not
    kernels.py's), and the modules that do not import here."""
    found: dict[str, type] = {}
    unimportable: list[str] = []
    for root in STEP_PACKAGES:
        package = importlib.import_module(root)
        names = [root] + [m.name for m in pkgutil.walk_packages(package.__path__, root + ".", unimportable.append)]
        for name in names:
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - kernels for other hardware (cutlass, flashinfer, aiter, torchvision...)
                unimportable.append(name)
                continue
            for cls in vars(module).values():
                if isinstance(cls, type) and cls.__module__ == name and "process_weights_after_loading" in cls.__dict__:
                    found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found, sorted(set(unimportable))


def test_every_vllm_class_that_defines_a_post_load_step_is_in_the_inventory(inventory, monkeypatch):
    """The inventory misses no class: an independent walk of vLLM's packages finds none it lacks."""
    from vllm.platforms import current_platform

    if not current_platform.is_rocm() and "vllm.platforms.rocm" not in sys.modules:
        # ROCm's platform module imports vllm._C again; on an x86 CPU build that loaded _C_AVX2 or _C_AVX512
        # that registers the _C op library twice and aborts the process. Off ROCm, its importers cannot run.
        monkeypatch.setitem(sys.modules, "vllm.platforms.rocm", None)
    start = time.monotonic()
    found, unimportable = _classes_defining_a_step()
    print(f"walked in {time.monotonic() - start:.1f} s; {len(unimportable)} modules do not import here:", unimportable)
    assert "vllm.model_executor.kernels.linear.scaled_mm.cpu.CPUInt8ScaledMMLinearKernel" in found, "walk too narrow"
    listed = {e.vllm_class for e in inventory.entries}
    missing = sorted(set(found) - listed)
    assert not missing, f"{len(missing)} classes with a post-load step are not in the inventory: {missing}"
