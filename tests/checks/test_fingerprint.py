"""The fingerprint policy: every field has one, documented; what the command line decides."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
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


# -- vLLM's weight-cache key (WeightCacheKey), whose fields the fingerprint follows --------------------------------

#: Each field of vLLM's ``WeightCacheKey`` (0.31-0.34) and what of a checkpoint answers for it: a ``Fingerprint``
#: field, a setting saved only at vLLM's default (``UNRECORDED_SETTINGS``), or, in words, why neither is needed.
_CACHE_KEY_FIELDS = {
    "checkpoint": "the generation holds the model's files by their hashes",
    "model_arch": "architectures",
    "tp_size": "tensor_parallel_size",
    "tp_rank": "tensor_parallel_rank",
    "dtype": "dtype",
    "quantization": "quantization",
    "quant_config_hash": "quant_config_hash",
    "rope_parameters_hash": "hf_overrides",  # config.json's rope parameters are the generation's own file's
    "kv_cache_dtype": "kv_cache_dtype",
    "kv_cache_dtype_skip_layers": "kv_cache_dtype_skip_layers",
    "revision": "revision",
    "vllm_version": "vllm_version",
    "pp_size": "pipeline_parallel_size",
    "pp_rank": "pipeline_parallel_rank",
    "is_draft": "a draft model is another model, loaded from its own checkpoint",
    "dp_size": "data_parallel_size",
    "dp_rank": "data_parallel_rank",
    "enable_expert_parallel": "expert_parallel",
    "expert_placement_strategy": "expert_placement_strategy",
    "moe_backend": "moe_backend",
    "linear_backend": "linear_backend",
    "linear_backend_per_quant": "linear_backend_per_quant",
}


def _cache_key_fields(where: Path) -> list[str]:
    """The fields of ``WeightCacheKey`` in the vLLM sources at ``where`` (a wheel, or an installed tree), read."""
    import ast

    from helpers.release_check import load_release_check

    sources = load_release_check().sources_at(where)
    try:
        tree = sources.tree("vllm.model_executor.model_loader.weight_cache.protocol")
    finally:
        sources.close()
    [key] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "WeightCacheKey"]
    return [node.target.id for node in key.body if isinstance(node, ast.AnnAssign)]


def _answered(fields: list[str]) -> list[str]:
    """The fields of the key that nothing of a checkpoint answers for."""
    from tensorizer_manifest.checks.fingerprint import UNRECORDED_SETTINGS

    recorded = set(schema.Fingerprint.__struct_fields__) | set(UNRECORDED_SETTINGS)
    return [
        field
        for field in fields
        if field not in _CACHE_KEY_FIELDS
        or (" " not in _CACHE_KEY_FIELDS[field] and _CACHE_KEY_FIELDS[field] not in recorded)
    ]


def test_every_field_of_the_installed_vllms_weight_cache_key_is_answered():
    """A processed tensor is only as reusable as vLLM's own cache key says: each of its fields is recorded in the
    fingerprint, refused away from vLLM's default, or needs neither (the test names why)."""
    vllm = pytest.importorskip("vllm")
    fields = _cache_key_fields(Path(vllm.__file__).parent.parent)
    assert {"tp_rank", "quant_config_hash", "vllm_version"} <= set(fields)
    assert _answered(fields) == []


@pytest.mark.e2e
@pytest.mark.parametrize("release", ["0.33", "0.34"])
def test_every_field_of_a_read_checked_releases_weight_cache_key_is_answered(release):
    """vLLM 0.33's key added the rope parameters, the KV-cache dtype and its skipped layers, expert placement and
    the kernel backends (0.34 kept them): each is answered, read in the release's wheel."""
    from helpers.release_check import load_release_check

    release_check = load_release_check()
    try:
        wheel = release_check.fetch_wheel(f"{release}.0", release_check.DEFAULT_CACHE)
    except release_check.NoWheel as exc:
        pytest.skip(str(exc))
    fields = _cache_key_fields(wheel)
    assert {"rope_parameters_hash", "kv_cache_dtype_skip_layers", "linear_backend_per_quant"} <= set(fields)
    assert _answered(fields) == []
