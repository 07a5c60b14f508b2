"""The parts of the option models (pydantic) that saving and loading share.

Kept apart from the ``remote`` package so that ``inspect`` and ``validate``, which read
remote checkpoints but take no option models, never import pydantic (a fifth
of a second at start-up).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, Field, SecretStr, ValidationError

from .remote import RemoteOptions
from .remote.credentials import S3_OPTIONS_HELP


def describe_validation_error(exc: Any) -> str:
    """A pydantic ``ValidationError`` as text without the values given (one of them may be a credential)."""
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'options'}: {error['msg']}"
        for error in exc.errors(include_url=False, include_input=False)
    )


Model = TypeVar("Model", bound=BaseModel)


def parse_options(model: type[Model], options: dict[str, Any], what: str) -> Model:
    """``model(**options)``; a mistake is a ``ConfigurationError`` naming the option (never its value)."""
    from ..errors import ConfigurationError

    try:
        return model(**options)
    except ValidationError as exc:
        raise ConfigurationError(f"invalid {what}: {describe_validation_error(exc)}") from None


class S3Options(BaseModel):
    """The S3 fields of the save and load options (pydantic): one place for their names and their fallbacks."""

    s3_access_key_id: str | None = Field(None, repr=False, description=S3_OPTIONS_HELP["s3_access_key_id"])
    s3_secret_access_key: SecretStr | None = Field(
        None, repr=False, description=S3_OPTIONS_HELP["s3_secret_access_key"]
    )
    s3_endpoint: str | None = Field(None, description=S3_OPTIONS_HELP["s3_endpoint"])

    def remote(self) -> RemoteOptions:
        """Credentials and endpoint for an s3:// location (unset ones resolved as tensorizer does)."""
        secret = self.s3_secret_access_key
        return RemoteOptions(
            access_key_id=self.s3_access_key_id,
            secret_access_key=secret.get_secret_value() if secret is not None else None,
            endpoint=self.s3_endpoint,
        )


#: vLLM's ``TensorizerConfig`` option names that mean the same here under this package's name, so that a
#: ``--load-format tensorizer`` deployment's ``model_loader_extra_config`` works as it is.
TENSORIZER_CONFIG_NAMES = {
    "tensorizer_dir": "checkpoint_dir",
    "verify_hash": "verify_hashes",
    "encryption_keyfile": "encryption_key_file",
}

#: ``TensorizerConfig`` options that mean nothing for a manifest checkpoint, and why: refused, never ignored.
TENSORIZER_CONFIG_UNUSED = {
    "vllm_tensorized": "every tensorizer-manifest checkpoint is a vLLM model, and its manifest says how each "
    "layer was saved; drop the option",
    "serialization_kwargs": "the load format only reads; saving takes its options in `tensorizer-manifest save` "
    "or in the worker method save_tensorizer_manifest (docs/migrating.md)",
    "deserialization_kwargs": "the manifest fixes how each tensor is read (its device, dtype and hash); use "
    "num_readers and verify_hash",
    "stream_kwargs": "credentials and the endpoint go in s3_access_key_id, s3_secret_access_key and s3_endpoint",
}


def tensorizer_config_options(config: Any) -> dict[str, Any]:
    """A vLLM ``TensorizerConfig`` object as the dict its user would have written.

    Its ``__post_init__`` turns ``tensorizer_dir=D`` into ``tensorizer_uri=D/model.tensors`` (stock vLLM's
    file name, which names no file of a manifest checkpoint), and ``to_serializable`` then drops the directory:
    the directory is what was meant, and is kept instead.
    """
    options = config.to_serializable()
    directory = getattr(config, "tensorizer_dir", None)
    if directory and options.get("tensorizer_uri") == f"{directory}/model.tensors":
        del options["tensorizer_uri"]
        options["tensorizer_dir"] = directory
    return options


def from_tensorizer_config_names(extra_config: dict[str, Any], load_format: str) -> dict[str, Any]:
    """``model_loader_extra_config`` with vLLM's ``TensorizerConfig`` names turned into this package's.

    An option that means nothing here, given a value, is a ``ConfigurationError`` saying why (unset, as a
    ``TensorizerConfig`` object carries them, it is dropped); so is one option given under both names with
    different values.
    """
    from ..errors import ConfigurationError

    # given, that is: a TensorizerConfig object carries them all, unset ones as None or {}
    unused = sorted(name for name in TENSORIZER_CONFIG_UNUSED if extra_config.get(name) not in (None, {}, False))
    if unused:
        raise ConfigurationError(
            f"model_loader_extra_config for {load_format}: "
            + "; ".join(f"{name} means nothing here: {TENSORIZER_CONFIG_UNUSED[name]}" for name in unused)
        )
    options = {name: value for name, value in extra_config.items() if name not in TENSORIZER_CONFIG_UNUSED}
    for stock, ours in TENSORIZER_CONFIG_NAMES.items():
        if stock not in options:
            continue
        value = options.pop(stock)
        if ours in options and options[ours] != value:
            raise ConfigurationError(
                f"model_loader_extra_config for {load_format}: {stock} (vLLM's name) and {ours} are one option, "
                "given two values; keep one"
            )
        options[ours] = value
    return options
