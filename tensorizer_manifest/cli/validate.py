"""``validate``: a checkpoint checked against its manifest without vLLM (``--engine``: with vLLM's model built, no
weights read); exit 0 valid, 1 not, 2 usage."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from .output import console, err_console, write_json
from .parameters import PATH, encryption_key_option, location_of, remote_from, remote_options


@click.command()
@click.argument("location")
@click.option("--json", "json", is_flag=True, help="Machine-readable report.")
@click.option(
    "--hashes/--no-hashes",
    "--verify-hash/--no-verify-hash",
    "hashes",
    default=True,
    help="Read every tensor and check its content hash (vLLM's verify_hash).",
)
@click.option("--dtype", default=None, help="Also check the checkpoint suits an engine with this dtype.")
@click.option("--quantization", default=None, help="... with this quantization ('none' for unquantized).")
@click.option("--tensor-parallel-size", "-tp", type=int, default=None, help="... with this TP size.")
@click.option("--pipeline-parallel-size", "-pp", type=int, default=None, help="... with this PP size.")
@click.option(
    "--engine",
    is_flag=True,
    help="Build the model with vLLM (no weights read) and check every layer's quant method and kernels.",
)
@click.option(
    "--signing-key-file",
    type=PATH,
    default=None,
    help="Key the checkpoint was saved with (else $TENSORIZER_MANIFEST_SIGNING_KEY); only its seal passes.",
)
@remote_options
@encryption_key_option(
    "Key an encrypted checkpoint was saved with (else $TENSORIZER_MANIFEST_ENCRYPTION_KEY): its content "
    "hashes are checked after decryption. Without it, all else is checked."
)
def validate(
    location: str,
    json: bool,
    hashes: bool,
    dtype,
    quantization,
    tensor_parallel_size,
    pipeline_parallel_size,
    engine: bool,
    signing_key_file: Path | None,
    encryption_key_file: Path | None,
    **remote,
) -> None:
    """Check a checkpoint: manifest against tensor file (no vLLM, no GPU); exit 0 valid, 1 not, 2 usage.

    LOCATION is a checkpoint directory, a manifest file, or an s3:// or http(s):// URI of either; a remote
    tensor file is checked with ranged reads, and its content hashes as it streams."""
    from ..checks.validate import check_engine_settings, validate_checkpoint
    from ..progress import terminal_progress

    with terminal_progress("hashing", enabled=hashes and not json) as progress:
        report = validate_checkpoint(
            location_of(location),
            verify_hashes=hashes,
            signing_key_file=signing_key_file,
            encryption_key_file=encryption_key_file,
            progress=progress,
            remote=remote_from(**remote),
        )
    problems = list(report.problems)
    if report.manifest_path is not None:
        problems += check_engine_settings(
            report.manifest_path,
            dtype=dtype,
            quantization=quantization,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
        )
        if engine and not problems:
            import contextlib

            # vLLM logs to stdout; keep stdout for the report.
            os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
            with contextlib.redirect_stdout(sys.stderr):
                from ..load.engine_check import check_against_engine

                problems += check_against_engine(report.manifest_path, dtype=dtype, quantization=quantization)
    if json:
        doc = report.to_dict()
        doc["ok"] = not problems
        doc["problems"] = [p.to_dict() for p in problems]
        write_json(doc)
    else:
        for problem in problems:
            err_console().print(f"[red]{problem.kind.__name__}[/red] {problem}", highlight=False, soft_wrap=True)
        for warning in report.warnings:
            err_console().print(f"[yellow]warning[/yellow] {warning}", highlight=False, soft_wrap=True)
        if not problems:
            console().print(
                f"[green]valid[/green] {report.manifest_path}: {report.records} tensor records, "
                f"{report.stored} stored{', encrypted' if report.encrypted else ''}, "
                f"{report.hashes_checked} content hashes checked"
            )
    raise SystemExit(1 if problems else 0)
