"""``tensorizer-manifest``: save, inspect, validate, diff, fetch, schema, demo.

Known errors become one red line and exit code 1 (2 for usage errors, as
click does); never a traceback. torch and vLLM are imported only by the
commands that need them, so ``inspect`` and ``schema`` answer at once (click,
not typer: typer imports pydantic for every invocation).
"""

from __future__ import annotations

import functools
import os
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from ..embedded_models.tiny import TINY_KINDS
from ..errors import TensorizerManifestError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def app() -> None:
    """Self-describing vLLM tensorizer checkpoints: save, inspect, validate, and load with
    load_format='tensorizer_manifest'."""


# Piped output is read by tools and people alike: give tables room instead of rich's 80 columns.
_WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 220


@functools.cache
def console():
    """rich, imported on first use: `inspect --json` and `schema` never pay for it."""
    from rich.console import Console

    return Console(width=_WIDTH)


@functools.cache
def err_console():
    from rich.console import Console

    return Console(stderr=True, width=_WIDTH)


def _fail(exc: BaseException) -> None:
    """One red line; exit 2 for a mistake in how the command was called, 1 otherwise."""
    from ..errors import ConfigurationError

    err_console().print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
    raise SystemExit(2 if isinstance(exc, ConfigurationError) else 1)


_PATH = click.Path(path_type=Path)


def _location(value: str) -> Path | str:
    """A checkpoint argument: a local path, or an ``s3://`` / ``http(s)://`` URI kept as it is."""
    from ..storage.remote import is_remote

    return value if is_remote(value) else Path(value)


def remote_options(fn):
    """``--s3-access-key-id``, ``--s3-secret-access-key``, ``--s3-endpoint``: for s3:// checkpoints."""
    from ..storage.remote.credentials import S3_OPTIONS_HELP

    for name, help_text in reversed(S3_OPTIONS_HELP.items()):
        fn = click.option("--" + name.replace("_", "-"), default=None, help=help_text)(fn)
    return fn


#: The encryption key file's spellings: ours and vLLM's (``--encryption-keyfile``, as ``encryption_keyfile`` in
#: ``model_loader_extra_config``). ``save`` also takes ``--encrypt-key-file``, which it always has.
ENCRYPTION_KEY_NAMES = ("--encryption-key-file", "--encryption-keyfile")


def encryption_key_option(help_text: str):
    """``--encryption-key-file`` (vLLM's ``--encryption-keyfile`` too) as a command reads or writes it."""
    return click.option(*ENCRYPTION_KEY_NAMES, "encryption_key_file", type=_PATH, default=None, help=help_text)


def _options_of(decorator: Callable[[Callable], Callable]) -> list[click.Parameter]:
    """The click parameters an option decorator adds, in the order ``--help`` shows them."""

    def nothing() -> None:
        pass

    decorator(nothing)
    return list(reversed(nothing.__click_params__))  # type: ignore[attr-defined]


# ---- Options declared by a pydantic model -----------------------------------------------------------------------
# ``save`` and ``add-form`` take the options ``SaveOptions`` and ``AddFormOptions`` declare: each field's name,
# type, default and description make its click option (``--kebab-name``; a bool is a flag, ``--x/--no-x`` when on
# by default; a Literal is a choice; the description is the help). ``Spelled`` says only where the command line
# spells one otherwise. The options are made when the command is first parsed or shown: the models' modules
# import pydantic and torch, which ``inspect`` and ``schema`` never pay for.


@dataclass(frozen=True)
class Spelled:
    """A model field's option where its declaration alone would not give today's command line."""

    field: str
    names: tuple[str, ...] = ()
    """The option's names (with short ones), instead of ``--kebab-name``."""
    type: Any = None
    """The click type, instead of the one the field's annotation gives."""


def _choice_of(annotation: Any) -> tuple[Any, ...] | None:
    """A ``Literal``'s values (``X | None`` looked through), else None."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    if len(args) == 1 and typing.get_origin(args[0]) is typing.Literal:
        return typing.get_args(args[0])
    return None


def _click_type(annotation: Any) -> Any:
    """click's type for a field's annotation: int, else text (str, SecretStr)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return click.INT if args == [int] else click.STRING


def field_option(model: type, spelled: Spelled) -> click.Option:
    """The click option of one field of ``model`` (a pydantic model): its value is what the model takes."""
    info = model.model_fields[spelled.field]
    names = list(spelled.names) or [f"--{spelled.field.replace('_', '-')}"]
    default = info.get_default(call_default_factory=True)
    kwargs: dict[str, Any] = dict(help=info.description, show_default=default not in (None, False))
    choices = _choice_of(info.annotation)
    if info.annotation is bool and default is True:
        names = [f"{names[0]}/--no-{names[0].removeprefix('--')}", *names[1:]]
        kwargs.update(default=True)
    elif info.annotation is bool:
        kwargs.update(is_flag=True, default=False, show_default=False)
    elif choices is not None:
        by_text = {str(choice): choice for choice in choices}
        kwargs.update(
            type=click.Choice(list(by_text)),
            default=None if default is None else str(default),
            callback=lambda ctx, param, value: by_text.get(value, value),
        )
    else:
        kwargs.update(type=spelled.type or _click_type(info.annotation), default=default)
    if isinstance(spelled.type, click.Path):  # a path option's value, as the model takes it: text
        kwargs["callback"] = lambda ctx, param, value: None if value is None else str(value)
    return click.Option([*names, spelled.field], **kwargs)


class ModelOptionsCommand(click.Command):
    """A command whose options include a pydantic model's fields, made on first use.

    ``options`` lists them in ``--help``'s order: a field's name or its ``Spelled``, or a click parameter of
    the command's own (they follow the parameters its decorators add). ``api_only``: the model's fields that
    are not options of the command; every other field must be one (a field added to the model shows up here or
    is named there).
    """

    def __init__(
        self,
        *args: Any,
        model: Callable[[], type],
        options: Sequence[str | Spelled | click.Parameter],
        api_only: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        self._model, self._options, self._api_only = model, options, tuple(api_only)
        self._made: list[click.Parameter] | None = None
        super().__init__(*args, **kwargs)

    @property
    def params(self) -> list[click.Parameter]:  # type: ignore[override]
        if self._made is None:
            model = self._model()
            made = [
                o
                if isinstance(o, click.Parameter)
                else field_option(model, o if isinstance(o, Spelled) else Spelled(o))
                for o in self._options
            ]
            missing = set(model.model_fields) - {p.name for p in made} - set(self._api_only)
            if missing:
                raise RuntimeError(f"{self.name}: {model.__name__} fields with no option: {sorted(missing)}")
            self._made = [*self._declared, *made]
        return self._made

    @params.setter
    def params(self, value: list[click.Parameter]) -> None:
        self._declared, self._made = list(value), None


def _remote(s3_access_key_id, s3_secret_access_key, s3_endpoint):
    from ..storage.remote import RemoteOptions

    return RemoteOptions(s3_access_key_id, s3_secret_access_key, s3_endpoint)


@app.command()
@click.argument("location")
@click.option("--json", "json", is_flag=True, help="Machine-readable output.")
@remote_options
def inspect(location: str, json: bool, **remote) -> None:
    """One row per layer: class, quant method, kernel, raw or processed, tensors, bytes, runtime state.

    LOCATION is a checkpoint directory, a manifest file, or an s3:// or http(s):// URI of either
    (only the manifest is read)."""
    from ..format.generation import BASE_DOCUMENT
    from ..storage.checkpoint import load_manifest
    from .summary import as_json, render

    path = _location(location)
    try:
        manifest, manifest_path = load_manifest(path, remote=_remote(**remote))
    except TensorizerManifestError as exc:
        _fail(exc)
    if json:
        sys.stdout.buffer.write(as_json(manifest) + b"\n")
    else:
        render(manifest, str(manifest_path), console())
        _say_generation(path, remote)
        if not isinstance(path, Path) or not isinstance(manifest_path, Path):
            return
        others = sorted(
            p.name
            for p in manifest_path.parent.glob("*.manifest.json")
            if p != manifest_path and p.name != BASE_DOCUMENT  # the base is no rank's: `_say_generation` shows it
        )
        if path.is_dir() and others:
            console().print(
                f"(this directory holds {len(others) + 1} rank manifests; "
                f"inspect the others by file: {', '.join(others)})"
            )


def _processed_layers(root, generation, form_set, remote) -> str:
    """How many of a form set's layers load processed (every rank's manifest): the others run vLLM's step."""
    from ..format.schema import fed_from_base
    from ..storage.checkpoint import load_manifest

    states: dict[str, set[str]] = {}
    fed: set[str] = set()
    try:
        for rank in form_set.ranks:
            manifest, _ = load_manifest(root, rank.stem, remote=remote, generation=generation, follow_pointer=False,
                                        vllm_version=form_set.fingerprint.vllm_version)  # fmt: skip
            for module in manifest.modules:
                states.setdefault(module.path, set()).add(module.state)
                if fed_from_base(module.tensors):
                    fed.add(module.path)
    except TensorizerManifestError as exc:
        return f"its rank manifests cannot be read ({exc})"
    processed = sum(state == {"processed"} for state in states.values())
    raw = len(states) - processed
    return (
        f"{processed} of {len(states)} layers processed"
        + (f" ({raw} raw: vLLM's step runs on them at load)" if raw else "")
        + (f"; {len(fed)} fed from the base (the form set stores only what vLLM's step changed)" if fed else "")
    )


def _say_generation(path, remote: dict) -> None:
    """For a checkpoint of format version 3: which generation was shown, what it holds, where its layers are
    processed (each form set: a layout on one machine kind and vLLM) and whether a base serves other layouts."""
    from ..storage.checkpoint import checkpoint_root, load_base, load_generation

    root = checkpoint_root(path, _remote(**remote))
    found = None if root is None else load_generation(root)
    if found is None:
        return
    generation = found[0]
    layouts = ", ".join(f"tp={s.layout.tp} pp={s.layout.pp} ({len(s.ranks)} ranks)" for s in generation.form_sets)
    console().print(
        f"generation {generation.id} ({generation.made_by}; over {generation.parent or 'nothing'}): {layouts}; "
        f"model files {', '.join(m.name for m in generation.model_files) or 'none'}",
        highlight=False,
    )
    for form_set in generation.form_sets:
        fingerprint = form_set.fingerprint
        features = " ".join(fingerprint.cpu_features)
        machine = f"{fingerprint.device_type} [{features}]" if features else fingerprint.device_type
        layers = _processed_layers(root, generation, form_set, _remote(**remote))
        console().print(
            f"  processed for tp={form_set.layout.tp} pp={form_set.layout.pp} on {machine}, vLLM "
            f"{fingerprint.vllm_version}, {fingerprint.dtype}: {layers}",
            highlight=False,
        )
    for form in generation.compile_forms:
        settings = " ".join(f"{name}={value}" for name, value in form.settings.items())
        console().print(
            f"  compile form for {' '.join(form.machine)}: vLLM {form.vllm_version}, torch {form.torch_version}, "
            f"engine settings {form.config_hash[:12]}{f' ({settings})' if settings else ''}, {len(form.files)} files "
            f"({form.archive.size:,} bytes); used "
            "by a compiling engine of that kind and settings, under a seal checked with its signing key",
            highlight=False,
            soft_wrap=True,
        )
    if generation.base is None:
        console().print("  no base: other tensor- and pipeline-parallel sizes are refused", highlight=False)
        return
    try:
        base, _, _ = load_base(root, generation)
    except TensorizerManifestError as exc:
        _fail(exc)
    where = (
        f"{base.tensor_file.size:,} bytes"
        if base.tensor_file is not None
        else f"by reference: {len(base.source.files)} safetensors file(s) of {base.source.root}, not copied"
    )
    console().print(
        f"  base: {len(base.tensors)} source tensors ({where}, observed at tp={base.observed.tp}): any other tensor- "
        "or pipeline-parallel size, and another vLLM release, loads through it",
        highlight=False,
    )


@app.command()
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
    type=_PATH,
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
    import msgspec

    from ..checks.validate import check_engine_settings, validate_checkpoint
    from ..progress import terminal_progress

    with terminal_progress("hashing", enabled=hashes and not json) as progress:
        report = validate_checkpoint(
            _location(location),
            verify_hashes=hashes,
            signing_key_file=signing_key_file,
            encryption_key_file=encryption_key_file,
            progress=progress,
            remote=_remote(**remote),
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
        sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n")
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


@app.command()
@click.argument("a")
@click.argument("b")
@click.option("--json", "json", is_flag=True, help="Machine-readable output.")
@remote_options
def diff(a: str, b: str, json: bool, **remote) -> None:
    """What differs between two checkpoints (directories, manifest files or URIs); exit 0 when they are the
    same, 1 when they differ."""
    import msgspec

    from ..storage.checkpoint import load_manifest
    from .diff import diff_manifests

    options = _remote(**remote)
    try:
        ma, _ = load_manifest(_location(a), remote=options)
        mb, _ = load_manifest(_location(b), remote=options)
    except TensorizerManifestError as exc:
        _fail(exc)
    result = diff_manifests(ma, mb)
    if json:
        sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(result.to_dict()), indent=2) + b"\n")
    else:
        if result.same:
            console().print("the checkpoints describe the same model, layers and tensors")
        for field_name, x, y in result.fingerprint:
            console().print(f"fingerprint.{field_name}: {x!r} -> {y!r}", highlight=False)
        for path in result.layers_removed:
            console().print(f"[red]- {path}[/red]", highlight=False)
        for path in result.layers_added:
            console().print(f"[green]+ {path}[/green]", highlight=False)
        for path, what, x, y in result.layers_changed:
            console().print(f"~ {path}: {what}: {x!r} -> {y!r}", highlight=False)
    raise SystemExit(0 if result.same else 1)


@app.command()
@click.option("--json", "json", is_flag=True, help="Machine-readable output.")
@click.option("--markdown", is_flag=True, help="The table as Markdown (docs/kernels-inventory.md).")
@click.option("--all", "show_all", is_flag=True, help="Also classes with no post-load step.")
def kernels(json: bool, markdown: bool, show_all: bool) -> None:
    """Every vLLM class with a post-load step in the installed vLLM, with its strategy (our restorer, vLLM's
    pre-processed branch, raw only) and verification status."""
    import msgspec

    from ..restorers.inventory import STRATEGY_NONE, build_inventory, to_markdown

    inventory = build_inventory()
    if not show_all:
        inventory.entries = [e for e in inventory.entries if e.strategy != STRATEGY_NONE]
    if json:
        sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(inventory.to_dict()), indent=2) + b"\n")
        return
    if markdown:
        sys.stdout.write(to_markdown(inventory))
        return
    from rich.table import Table

    table = Table(title=f"vLLM {inventory.vllm_version}: classes with a post-load step")
    for column in ("family", "vLLM class", "strategy", "restorer", "status"):
        table.add_column(column)
    for e in inventory.entries:
        table.add_row(
            e.family, e.vllm_class.removeprefix("vllm.model_executor."), e.strategy, e.restorer or "-", e.status
        )
    console().print(table)
    console().print(f"{len(inventory.unimportable)} vLLM modules do not import here (other hardware); not listed")


@app.command("verify-kernels")
@click.argument("model")
@click.option("--work-dir", type=_PATH, default=None, help="Where the checkpoint is written (default: a temp dir).")
@click.option("--dtype", default="auto", show_default=True, help="Model dtype, as vLLM's --dtype.")
@click.option("--quantization", default=None, help="As vLLM's --quantization.")
@click.option("--max-model-len", type=int, default=None)
@click.option("--kv-cache-dtype", default=None, help="As vLLM's --kv-cache-dtype.")
@click.option("--engine-arg", "engine_arg", multiple=True, metavar="KEY=VALUE", help="As for save.")
@click.option("--record-out", type=_PATH, default=None, help="Write the verification records (JSON) here.")
@click.option("--install", is_flag=True, help="Add passing records to your verified set (see `kernels`).")
@click.option("--json", "json", is_flag=True, help="Machine-readable output.")
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

    import msgspec

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the report's
    from ..format.verification import user_records_dir, write_records
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
            _fail(exc)
    if record_out is not None:
        write_records(result.records, record_out)
    if install:
        passing = [r for r in result.records if r.result == "pass"]
        stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        write_records(passing, user_records_dir() / f"{stamp}-{Path(model).name}.json")
    if json:
        sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(result.records), indent=2) + b"\n")
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


@app.command()
def schema() -> None:
    """Print the manifest's JSON Schema (generated from the types)."""
    import msgspec

    from ..format.schema import json_schema

    sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(json_schema()), indent=2) + b"\n")


def parse_engine_args(items: tuple[str, ...]) -> dict:
    """``KEY=VALUE`` pairs as vLLM keyword arguments: JSON values where they parse, strings otherwise."""
    import json

    args: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--engine-arg")
        try:
            args[key.strip().replace("-", "_")] = json.loads(value)
        except ValueError:
            args[key.strip().replace("-", "_")] = value
    return args


def _save_options() -> type:
    from ..save.from_source import SaveOptions

    return SaveOptions


@app.command(
    cls=ModelOptionsCommand,
    model=_save_options,
    options=[
        "dtype",
        "quantization",
        Spelled("tensor_parallel_size", ("--tensor-parallel-size", "-tp")),
        Spelled("pipeline_parallel_size", ("--pipeline-parallel-size", "-pp")),
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
        Spelled("signing_key_file", type=_PATH),
        "allow_unconditional_writes",
        "format_version",
        *_options_of(remote_options),
        Spelled("encryption_key_file", (*ENCRYPTION_KEY_NAMES, "--encrypt-key-file"), type=_PATH),
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
    from ..errors import ConfigurationError
    from ..progress import interactive
    from ..save.from_source import save_checkpoint

    engine_args = parse_engine_args(engine_arg)
    if kv_cache_dtype is not None:
        engine_args["kv_cache_dtype"] = kv_cache_dtype
    if enable_expert_parallel:
        engine_args["enable_expert_parallel"] = True
    try:
        result = save_checkpoint(src, out, **options, engine_args=engine_args, progress=interactive())
    except ConfigurationError as exc:
        err_console().print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise SystemExit(2) from None
    except TensorizerManifestError as exc:
        _fail(exc)
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


def _add_form_options() -> type:
    from ..save.add_form import AddFormOptions

    return AddFormOptions


@app.command(
    "add-form",
    cls=ModelOptionsCommand,
    model=_add_form_options,
    options=[
        click.Option(["--engine-arg", "engine_arg"], multiple=True, metavar="KEY=VALUE", help="As for save."),
        Spelled("tensor_parallel_size", ("--tensor-parallel-size", "-tp")),
        Spelled("pipeline_parallel_size", ("--pipeline-parallel-size", "-pp")),
        Spelled("signing_key_file", type=_PATH),
        Spelled("encryption_key_file", ENCRYPTION_KEY_NAMES, type=_PATH),
        *_options_of(remote_options),
        "allow_unconditional_writes",
        "compile",
        "for_server",
        click.Option(["--json", "json"], is_flag=True, help="Machine-readable output."),
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
    from ..save.add_form import add_form

    try:
        result = add_form(checkpoint, **options, engine_args=parse_engine_args(engine_arg))
    except TensorizerManifestError as exc:
        _fail(exc)
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


@app.command()
@click.argument("uri")
@click.argument("cache_dir", type=_PATH)
@remote_options
def fetch(uri: str, cache_dir: Path, **remote) -> None:
    """Download the config and tokenizer files (no weights) of the remote checkpoint URI into CACHE_DIR.

    vLLM's model must be a local directory: start it with model=CACHE_DIR,
    load_format='tensorizer_manifest' and model_loader_extra_config={"checkpoint_dir": URI}; the tensors
    stream from URI at load."""
    from ..storage.remote import is_remote
    from ..storage.remote_checkpoint import fetch_model_files

    if not is_remote(uri):
        err_console().print(f"[red]error:[/red] {uri}: not an s3:// or http(s):// URI", highlight=False)
        raise SystemExit(2)
    try:
        target = fetch_model_files(uri, cache_dir, _remote(**remote))
    except TensorizerManifestError as exc:
        _fail(exc)
    console().print(f"fetched {', '.join(sorted(p.name for p in target.iterdir()))} into {target}", highlight=False)
    config = json_dumps({"checkpoint_dir": uri})
    console().print(
        f"start vLLM with: --model {target} --load-format tensorizer_manifest --model-loader-extra-config '{config}'",
        highlight=False,
        soft_wrap=True,
    )


@app.command()
@click.argument("checkpoint")
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="Seconds a generation stays after a newer one is committed (loaders that read the older pointer finish).",
)
@click.option(
    "--orphan-grace",
    type=click.FloatRange(min=0),
    default=86400.0,
    show_default=True,
    help="Seconds files no committed generation names (a writer killed, or still writing) stay after their last "
    "write; longer than your slowest save.",
)
@click.option(
    "--keep",
    "keep",
    multiple=True,
    metavar="GENERATION_ID",
    help="Keep this generation and every file it names, whatever its age (one vLLM serves as "
    "CHECKPOINT/generations/<id>). Repeatable.",
)
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@click.option("--json", "json", is_flag=True, help="Machine-readable output.")
@remote_options
def gc(checkpoint: str, grace: float, orphan_grace: float, keep: tuple[str, ...], dry_run: bool, json: bool,
       **remote) -> None:  # fmt: skip
    """Remove the files of CHECKPOINT (format version 3; a directory or an s3:// URI) that no generation current
    within the grace period names, and orphans past theirs. Ages are read off the storage's own clock.

    Writers do this after each commit with the defaults; run it to reclaim space sooner or on a schedule."""
    from ..errors import ConfigurationError
    from ..format.generation import is_generation_id
    from ..storage.generations import LocalCheckpoint, S3Checkpoint
    from ..storage.remote import RemoteDir

    try:
        for generation_id in keep:
            if not is_generation_id(generation_id):
                raise ConfigurationError(
                    f"--keep {generation_id}: not a generation id (a folder name under generations/, as "
                    "'tensorizer-manifest inspect' lists them)"
                )
        location = _location(checkpoint)
        if isinstance(location, str) and not location.startswith("s3://"):
            raise ConfigurationError(f"{location}: gc removes files; an http(s) checkpoint is read-only")
        store = LocalCheckpoint(location) if isinstance(location, Path) else S3Checkpoint(
            RemoteDir(location, _remote(**remote))
        )  # fmt: skip
        plan = store.plan_gc(grace_s=grace, orphan_grace_s=orphan_grace, keep=keep)
        removed = [] if dry_run else store.gc(plan)
    except TensorizerManifestError as exc:
        _fail(exc)
    if json:
        report = {"current": plan.current, "kept_generations": plan.kept_generations, "delete": plan.delete,
                  "removed": removed, "waiting": plan.waiting}  # fmt: skip
        console().print_json(json_dumps(report))
        return
    console().print(f"current generation {plan.current}; kept: {', '.join(plan.kept_generations)}", highlight=False)
    for path in plan.delete if dry_run else removed:
        console().print(f"{'would remove' if dry_run else 'removed'} {path}", highlight=False)
    for path, why in plan.waiting.items():
        console().print(f"kept for now: {path} ({why})", highlight=False)


def json_dumps(value: object) -> str:
    import json

    return json.dumps(value)


@app.command()
@click.option(
    "--work-dir",
    type=_PATH,
    default=Path(".cache/demo"),
    show_default=True,
    help="Where the tiny model and checkpoint are kept (cached).",
)
@click.option(
    "--kind",
    type=click.Choice(TINY_KINDS),
    default="w8a8-int8",
    show_default=True,
    help="Tiny model; w8a8-int8 has raw and processed layers.",
)
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--verbose", "-v", is_flag=True, help="Show vLLM's INFO logs (only its warnings and errors otherwise).")
def demo(work_dir: Path, kind: str, max_tokens: int, verbose: bool) -> None:
    """Build a tiny model, save it with a manifest, inspect it, load it back through vLLM, compare tokens."""
    # Read by vLLM when it is first imported: its INFO logs and configuration dumps would drown the story.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    # Its three engines run one after another in this process, as an offline script's do: vLLM's engine-core
    # process would import vLLM again for each (on 2 cores, 100 s of demo against 30 s). Set it to 1 to see
    # the demo through vLLM's multiprocess engine, which the tests also load through.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from ..progress import interactive
    from .demo import run_demo

    try:
        ok = run_demo(work_dir, kind, max_tokens, console(), progress=interactive())
    except TensorizerManifestError as exc:
        _fail(exc)
    raise SystemExit(0 if ok else 1)


def main() -> None:
    app(prog_name="tensorizer-manifest")
