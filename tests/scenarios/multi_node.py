"""Two nodes on this machine, one tensor-parallel model, loaded from one S3 bucket; JSON on the last line.

Usage: python tests/scenarios/multi_node.py WORKDIR

vLLM's own multi-node launcher (``vllm serve --nnodes 2 --node-rank R --master-addr 127.0.0.1``, rank 1
``--headless``) runs a tiny Llama with ``-tp 2``, one rank per node, twice: from its safetensors with vLLM's
default loader (the reference), then with ``--load-format tensorizer_manifest`` from a TP=2 checkpoint in a
moto S3 bucket (credentials in the environment only). Greedy tokens come from the OpenAI server on node 0;
what each node's worker loaded comes from its log line ("Loading weights with tensorizer_manifest took ...").
Every process started here is stopped here, within a bounded time, and checked gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

STARTUP_SECONDS = 420
LOAD_LINE = re.compile(
    r"Loading weights with tensorizer_manifest took [0-9.]+ s \((?P<manifest>[^)]+)\): (?P<mb>[0-9.]+) MB read"
)


def _get(url: str, body: dict | None = None, timeout: float = 60) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read() or b"{}") if body is not None else {}


def run_two_nodes(model: str, extra: list[str], env: dict[str, str], logs: Path, prompts: list[str]) -> dict:
    """Start node 1 (headless) and node 0 (the API server), take greedy tokens, stop both; their logs."""
    from helpers.servers import free_port

    port, master_port = free_port(), free_port()
    common = [
        sys.executable, str(HERE.parent / "helpers" / "vllm_cli.py"), "serve", model,
        "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master_port),
        "--distributed-executor-backend", "mp", "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "128",
        "--max-num-seqs", "1", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0", *extra,
    ]  # fmt: skip
    env = {**os.environ, **env, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    logs.mkdir(parents=True, exist_ok=True)
    nodes = []
    result: dict = {"command": [*common[2:], "--node-rank", "R"]}
    try:
        for rank, args in ((1, ["--node-rank", "1", "--headless"]), (0, ["--node-rank", "0", "--port", str(port)])):
            out = open(logs / f"node{rank}.log", "wb")  # noqa: SIM115 - closed with the process below
            node_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": str(rank % (os.cpu_count() or 1))}  # a core each
            nodes.append((subprocess.Popen([*common, *args], env=node_env, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True), out))  # fmt: skip
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if any(proc.poll() is not None for proc, _ in nodes):
                result["exited"] = [proc.poll() for proc, _ in nodes]
                break
            try:
                _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    result["exited"] = "timeout"
                    break
                time.sleep(2)
        if "exited" not in result:
            result["tokens"] = [
                _get(
                    f"http://127.0.0.1:{port}/v1/completions",
                    {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True},
                )["choices"][0]["token_ids"]
                for prompt in prompts
            ]
    finally:
        for proc, _out in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, out in nodes:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.close()
        groups = [proc.pid for proc, _ in nodes]
        deadline = time.monotonic() + 30  # the engine's own children exit on their own: give them that long
        while _left_running(groups) and time.monotonic() < deadline:
            time.sleep(1)
        result["left_running"] = _left_running(groups)
        for group in groups:  # whatever is left is stopped here, and reported above
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGKILL)
    result["loads"] = {}
    for rank in (0, 1):
        text = (logs / f"node{rank}.log").read_text(errors="replace")
        result["loads"][rank] = [m.groupdict() for m in LOAD_LINE.finditer(text)]
        if "tokens" not in result:
            result[f"node{rank}_tail"] = text[-3000:]
    return result


def _left_running(group_ids: list[int]) -> list[int]:
    """Processes still alive (not zombies) in the nodes' process groups (each node started its own session)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
                if os.getpgid(int(entry.name)) in group_ids and state != "Z":
                    alive.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return alive


def main() -> dict:
    workdir = Path(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # the TP=2 save: one core per rank (one NUMA node here)
    from helpers.servers import BUCKET, MotoS3

    from tensorizer_manifest.embedded_models.tiny import DEMO_PROMPTS, build_tiny_model
    from tensorizer_manifest.save.from_source import save_checkpoint
    from tensorizer_manifest.storage.remote import RemoteOptions
    from tensorizer_manifest.storage.remote_checkpoint import fetch_model_files, upload_checkpoint

    model_dir = str(build_tiny_model(workdir / "tiny-llama", "llama"))
    checkpoint = workdir / "ckpt-llama-tp2-multinode"
    save_checkpoint(model_dir, checkpoint, dtype="bfloat16", max_model_len=128, tensor_parallel_size=2)
    result: dict = {"saved": sorted(p.name for p in checkpoint.iterdir() if p.name.startswith("model"))}
    prompts = list(DEMO_PROMPTS)
    with MotoS3() as s3:
        uri = f"s3://{BUCKET}/llama-tp2-multinode"
        options = RemoteOptions(s3.key_id, s3.secret, s3.endpoint)
        upload_checkpoint(checkpoint, uri, options)
        config_dir = fetch_model_files(uri, workdir / "llama-tp2-multinode-config", options)
        result["reference"] = run_two_nodes(model_dir, [], {}, workdir / "multinode-default", prompts)
        manifest_args = ["--load-format", "tensorizer_manifest", "--model-loader-extra-config",
                         json.dumps({"tensorizer_dir": uri})]  # fmt: skip
        result["manifest"] = run_two_nodes(str(config_dir), manifest_args, s3.env(), workdir / "multinode-s3", prompts)
        result["secret_in_logs"] = any(
            s3.secret in (workdir / d / f"node{r}.log").read_text(errors="replace")
            for d in ("multinode-default", "multinode-s3")
            for r in (0, 1)
        )
        result["secret_in_command"] = any(s3.secret in part for part in result["manifest"]["command"])
        result["uri"] = uri
    return result


if __name__ == "__main__":
    from helpers.scenario import run_scenario

    run_scenario("MULTINODE_RESULT", main)
