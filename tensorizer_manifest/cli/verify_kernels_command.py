"""``verify-kernels``: the command around ``verify_kernels`` (which imports torch and vLLM when it runs)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ..errors import TensorizerManifestError
from .output import console, fail, write_json
from .parameters import PATH, json_option, parse_engine_args


@click.command("verify-kernels")
@click.argument("model")
@click.option("--work-dir", type=PATH, default=None, help="Where the checkpoint is written (default: a temp dir).")
@click.option("--dtype", default="auto", show_default=True, help="Model dtype, as vLLM's --dtype.")
@click.option("--quantization", default=None, help="As vLLM's --quantization.")
@click.option("--max-model-len", type=int, default=None)
@click.option("--kv-cache-dtype", default=None, help="As vLLM's --kv-cache-dtype.")
@click.option("--engine-arg", "engine_arg", multiple=True, metavar="KEY=VALUE", help="As for save.")
@click.option("--record-out", type=PATH, default=None, help="Write the verification records (JSON) here.")
@click.option("--install", is_flag=True, help="Add passing records to your verified set (see `kernels`).")
@json_option
def verify_kernels(
    model: str,
    work_dir: Path | None,
    dtype: str,
    quantization: str | None,
    max_model_len: int | None,
    kv_cache_dtype: str | None,
    engine_arg: tuple[str, ...],
    record_out: Path | None,
    install: bool,
    json: bool,
) -> None:
    """Save MODEL processed, load it back and with vLLM's default loader on this machine, and compare tokens,
    every processed tensor (bitwise) and post-load calls; one verification record per restorer. Exit 0 when
    every restorer passed."""
    import datetime
    import tempfile

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the report's
    from ..format.verification_records import user_records_dir, write_records
    from .verify_kernels import verify_kernels as run_verification

    engine_args = parse_engine_args(engine_arg)
    for key, value in (("dtype", dtype), ("quantization", quantization), ("max_model_len", max_model_len)):
        if value is not None:
            engine_args.setdefault(key, value)
    if kv_cache_dtype is not None:
        engine_args["kv_cache_dtype"] = kv_cache_dtype
    with tempfile.TemporaryDirectory(prefix="tm-verify-") as scratch:
        try:
            result = run_verification(model, work_dir or scratch, engine_args=engine_args)
        except TensorizerManifestError as exc:
            fail(exc)
    if record_out is not None:
        write_records(result.records, record_out)
    if install:
        passing = [r for r in result.records if r.result == "pass"]
        stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        write_records(passing, user_records_dir() / f"{stamp}-{Path(model).name}.json")
    if json:
        write_json(result.records)
    else:
        for r in result.records:
            colour = "green" if r.result == "pass" else "red"
            console().print(
                f"[{colour}]{r.result}[/{colour}] {r.restorer} on {r.device_type} ({r.device_name}): "
                f"{r.layers} layers{'; ' + r.detail if r.detail else ''}",
                highlight=False,
            )
        if not result.records:
            console().print("no layer of this model was saved processed by a restorer: nothing to verify")
    raise SystemExit(0 if result.passed else 1)
