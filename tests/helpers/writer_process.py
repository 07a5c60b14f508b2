"""A writer of a format-3 checkpoint as a process of its own, for the tests that race writers against ``gc``:
``python writer_process.py local ROOT SOURCE SEED`` saves the synthetic capture as a new generation of ROOT;
``python writer_process.py s3 STAGING URI KEY_ID,SECRET,ENDPOINT`` commits STAGING's generation to URI. It prints
``committed <id>`` and exits 0, or ``refused: <typed error>`` and exits 1; anything else is a traceback (exit 1).

``start`` runs it with ``TENSORIZER_MANIFEST_PAUSE_AT`` set, so that it stops at the named steps until released
(``tensorizer_manifest._failpoints``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def start(*args: str, pause_at: str | None = None, gate: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    if pause_at:
        env["TENSORIZER_MANIFEST_PAUSE_AT"] = f"{pause_at}:{gate}"
    return subprocess.Popen(
        [sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_until_paused(gate: Path, step: str, process: subprocess.Popen, timeout: float = 120) -> str:
    """The id its pause names (``<step>.<id>.reached``), once the process is there."""
    deadline = time.monotonic() + timeout
    while True:
        reached = sorted(gate.glob(f"{step}.*.reached"))
        if reached:
            return reached[0].name[len(step) + 1 : -len(".reached")]
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"never paused at {step}: {process.communicate()[0]}")
        time.sleep(0.02)


def release(gate: Path, step: str, process: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    (gate / f"{step}.release").touch()
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def main(argv: list[str]) -> int:
    from tensorizer_manifest.errors import TensorizerManifestError

    kind, *rest = argv
    try:
        if kind == "local":
            from helpers.synthetic import save_generation

            root, source, seed = rest
            generation = save_generation(Path(root), Path(source), int(seed))
        else:
            from tensorizer_manifest.storage.remote import RemoteOptions
            from tensorizer_manifest.storage.remote_checkpoint import publish_to_s3

            staging, uri, credentials = rest
            generation = publish_to_s3(Path(staging), uri, RemoteOptions(*credentials.split(",")))
    except TensorizerManifestError as exc:
        print(f"refused: {type(exc).__name__}: {exc}", flush=True)
        return 1
    print(f"committed {generation.id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
