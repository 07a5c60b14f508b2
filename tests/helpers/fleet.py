"""A fleet of engines loading one S3 checkpoint at once, each in its own process (``scenarios/fleet_engine.py``),
for the fleet tests and ``benchmarks/bench_fleet.py``. Each engine signs with its own access key id (moto accepts
any), so a ``FaultProxy`` in front of the server counts the bytes it sent each one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
MARKER = "FLEET_RESULT "


@dataclass(frozen=True)
class Engine:
    """One engine of a fleet: the S3 endpoint it talks to (a proxy) and the access key id it signs with."""

    endpoint: str
    key_id: str


def engine_key_id(n: int) -> str:
    return f"AKIAFLEETENGINE{n:05d}"


def run_fleet(
    uri: str,
    engines: list[Engine],
    secret: str,
    workdir: Path,
    timeout: float = 900,
    num_readers: int | None = None,
) -> list[dict]:
    """Start every engine's process, let them all load once each has imported vLLM, and return their results
    in order (each with ``_output``: what it printed). ``num_readers``: the loader's (None: its default, one
    per core). Every process is gone when this returns."""
    workdir.mkdir(parents=True, exist_ok=True)
    gate = Path(tempfile.mkdtemp(prefix="gate-", dir=workdir))
    procs = []
    try:
        for n, engine in enumerate(engines):
            env = dict(os.environ)
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            env.update(
                HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1",
                TM_FLEET_ENDPOINT=engine.endpoint,
                TM_FLEET_KEY_ID=engine.key_id,
                TM_FLEET_SECRET=secret,
                TM_FLEET_GATE=str(gate),
            )
            if num_readers is not None:
                env["TM_FLEET_NUM_READERS"] = str(num_readers)
            log = open(workdir / f"engine-{n}.log", "w+")  # noqa: SIM115 - closed below
            command = [sys.executable, str(TESTS / "scenarios/fleet_engine.py"), uri, str(workdir / f"cache-{n}")]
            procs.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True), log))
        deadline = time.monotonic() + timeout
        while not all((gate / e.key_id).exists() for e in engines):
            if any(p.poll() is not None for p, _ in procs) or time.monotonic() > deadline:
                break  # one died before the start: the others are let go, its result says why
            time.sleep(0.1)
        (gate / "go").write_text("go")
        results = []
        for proc, log in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            log.seek(0)
            output = log.read()
            lines = [line for line in output.splitlines() if line.startswith(MARKER)]
            result = json.loads(lines[-1][len(MARKER) :]) if lines else {"engine_started": False, "chain": []}
            result["_output"] = output
            result["_exit"] = proc.returncode
            results.append(result)
        return results
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
