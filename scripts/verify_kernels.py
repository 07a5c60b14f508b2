"""Run ``verify-kernels`` on every tiny kind whose layers a restorer of this device replays; print one table.

    .venv/bin/python scripts/verify_kernels.py                  # CPU: the package's verified set for this CPU kind
    .venv/bin/python scripts/verify_kernels.py --device cuda    # a GPU: the CUDA restorers, a table to paste back

Each kind is built here (no download), saved processed, then loaded by vLLM's default loader and by the manifest
loader in one process: greedy tokens, every processed tensor bitwise, and which layers ran a post-load step are
compared (``tensorizer-manifest verify-kernels``). Each kind runs in its own process.

On CPU the records go to the package (``tensorizer_manifest/verified/cpu-<features>.json``, which
``tensorizer-manifest kernels`` shows). On a GPU (with the CUDA build of vLLM) they go to ``--out``
(``gpu-verification.json``) and, with ``--install``, to your verified set; the table it prints is what to paste
into an issue. About a minute a kind on one GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CPU_KINDS = [
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
#: The tiny kinds whose layers the CUDA restorers replay: Marlin/Machete WNA16 (``cuda_wna16``), FP8 linear per
#: tensor and per block (``cuda_fp8_linear``), fused MoE in bf16 and FP8 (``cuda_fused_moe``), the KV-cache scales.
CUDA_KINDS = [
    "gptq-w4",
    "gptq-w4-actorder",
    "awq-w4",
    "ct-w4a16",
    "fp8-tensor",
    "fp8-block",
    "qwen3-moe",
    "qwen3-moe-fp8",
    "kv-fp8-calibrated",
    "llama",
]
#: CUDA restorers no tiny kind exercises, and what does.
NOT_COVERED = {
    "modelopt_nvfp4_linear": "no tiny NVFP4 kind: run `tensorizer-manifest verify-kernels` on an NVFP4 model "
    "(ModelOpt) on sm_100",
}


def table(records: list, failed: dict[str, str], seconds: float) -> str:
    """The verdicts as one Markdown table, with the machine above it: what a GPU owner pastes back."""
    if records:
        first = records[0]
        device = f"{first.device_type} {first.device_name}" + (
            f" (capability {first.device_capability})" if first.device_capability else ""
        )
        head = f"{device}; vLLM {first.vllm_version}; tensorizer-manifest {first.tensorizer_manifest_version}"
    else:
        head = "no record was written"
    lines = [head, "", "| kind | restorer | result | kernel classes | layers | detail |", "|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r.model, r.restorer)):
        detail = r.detail.replace("|", "/").replace("\n", " ")[:200]
        lines.append(f"| {r.model} | {r.restorer} | {r.result} | {', '.join(r.kernel_classes) or '-'} | "
                     f"{r.layers} | {detail} |")  # fmt: skip
    for kind, why in failed.items():
        lines.append(f"| {kind} | - | did not run | - | - | {why.replace('|', '/')[:200]} |")
    for restorer, why in NOT_COVERED.items() if records and records[0].device_type == "cuda" else ():
        lines.append(f"| - | {restorer} | not run | - | - | {why} |")
    lines += ["", f"{len(records)} records, {len(failed)} kinds that did not run, {seconds:.0f} s"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the device to verify (%(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="where the records go (CPU: the package's verified "
                        "set; cuda: gpu-verification.json)")  # fmt: skip
    parser.add_argument("--install", action="store_true", help="also add passing records to your verified set")
    parser.add_argument("--kinds", nargs="+", default=None, help="only these tiny kinds")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="models and engines' work (default: a new temporary directory)"
    )
    args = parser.parse_args()
    if args.work_dir is None:  # made here, not as the default: --help must not leave a directory behind
        args.work_dir = Path(tempfile.mkdtemp(prefix=f"tm-verify-{args.device}-"))

    from tensorizer_manifest import _vllm_compat
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model, engine_args, why_this_cpu_cannot_run
    from tensorizer_manifest.format.verification_records import read_records, write_records

    started = time.monotonic()
    records, failed = [], {}
    for kind in args.kinds or (CPU_KINDS if args.device == "cpu" else CUDA_KINDS):
        if args.device == "cpu" and (reason := why_this_cpu_cannot_run(kind)) is not None:
            print(f"{kind}: not run here ({reason})")
            continue
        model = build_tiny_model(args.work_dir / f"tiny-{kind}", kind)
        out = args.work_dir / f"{kind}.json"
        cmd = [sys.executable, "-m", "tensorizer_manifest.cli", "verify-kernels", str(model), "--dtype", "bfloat16"]
        cmd += ["--work-dir", str(args.work_dir / f"work-{kind}"), "--record-out", str(out)]
        cmd += [f"--engine-arg={key}={json.dumps(value)}" for key, value in engine_args(kind).items()]
        cmd += ["--install"] if args.install else []
        done = subprocess.run(cmd, capture_output=True, text=True)
        print(done.stdout.strip())
        if done.returncode != 0 and not out.exists():
            failed[kind] = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            print(done.stderr[-2000:], file=sys.stderr)
        if out.exists():
            records += read_records(out)
    for record in records:
        record.model = f"tiny {Path(record.model).name.removeprefix('tiny-')}"
    if args.device == "cpu":
        name = "-".join(["cpu", *(f.lower() for f in _vllm_compat.cpu_features())]) + ".json"
        out = args.out or Path("tensorizer_manifest/verified") / name
    else:
        out = args.out or Path("gpu-verification.json")
    print(f"wrote {write_records(records, out)}\n")
    print(table(records, failed, time.monotonic() - started))
    raise SystemExit(1 if failed or any(r.result != "pass" for r in records) else 0)


if __name__ == "__main__":
    main()
