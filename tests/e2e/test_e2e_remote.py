"""Remote checkpoints on real vLLM: saved to S3 (moto's server on 127.0.0.1), inspected, validated and
loaded from there and from plain HTTP, token-exact against vLLM's default loader; a server that stops
halfway through the tensor file is a typed error and no engine; no credential in any output or object.

One scenario process (five engine starts) serves every test here.
"""

from __future__ import annotations

import re

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def remote_result(e2e_dir, moto_s3) -> dict:
    return run_script(
        "scenarios/remote.py",
        str(e2e_dir),
        marker="REMOTE_RESULT",
        timeout=1500,
        env={
            "TM_TEST_S3_ENDPOINT": moto_s3.endpoint,
            "TM_TEST_S3_KEY_ID": moto_s3.key_id,
            "TM_TEST_S3_SECRET": moto_s3.secret,
            "VLLM_LOGGING_LEVEL": "DEBUG",  # the credentials' test: none shown at DEBUG either
        },  # fmt: skip
        output=True,
    )


def test_s3_round_trip_is_token_exact(remote_result):
    r = remote_result
    assert r["saved_to"] == r["uri"]
    assert {"config.json", "model.manifest.json"} <= set(r["objects"])
    assert any(name.endswith(".tensors") for name in r["objects"])
    assert re.fullmatch(
        re.escape(r["uri"]) + r"/generations/[0-9TZ]+-[0-9a-f]{32}/model\.manifest\.json", r["inspect"]["manifest"]
    )
    assert r["inspect"]["layers"] > 0
    assert r["validate"]["ok"], r["validate"]["problems"]
    assert r["validate"]["hashes_checked"] == r["validate"]["stored"] > 0
    assert "config.json" in r["fetched_s3"] and not any(
        n.endswith((".tensors", ".json.manifest")) for n in r["fetched_s3"]
    )
    assert "model.manifest.json" not in r["fetched_s3"]
    assert r["s3_bytes_read"] > 0
    assert len(r["reference_tokens"]) >= 3
    assert r["s3_tokens"] == r["reference_tokens"]


def test_http_load_is_token_exact(remote_result):
    r = remote_result
    assert "config.json" in r["fetched_http"]
    assert r["http_validate_ok"]
    assert r["http_tokens"] == r["reference_tokens"]


def test_server_stopping_mid_read_is_a_typed_error_and_no_engine(remote_result):
    cut = remote_result["cut"]
    assert cut["engine_started"] is False
    ours = [link for link in cut["chain"] if "RemoteStorageError" in link["mro"]]
    assert ours, cut["chain"]
    assert "cut short" in ours[0]["message"] or "closed the connection" in ours[0]["message"]


def test_no_credential_in_any_output_or_object(remote_result, moto_s3):
    """``LLM(...)`` with the key id and secret in ``model_loader_extra_config``, at VLLM_LOGGING_LEVEL=DEBUG: vLLM
    logs its engine arguments with that dict (redacted), and nothing the process prints shows either."""
    assert remote_result["secret_in_objects"] is False
    output = remote_result["_output"]
    assert "Loading weights with tensorizer_manifest" in output  # the logs were captured
    assert " DEBUG " in output  # at DEBUG
    assert "'s3_access_key_id': '***', 's3_secret_access_key': '***'" in output  # vLLM's non-default args
    for credential in (moto_s3.secret, moto_s3.key_id):
        at = output.find(credential)
        assert at < 0, output[max(0, at - 600) : at + 100]
