"""``add-form``: add this machine's processed form (or, with ``--compile``, its compile form) to a saved checkpoint.
Its options are ``AddFormOptions``' fields (``parameters``), made when the command is first parsed or shown."""

from __future__ import annotations

import os
from typing import Any

import click

from ..errors import TensorizerManifestError
from .output import console, engine_did_not_start, engine_in_this_process, fail, json_dumps
from .parameters import (
    ENCRYPTION_KEY_NAMES,
    PARALLEL_SIZES,
    PATH,
    ModelOptionsCommand,
    Spelled,
    json_option,
    options_of,
    parse_engine_args,
    remote_options,
)


def _add_form_options() -> type:
    from ..save.add_form import AddFormOptions

    return AddFormOptions


@click.command(
    "add-form",
    cls=ModelOptionsCommand,
    model=_add_form_options,
    options=[
        click.Option(["--engine-arg", "engine_arg"], multiple=True, metavar="KEY=VALUE", help="As for save."),
        *PARALLEL_SIZES,
        Spelled("signing_key_file", type=PATH),
        Spelled("encryption_key_file", ENCRYPTION_KEY_NAMES, type=PATH),
        *options_of(remote_options),
        "allow_unconditional_writes",
        "compile",
        "for_server",
        *options_of(json_option),
    ],
    api_only=["engine_args"],
)
@click.argument("checkpoint")
def add_form_command(checkpoint: str, engine_arg: tuple[str, ...], json: bool, **options: Any) -> None:
    """Add this machine's processed form to CHECKPOINT (a directory or s3://bucket/prefix saved with raw
    fallbacks).

    Loads it here with vLLM (the saved engine settings), runs vLLM's step on every layer whose saved form
    this machine or this vLLM would not produce, and adds the result as a tensor file and manifest entries
    of its own, sealed again (on S3: the tensor file uploaded first, the manifest last). From then on this
    machine kind loads those layers processed. With --compile, this machine kind's compile form instead: an engine
    compiles here with the --engine-arg settings (the serving engine's; --for-server: `vllm serve`'s batch sizes
    where none is given), and later engines with those settings here load its compiled graphs instead of
    compiling, under a seal checked with their signing key."""
    if json:  # stdout holds the JSON alone: vLLM's log (of this process and its workers) goes to stderr
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    engine_in_this_process()
    from ..save.add_form import add_form

    try:
        result = add_form(checkpoint, **options, engine_args=parse_engine_args(engine_arg))
    except TensorizerManifestError as exc:
        fail(exc)
    except Exception as exc:  # noqa: BLE001 - vLLM's own reason why its engine did not start, else raised again
        engine_did_not_start(exc)
    if json:
        console().print_json(json_dumps({"checkpoint": str(result.checkpoint), "ranks": result.ranks}))
        return
    for rank in result.ranks:  # a rank's keys depend on what it added (``AddFormResult.ranks``)
        not_added = rank.get("not_added") or {}
        if rank.get("archive"):
            console().print(
                f"added the compile form of this machine kind ({' '.join(rank['machine'])}): {rank['archive']} "
                f"({rank['bytes']:,} bytes, {rank['files']} files); engines with the same settings here load its "
                "graphs instead of compiling, where the seal is checked with your signing key (or with "
                "trust_compile_forms)",
                highlight=False,
            )
        elif rank.get("layout"):
            console().print(
                f"added the form set of tp={rank['layout']['tp']} pp={rank['layout']['pp']} made here from the base: "
                f"{rank['tensor_file']} ({rank['bytes']:,} bytes, {len(rank['added'])} layers processed); engines at "
                "this layout now load it without vLLM's step on them"
            )
        elif rank.get("tensor_file"):
            console().print(
                f"added the form of {len(rank['added'])} layers made here: {rank['tensor_file']} "
                f"({rank['bytes']:,} bytes); this machine kind now loads them processed"
            )
        elif not not_added:
            console().print("nothing to add: every layer with a fallback already loads processed here")
        else:
            console().print("nothing added: no verified restorer covers what vLLM's step made here")
        for path, why in not_added.items():
            console().print(f"  {path}: stays on its fallback here ({why})", highlight=False)
