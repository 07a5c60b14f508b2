"""What users may pass a load in ``model_loader_extra_config`` (``LoadOptions``): validated by pydantic, vLLM's
``TensorizerConfig`` names taken with their meaning. The load's steps read it (``plan``, ``load_model``); the
loader vLLM calls parses it from its ``load_config``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from .._constants import LOAD_FORMAT
from ..errors import ConfigurationError
from ..storage.checkpoint import checkpoint_location
from ..storage.option_models import (
    S3Options,
    describe_validation_error,
    from_tensorizer_config_names,
    tensorizer_config_options,
)


class LoadOptions(S3Options):
    """What users may pass in ``model_loader_extra_config`` for ``tensorizer_manifest``.

    vLLM's ``TensorizerConfig`` names work too, with the same meaning (``tensorizer_uri``, ``tensorizer_dir``,
    ``verify_hash``, ``encryption_keyfile``, ``num_readers``, ``s3_*``): ``options.TENSORIZER_CONFIG_NAMES``.
    """

    model_config = ConfigDict(extra="forbid")

    verify_hashes: bool = Field(True, description="Check each tensor's content hash as it is read (verify_hash).")
    checkpoint_dir: str | None = Field(
        None, description="Checkpoint directory or URI, when not the model path (tensorizer_dir)."
    )
    tensorizer_uri: str | None = Field(
        None,
        description="A tensor file of the checkpoint (local, s3:// or https://), as vLLM's tensorizer_uri; its "
        "manifest is the one beside it. A sharded engine's ranks each read their own files in that directory.",
    )
    num_readers: int | None = Field(
        None, ge=1, le=64, description="Parallel readers of the tensor file (default: one per core, at most 8)."
    )
    overlap_steps: bool | None = Field(
        None,
        description="true: run each layer's post-load step or restorer as soon as its tensors are in, while "
        "later layers are still being read; false: every step after the reading. Default: restorers at once, "
        "vLLM's own steps on raw layers at once on accelerators and after the reading on CPU, where they "
        "(oneDNN packing) use every core and slow the readers more than the overlap gains (docs/performance.md).",
    )
    signing_key_file: str | None = Field(
        None,
        description="Path of the key the checkpoint was saved with (else $TENSORIZER_MANIFEST_SIGNING_KEY); "
        "with a key, only a manifest sealed with it loads.",
    )
    encryption_key_file: str | None = Field(
        None,
        description="Path of the key an encrypted checkpoint was saved with "
        "(else $TENSORIZER_MANIFEST_ENCRYPTION_KEY); "
        "with a key, only an encrypted checkpoint whose seal the key (or the signing key) checks loads.",
    )
    progress: bool = Field(
        False, description="Draw a progress bar of the read on stderr (rank 0, when stdout and stderr are terminals)."
    )
    source: Literal["auto", "base"] = Field(
        "auto",
        description="auto: each rank takes its form set where one fits this engine, the base otherwise. base: "
        "every layer from the checkpoint's base through vLLM's own weight loaders, even where a form set fits (to "
        "check a base, or to measure it); a checkpoint without a base is refused.",
    )
    base_source_dir: str | None = Field(
        None,
        description="Where the source a base by reference (save --base reference) names is now, if it moved since "
        "the save (else the directory recorded then); its files must be the ones saved (size, content hashes).",
    )
    add_form: bool = Field(
        False,
        description="Observe vLLM's step on the layers loaded through their raw fallback, so that the worker "
        "method add_tensorizer_manifest_form can add this engine's processed form of them (`add-form`).",
    )
    trust_compile_forms: bool = Field(
        False,
        description="Use a compile form of a checkpoint whose seal is not checked with your signing key, and place "
        "vLLM's record of its model class in vLLM's cache: trusts whoever can write the checkpoint to run code in "
        "this process (compiled graphs are code) and to tell vLLM what the class supports. Without it, both are "
        "used only where signing_key_file checked the seal.",
    )
    compile_form_dir: str | None = Field(
        None,
        description="Where this engine's compile cache goes, for add-form --compile to make a compile form of "
        "(no compile form of the checkpoint is used then).",
    )

    @classmethod
    def from_load_config(cls, load_config: Any) -> LoadOptions:
        extra = getattr(load_config, "model_loader_extra_config", None) or {}
        if hasattr(extra, "to_serializable"):  # a vLLM TensorizerConfig given as it is
            extra = tensorizer_config_options(extra)
        raw = from_tensorizer_config_names(dict(extra), LOAD_FORMAT)
        try:
            return cls(**raw)
        except ValidationError as exc:
            raise ConfigurationError(
                f"invalid model_loader_extra_config for {LOAD_FORMAT}: {describe_validation_error(exc)}"
            ) from None

    def checkpoint_location(self, model_path: str) -> tuple[str, str | None]:
        """Where the checkpoint is, and the tensor file ``tensorizer_uri`` names there (None if none)."""
        return checkpoint_location(self.tensorizer_uri, self.checkpoint_dir, model_path)
