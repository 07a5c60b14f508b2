"""Run ``verify-kernels`` on every tiny kind whose layers a CPU restorer replays; keep the records.

    .venv/bin/python scripts/verify_cpu_kernels.py [--out tensorizer_manifest/verified] [--work-dir DIR]

Writes one file per kind of CPU (``cpu-avx512-amx.json``...): the package's
verified set for that machine kind, which ``tensorizer-manifest kernels`` shows.
Each kind runs in its own process (one vLLM engine set per process).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

KINDS = [
    "gptq-w4",
    "awq-w4",
    "ct-w4a16",
    "qwen3-moe",
    "kv-fp8-calibrated",
    "kv-fp8",
    "llama",
    "fp8-block",
    "qwen3-moe-fp8",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=Path("tensorizer_manifest/verified"), help="where the records go (%(default)s)"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="models and engines' work (default: a new temporary directory)"
    )
    args = parser.parse_args()
    if args.work_dir is None:  # made here, not as the default: --help must not leave a directory behind
        args.work_dir = Path(tempfile.mkdtemp(prefix="tm-verify-cpu-"))

    from tensorizer_manifest import _vllm_compat
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model, engine_args, why_this_cpu_cannot_run
    from tensorizer_manifest.format.verification import read_records, write_records

    records, failed = [], []
    for kind in KINDS:
        if (reason := why_this_cpu_cannot_run(kind)) is not None:
            print(f"{kind}: not run here ({reason})")
            continue
        model = build_tiny_model(args.work_dir / f"tiny-{kind}", kind)
        out = args.work_dir / f"{kind}.json"
        cmd = [sys.executable, "-m", "tensorizer_manifest.cli", "verify-kernels", str(model), "--dtype", "bfloat16"]
        cmd += ["--work-dir", str(args.work_dir / f"work-{kind}"), "--record-out", str(out)]
        cmd += [f"--engine-arg={key}={json.dumps(value)}" for key, value in engine_args(kind).items()]
        done = subprocess.run(cmd, capture_output=True, text=True)
        print(done.stdout.strip())
        if done.returncode != 0:
            failed.append(kind)
            print(done.stderr[-2000:], file=sys.stderr)
        if out.exists():
            records += read_records(out)
    for record in records:
        record.model = f"tiny {Path(record.model).name.removeprefix('tiny-')}"
    name = "-".join(["cpu", *(f.lower() for f in _vllm_compat.cpu_features())]) + ".json"
    print(f"wrote {write_records(records, args.out / name)}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
