"""``save``: load a model with vLLM, observe its post-load step and write a self-describing checkpoint. Its
options are ``SaveOptions``' fields (``parameters``), made when the command is first parsed or shown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import TensorizerManifestError
from .output import console, engine_did_not_start, engine_in_this_process, fail
from .parameters import (
    ENCRYPTION_KEY_NAMES,
    PARALLEL_SIZES,
    PATH,
    ModelOptionsCommand,
    Spelled,
    options_of,
    parse_engine_args,
    remote_options,
)


def _save_options() -> type:
    from ..save.from_source import SaveOptions

    return SaveOptions


@click.command(
    cls=ModelOptionsCommand,
    model=_save_options,
    options=[
        "dtype",
        "quantization",
        *PARALLEL_SIZES,
        "max_model_len",
        "revision",
        "trust_remote_code",
        click.Option(
            ["--kv-cache-dtype"], help="As vLLM's --kv-cache-dtype (e.g. fp8); the loading engine must match."
        ),
        click.Option(["--enable-expert-parallel"], is_flag=True, help="As vLLM's --enable-expert-parallel."),
        click.Option(
            ["--engine-arg", "engine_arg"],
            multiple=True,
            metavar="KEY=VALUE",
            help="Any other vllm.LLM option, repeatable; VALUE is read as JSON when it parses (4, true, {...}), "
            "else as a string. KEY may be spelled as the vllm serve flag (max-num-seqs).",
        ),
        "cpu_gemm",
        "portable",
        "allow_unverified",
        "fallbacks",
        "base",
        Spelled("signing_key_file", type=PATH),
        "allow_unconditional_writes",
        "format_version",
        *options_of(remote_options),
        Spelled("encryption_key_file", (*ENCRYPTION_KEY_NAMES, "--encrypt-key-file"), type=PATH),
    ],
    api_only=["kv_cache_memory_bytes", "engine_args", "progress"],
)
@click.argument("src")
@click.argument("out")
def save(
    src: str,
    out: str,
    kv_cache_dtype: str | None,
    enable_expert_parallel: bool,
    engine_arg: tuple[str, ...],
    **options: Any,
) -> None:
    """Load SRC (anything vLLM accepts as a model; a local directory needs no network) with vLLM, observe
    its post-load step, and write a self-describing checkpoint to OUT (config, tokenizer, *.tensors,
    *.manifest.json). OUT is a directory or s3://bucket/prefix (uploaded tensors first, manifests last)."""
    engine_in_this_process()
    from ..progress import interactive
    from ..save.from_source import save_checkpoint

    engine_args = parse_engine_args(engine_arg)
    if kv_cache_dtype is not None:
        engine_args["kv_cache_dtype"] = kv_cache_dtype
    if enable_expert_parallel:
        engine_args["enable_expert_parallel"] = True
    try:
        result = save_checkpoint(src, out, **options, engine_args=engine_args, progress=interactive())
    except TensorizerManifestError as exc:
        fail(exc)
    except Exception as exc:  # noqa: BLE001 - vLLM's own reason why its engine did not start, else raised again
        engine_did_not_start(exc)
    for rank in result.ranks:
        console().print(
            f"saved {rank['tensor_file']} ({rank['bytes']:,} bytes, {rank['layers']} layers, "
            f"{rank['raw_layers']} raw{', encrypted' if rank.get('encryption', 'none') != 'none' else ''}) "
            f"and {Path(rank['manifest']).name}"
        )
        if rank.get("fallback_layers"):
            console().print(
                f"  {rank['fallback_layers']} layers in a machine- or kernel-specific form keep a raw fallback "
                f"({rank['fallback_bytes']:,} bytes; --no-fallbacks leaves it out)"
            )
    base = result.ranks[0].get("base") if result.ranks else None
    if base is not None:
        console().print(
            f"wrote the base: {base['tensors']} source tensors "
            + (f"({base['bytes']:,} bytes)" if "reference" not in base else f"by reference to {base['reference']}")
            + ", which vLLM's own weight loaders shard at any tensor- or pipeline-parallel layout; the form set "
            "stores only what vLLM's step changed"
        )
    elif result.ranks and result.ranks[0].get("generation") is not None:
        console().print(
            "no base: the checkpoint loads at the saved layout only (a save at pipeline_parallel_size=1 without "
            "expert parallelism writes one, unless --base none)"
        )
    generation = result.ranks[0].get("generation") if result.ranks else None
    if generation is not None:
        console().print(f"committed generation {generation}, with {', '.join(result.copied_files) or 'no model files'}")
    else:
        console().print(f"copied {', '.join(result.copied_files) or 'nothing'} into {result.out_dir}")
    encryption_key_file = options["encryption_key_file"]
    extra = (
        ", model_loader_extra_config={'encryption_key_file': " + repr(encryption_key_file) + "}"
        if encryption_key_file is not None
        else ""
    )
    if isinstance(result.out_dir, str):
        console().print(
            f"load it with: tensorizer-manifest fetch {result.out_dir} DIR, then LLM(model=DIR, "
            f"load_format='tensorizer_manifest', model_loader_extra_config={{'checkpoint_dir': {result.out_dir!r}}})"
        )
    else:
        console().print(f"load it with: LLM(model={str(result.out_dir)!r}, load_format='tensorizer_manifest'{extra})")
