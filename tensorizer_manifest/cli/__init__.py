"""The ``tensorizer-manifest`` command: the top of the house (it may import every folder; nothing imports it).

One module per command, named for it, with ``_command`` added where the name is taken (by the standard library,
or by the module the command runs): ``save``, ``add_form``, ``inspect_command``, ``validate``, ``diff_command``,
``fetch``, ``gc_command``, ``kernels``, ``verify_kernels_command``, ``schema``, ``demo_command``. They share
``output`` (a known error as one red line and its exit code, never a traceback) and ``parameters`` (the options
several take, and those an option model declares). What they run that only the CLI shows: ``summary``
(``inspect``'s reading for people), ``diff`` (two checkpoints compared), ``demo`` (the main job end to end on the
embedded default), ``verify_kernels`` (each restorer a model uses checked against vLLM's own result, here).

A command imports torch, vLLM and pydantic only when it runs (``save`` and ``add-form`` also to show their
options), so ``inspect`` and ``schema`` answer at once (click, not typer: typer imports pydantic for every
invocation). The group is defined here: ``cli.app`` is the group that ``cli:main``, the console script, runs, and
would hide a module named ``app``.
"""

from __future__ import annotations

import click

from . import (
    add_form,
    demo_command,
    diff_command,
    fetch,
    gc_command,
    inspect_command,
    kernels,
    save,
    schema,
    validate,
    verify_kernels_command,
)


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    commands=[
        save.save,
        add_form.add_form_command,
        inspect_command.inspect,
        validate.validate,
        diff_command.diff,
        fetch.fetch,
        gc_command.gc,
        kernels.kernels,
        verify_kernels_command.verify_kernels,
        schema.schema,
        demo_command.demo,
    ],
)
def app() -> None:
    """Self-describing vLLM tensorizer checkpoints: save, inspect, validate, and load with
    load_format='tensorizer_manifest'."""


def main() -> None:
    """The console script's entry point (``tensorizer_manifest.cli:main``)."""
    app(prog_name="tensorizer-manifest")


__all__ = ["app", "main"]
