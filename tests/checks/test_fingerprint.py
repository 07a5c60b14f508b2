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
