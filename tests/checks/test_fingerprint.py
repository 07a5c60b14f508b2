"""The fingerprint policy: every field has one, documented; what the command line decides."""

from __future__ import annotations

from pathlib import Path

import msgspec
from helpers.synthetic import FINGERPRINT

from tensorizer_manifest.checks.fingerprint import (
    EXACT,
    INFORMATIONAL,
    PROCESSED_ONLY,
    compare,
    normalize_dtype,
    settings_differences,
)
from tensorizer_manifest.format import schema

ROOT = Path(__file__).resolve().parents[2]


def _manifest(replay: str) -> schema.Manifest:
    module = schema.ModuleRecord(path="m", module_class="x.Y", state="processed", replay=replay)
    ref = schema.TensorFileRef(path="t", size=0, tensor_count=0, digest="blake3:" + "0" * 64)
    return schema.Manifest(
        format_version=1, producer="test", fingerprint=FINGERPRINT, tensor_file=ref, modules=[module]
    )


def test_every_fingerprint_field_has_a_written_policy():
    fields = set(schema.Fingerprint.__struct_fields__)
    policies = [*EXACT, *PROCESSED_ONLY, *INFORMATIONAL]
    assert len(policies) == len(set(policies)), "a field has two policies"
    assert set(policies) == fields
    doc = (ROOT / "docs" / "fingerprint-policy.md").read_text()
    for name in fields:
        assert name in doc, f"docs/fingerprint-policy.md does not discuss {name}"


def test_exact_fields_always_matter_and_informational_never():
    current = msgspec.structs.replace(FINGERPRINT, dtype="float16", torch_version="9.9", vllm_version="0.99")
    assert compare(FINGERPRINT, current, _manifest("none")) == [("dtype", "bfloat16", "float16")]


def test_kernel_fields_matter_when_a_processed_layer_depends_on_a_kernel():
    current = msgspec.structs.replace(FINGERPRINT, vllm_version="0.99")
    assert compare(FINGERPRINT, current, _manifest("cpu_unquantized_gemm")) == []  # kernel-independent restorer
    assert compare(FINGERPRINT, current, _manifest("a_restorer_this_version_lacks")) == [
        ("vllm_version", "0.32.0", "0.99")
    ]


def test_settings_differences_use_vllms_dtype_names():
    assert normalize_dtype("bf16") == "bfloat16" and normalize_dtype("torch.float16") == "float16"
    assert settings_differences(FINGERPRINT, dtype="bf16", quantization="none", tensor_parallel_size=1) == []
    assert settings_differences(FINGERPRINT, dtype="auto", pipeline_parallel_size=2) == [
        ("pipeline_parallel_size", 1, 2)
    ]


def _engine(**changes):
    """vLLM's own config objects at their defaults (the parts ``unrecorded_settings`` reads), with ``changes``."""
    from types import SimpleNamespace

    from vllm.config import CacheConfig, KernelConfig, ParallelConfig

    engine = SimpleNamespace(cache_config=CacheConfig(), parallel_config=ParallelConfig(), kernel_config=KernelConfig())
    engine.model_config = SimpleNamespace(hf_overrides={})  # a ModelConfig needs a model; its default is {}
    for path, value in changes.items():
        part, name = path.split("__")
        setattr(getattr(engine, part), name, value)
    return engine


def test_an_engine_at_vllms_defaults_has_no_unrecorded_setting_and_each_default_is_vllms():
    from tensorizer_manifest.checks.fingerprint import UNRECORDED_SETTINGS, unrecorded_settings

    assert unrecorded_settings(_engine()) == {}
    assert set(UNRECORDED_SETTINGS) >= {"kv_cache_dtype_skip_layers", "expert_placement_strategy"}
    # the placement places nothing without expert parallelism
    assert unrecorded_settings(_engine(parallel_config__expert_placement_strategy="round_robin")) == {}
    overridden = _engine(model_config__hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert unrecorded_settings(overridden) == {"hf_overrides": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}}
    placed = _engine(
        parallel_config__enable_expert_parallel=True, parallel_config__expert_placement_strategy="round_robin"
    )
    assert unrecorded_settings(placed) == {"expert_placement_strategy": "round_robin"}


def test_a_setting_the_manifest_does_not_record_is_refused_at_save_and_at_load(monkeypatch):
    import pytest

    from tensorizer_manifest.checks.fingerprint import refuse_unrecorded_settings, unrecorded_settings
    from tensorizer_manifest.errors import CompatibilityError, ConfigurationError

    skipping = _engine(cache_config__kv_cache_dtype_skip_layers=["0", "sliding_window"])
    assert unrecorded_settings(skipping) == {"kv_cache_dtype_skip_layers": ["0", "sliding_window"]}
    with pytest.raises(ConfigurationError, match=r"kv_cache_dtype_skip_layers=\['0', 'sliding_window'\]"):
        refuse_unrecorded_settings(skipping, None, "out")
    with pytest.raises(CompatibilityError, match="saved at vLLM's default") as refused:
        refuse_unrecorded_settings(skipping, _manifest("none"), "ckpt")  # EXACT: whatever the layers hold
    assert refused.value.differences == [("kv_cache_dtype_skip_layers", "vLLM's default", ["0", "sliding_window"])]

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    kernels = _engine(kernel_config__linear_backend_per_quant={"int8_w8a8": "torch"})
    assert set(unrecorded_settings(kernels)) == {"linear_backend_per_quant", "VLLM_BATCH_INVARIANT"}
    refuse_unrecorded_settings(kernels, _manifest("cpu_unquantized_gemm"), "ckpt")  # no kernel-specific layer
    with pytest.raises(CompatibilityError, match="linear_backend_per_quant"):
        refuse_unrecorded_settings(kernels, _manifest("a_restorer_this_version_lacks"), "ckpt")
