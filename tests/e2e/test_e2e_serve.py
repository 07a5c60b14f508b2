"""The OpenAI-compatible server loads a checkpoint with --load-format tensorizer_manifest (e2e, loopback only)."""

from __future__ import annotations

import json

import pytest
from helpers.openai_server import Server

from tensorizer_manifest.embedded_models.tiny import DEMO_PROMPTS

pytestmark = pytest.mark.e2e


#: Given to the second server, whose checkpoint is local: they go unused, and must not be printed.
SERVER_CREDENTIALS = {"s3_access_key_id": "AKIASERVEKEYID000042", "s3_secret_access_key": "serve-secret-8b7a6c5d4e"}


@pytest.fixture(scope="module")
def served(e2e_dir, tmp_path_factory) -> dict:
    """`vllm serve` with vLLM's default loader, the worker extension and VLLM_SERVER_DEV_MODE=1 answers the demo
    prompts (the reference) and saves itself with one POST to /collective_rpc; then `vllm serve` on what it
    wrote, with --load-format tensorizer_manifest (and S3 credentials, at DEBUG), answers them again. Two server
    starts for the three tests."""
    from tensorizer_manifest import WORKER_EXTENSION
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    model = str(build_tiny_model(e2e_dir / "tiny-llama", "llama"))
    logs = tmp_path_factory.mktemp("serve")
    out = logs / "saved-by-the-server"
    flags = ("--worker-extension-cls", WORKER_EXTENSION)
    with Server(model, logs / "default.log", *flags, env={"VLLM_SERVER_DEV_MODE": "1"}) as server:
        reference = [server.tokens(prompt) for prompt in DEMO_PROMPTS]
        saved = server.post("/collective_rpc", {"method": "save_tensorizer_manifest", "args": [str(out)]})
    # The second start also proves that S3 credentials given on its command line (unused by a local checkpoint)
    # never reach its output, at DEBUG.
    flags = ("--load-format", "tensorizer_manifest", "--model-loader-extra-config", json.dumps(SERVER_CREDENTIALS))
    with Server(str(out), logs / "manifest.log", *flags, env={"VLLM_LOGGING_LEVEL": "DEBUG"}) as server:
        tokens = [server.tokens(prompt) for prompt in DEMO_PROMPTS]
    return {"reference": reference, "saved": saved, "out": out, "tokens": tokens,
            "log": (logs / "manifest.log").read_text()}  # fmt: skip


def test_openai_server_serves_the_checkpoint_token_exact(served):
    assert served["tokens"] == served["reference"]
    # The load line reaches a `vllm serve` user through vLLM's own logging, like its "Loading weights took".
    line = next((x for x in served["log"].splitlines() if "Loading weights with tensorizer_manifest took" in x), "")
    assert " INFO " in line and "content hashes checked" in line and "processed layer(s) restored" in line, served[
        "log"
    ][-3000:]


def test_a_served_model_saves_itself_through_vllms_dev_rpc_endpoint(served):
    """One POST to /collective_rpc saves the served model, with the model's own files: the
    checkpoint directory is a model `vllm serve` starts on (the other test: token-exact)."""
    out = served["out"]
    [rank] = served["saved"]["results"]
    assert rank["manifest"] == str(out / "generations" / rank["generation"] / "model.manifest.json"), served["saved"]
    assert rank["layers"] > 0 and (out / "tensorizer-manifest.json").is_file(), served["saved"]
    assert (out / "config.json").is_file()


def test_no_credential_in_the_servers_output_at_debug(served):
    """`vllm serve --model-loader-extra-config` with an S3 key id and secret, VLLM_LOGGING_LEVEL=DEBUG: vLLM logs
    its non-default args (that dict included, redacted), the API server and the engine core process print
    to the log, and neither credential is in it."""
    log = served["log"]
    assert " DEBUG " in log and "EngineCore" in log, log[-3000:]
    assert "'s3_access_key_id': '***', 's3_secret_access_key': '***'" in log, log[-3000:]
    for credential in SERVER_CREDENTIALS.values():
        at = log.find(credential)
        assert at < 0, log[max(0, at - 600) : at + 100]
