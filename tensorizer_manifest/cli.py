"""``tensorizer-manifest``: save, inspect, schema, demo.

Known errors become one red line and exit code 1 (2 for usage errors, as
click does); never a traceback. torch and vLLM are imported only by the
commands that need them, so ``inspect`` and ``schema`` answer at once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .errors import TensorizerManifestError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Self-describing vLLM tensorizer checkpoints: save, inspect, load with load_format='tensorizer_manifest'.",
)
# Piped output is read by tools and people alike: give tables room instead of rich's 80 columns.
_WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 220
console = Console(width=_WIDTH)
err_console = Console(stderr=True, width=_WIDTH)


def _fail(exc: BaseException) -> None:
    err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


@app.command()
def inspect(
    path: Path = typer.Argument(..., help="A checkpoint directory or a *.manifest.json file."),
    json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """One row per layer: class, quant method, kernel, raw or processed, tensors, bytes, runtime state."""
    from .inspect import as_json, load_manifest, render

    try:
        manifest, manifest_path = load_manifest(path)
    except TensorizerManifestError as exc:
        _fail(exc)
    if json:
        sys.stdout.buffer.write(as_json(manifest) + b"\n")
    else:
        render(manifest, str(manifest_path), console)
        others = sorted(p.name for p in manifest_path.parent.glob("*.manifest.json") if p != manifest_path)
        if path.is_dir() and others:
            console.print(f"(this directory holds {len(others) + 1} rank manifests; inspect the others by file: {', '.join(others)})")


@app.command()
def validate(
    path: Path = typer.Argument(..., help="A checkpoint directory or a *.manifest.json file."),
    json: bool = typer.Option(False, "--json", help="Machine-readable report."),
    hashes: bool = typer.Option(True, "--hashes/--no-hashes", help="Read every tensor and check its content hash."),
    dtype: Optional[str] = typer.Option(None, help="Also check the checkpoint suits an engine with this dtype."),
    quantization: Optional[str] = typer.Option(None, help="... with this quantization ('none' for unquantized)."),
    tensor_parallel_size: Optional[int] = typer.Option(None, "--tensor-parallel-size", "-tp", help="... with this TP size."),
    pipeline_parallel_size: Optional[int] = typer.Option(None, "--pipeline-parallel-size", "-pp", help="... with this PP size."),
    engine: bool = typer.Option(False, "--engine", help="Build the model with vLLM (no weights read) and check every layer's quant method and kernels."),
) -> None:
    """Check a checkpoint: manifest against tensor file (no vLLM, no GPU); exit 0 valid, 1 not, 2 usage."""
    import msgspec

    from .validate import check_engine_settings, validate_checkpoint

    report = validate_checkpoint(path, verify_hashes=hashes)
    problems = list(report.problems)
    if report.manifest_path is not None:
        problems += check_engine_settings(
            report.manifest_path, dtype=dtype, quantization=quantization,
            tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
        )
        if engine and not problems:
            import contextlib
            import os

            # vLLM logs to stdout; keep stdout for the report.
            os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
            with contextlib.redirect_stdout(sys.stderr):
                from .engine_check import check_against_engine

                problems += check_against_engine(report.manifest_path, dtype=dtype, quantization=quantization)
    if json:
        doc = report.to_dict()
        doc["ok"] = not problems
        doc["problems"] = [{"error": p.kind.__name__, "where": p.where, "message": p.message} for p in problems]
        sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n")
    elif problems:
        for problem in problems:
            err_console.print(f"[red]{problem.kind.__name__}[/red] {problem}", highlight=False, soft_wrap=True)
    else:
        console.print(
            f"[green]valid[/green] {report.manifest_path}: {report.records} tensor records, "
            f"{report.stored} stored, {report.hashes_checked} content hashes checked"
        )
    raise typer.Exit(1 if problems else 0)


@app.command()
def diff(
    a: Path = typer.Argument(..., help="First checkpoint directory or manifest."),
    b: Path = typer.Argument(..., help="Second checkpoint directory or manifest."),
    json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """What differs between two checkpoints; exit 0 when they are the same, 1 when they differ."""
    import msgspec

    from .checkpoint import load_manifest
    from .diff import diff_manifests

    try:
        ma, _ = load_manifest(a)
        mb, _ = load_manifest(b)
    except TensorizerManifestError as exc:
        _fail(exc)
    result = diff_manifests(ma, mb)
    if json:
        sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(result.to_dict()), indent=2) + b"\n")
    else:
        if result.same:
            console.print("the checkpoints describe the same model, layers and tensors")
        for field_name, x, y in result.fingerprint:
            console.print(f"fingerprint.{field_name}: {x!r} -> {y!r}", highlight=False)
        for path in result.layers_removed:
            console.print(f"[red]- {path}[/red]", highlight=False)
        for path in result.layers_added:
            console.print(f"[green]+ {path}[/green]", highlight=False)
        for path, what, x, y in result.layers_changed:
            console.print(f"~ {path}: {what}: {x!r} -> {y!r}", highlight=False)
    raise typer.Exit(0 if result.same else 1)


@app.command()
def schema() -> None:
    """Print the manifest's JSON Schema (generated from the types)."""
    import msgspec

    from .schema import json_schema

    sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(json_schema()), indent=2) + b"\n")


@app.command()
def save(
    src: str = typer.Argument(..., help="Anything vLLM accepts as a model; a local directory needs no network."),
    out: Path = typer.Argument(..., help="Output directory: config, tokenizer, *.tensors and *.manifest.json."),
    dtype: str = typer.Option("auto", help="Model dtype, as vLLM's --dtype."),
    quantization: Optional[str] = typer.Option(None, help="As vLLM's --quantization."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp"),
    pipeline_parallel_size: int = typer.Option(1, "--pipeline-parallel-size", "-pp"),
    max_model_len: Optional[int] = typer.Option(None),
    revision: Optional[str] = typer.Option(None),
    trust_remote_code: bool = typer.Option(False),
    cpu_gemm: str = typer.Option("auto", help="CPU only: 'fallback' keeps linear weights so those layers save processed."),
) -> None:
    """Load SRC with vLLM, observe its post-load step, and write a self-describing checkpoint to OUT."""
    from pydantic import ValidationError

    from .save import save_checkpoint

    try:
        result = save_checkpoint(
            src, out, dtype=dtype, quantization=quantization, tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size, max_model_len=max_model_len, revision=revision,
            trust_remote_code=trust_remote_code, cpu_gemm=cpu_gemm,
        )
    except ValidationError as exc:
        err_console.print(f"[red]error:[/red] invalid option: {exc}")
        raise typer.Exit(2)
    except TensorizerManifestError as exc:
        _fail(exc)
    for rank in result.ranks:
        console.print(
            f"saved {rank['tensor_file']} ({rank['bytes']:,} bytes, {rank['layers']} layers, "
            f"{rank['raw_layers']} raw) and {Path(rank['manifest']).name}"
        )
    console.print(f"copied {', '.join(result.copied_files) or 'nothing'} into {result.out_dir}")
    console.print(f"load it with: LLM(model={str(result.out_dir)!r}, load_format='tensorizer_manifest')")


@app.command()
def demo(
    work_dir: Path = typer.Option(Path(".cache/demo"), help="Where the tiny model and checkpoint are kept (cached)."),
    kind: str = typer.Option("w8a8-int8", help="Tiny model: w8a8-int8 (raw and processed layers), llama, qwen3-tied or qwen2-bias."),
    max_tokens: int = typer.Option(16),
) -> None:
    """Build a tiny model, save it with a manifest, inspect it, load it back through vLLM, compare tokens."""
    from .demo import run_demo

    try:
        ok = run_demo(work_dir, kind, max_tokens, console)
    except TensorizerManifestError as exc:
        _fail(exc)
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
