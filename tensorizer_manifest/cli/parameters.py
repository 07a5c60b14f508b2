"""The options the commands take: those several commands share (a checkpoint's location, the ``--s3-*``
credentials, the encryption key file, ``--engine-arg``), and those a pydantic option model declares.

``save`` and ``add-form`` take the options ``SaveOptions`` and ``AddFormOptions`` declare: each field's name,
type, default and description make its click option (``--kebab-name``; a bool is a flag, ``--x/--no-x`` when on
by default; a Literal is a choice; the description is the help). ``Spelled`` says only where the command line
spells one otherwise. The options are made when the command is first parsed or shown: the models' modules
import pydantic and torch, which ``inspect`` and ``schema`` never pay for.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from pydantic import BaseModel

    from ..storage.remote import RemoteOptions

PATH = click.Path(path_type=Path)


def location_of(value: str) -> Path | str:
    """A checkpoint argument: a local path, or an ``s3://`` / ``http(s)://`` URI kept as it is."""
    from ..storage.remote import is_remote

    return value if is_remote(value) else Path(value)


def remote_options(fn):
    """``--s3-access-key-id``, ``--s3-secret-access-key``, ``--s3-endpoint``: for s3:// checkpoints."""
    from ..storage.remote.credentials import S3_OPTIONS_HELP

    for name, help_text in reversed(S3_OPTIONS_HELP.items()):
        fn = click.option("--" + name.replace("_", "-"), default=None, help=help_text)(fn)
    return fn


def remote_from(s3_access_key_id, s3_secret_access_key, s3_endpoint) -> RemoteOptions:
    """The ``remote_options`` a command was given, as the storage takes them."""
    from ..storage.remote import RemoteOptions

    return RemoteOptions(s3_access_key_id, s3_secret_access_key, s3_endpoint)


#: The encryption key file's spellings: ours and vLLM's (``--encryption-keyfile``, as ``encryption_keyfile`` in
#: ``model_loader_extra_config``). ``save`` also takes ``--encrypt-key-file``, which it always has.
ENCRYPTION_KEY_NAMES = ("--encryption-key-file", "--encryption-keyfile")


def encryption_key_option(help_text: str):
    """``--encryption-key-file`` (vLLM's ``--encryption-keyfile`` too) as a command reads or writes it."""
    return click.option(*ENCRYPTION_KEY_NAMES, "encryption_key_file", type=PATH, default=None, help=help_text)


#: ``--json``, as most commands take it.
json_option = click.option("--json", "json", is_flag=True, help="Machine-readable output.")


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


def options_of(decorator: Callable[[Callable], Callable]) -> list[click.Parameter]:
    """The click parameters an option decorator adds, in the order ``--help`` shows them."""

    def nothing() -> None:
        pass

    decorator(nothing)
    return list(reversed(nothing.__click_params__))  # type: ignore[attr-defined]


# ---- Options declared by a pydantic model -----------------------------------------------------------------------


@dataclass(frozen=True)
class Spelled:
    """A model field's option where its declaration alone would not give today's command line."""

    field: str
    names: tuple[str, ...] = ()
    """The option's names (with short ones), instead of ``--kebab-name``."""
    type: Any = None
    """The click type, instead of the one the field's annotation gives."""


#: The layout sizes as vLLM's command line spells them (``-tp``, ``-pp``).
PARALLEL_SIZES = (
    Spelled("tensor_parallel_size", ("--tensor-parallel-size", "-tp")),
    Spelled("pipeline_parallel_size", ("--pipeline-parallel-size", "-pp")),
)


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


def field_option(model: type[BaseModel], spelled: Spelled) -> click.Option:
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
        model: Callable[[], type[BaseModel]],
        options: Sequence[str | Spelled | click.Parameter],
        api_only: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        self._model, self._options, self._api_only = model, options, tuple(api_only)
        self._made: list[click.Parameter] | None = None
        super().__init__(*args, **kwargs)

    @property
    def params(self) -> list[click.Parameter]:
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
