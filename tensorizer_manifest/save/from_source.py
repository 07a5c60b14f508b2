"""Save side, from Python: start a vLLM engine that observes its own post-load step, then save.

The counterpart of vLLM's ``save_tensorized_model``. With an engine of your
own, start it with ``load_format=CAPTURE_LOAD_FORMAT`` and
``worker_extension_cls=WORKER_EXTENSION`` and call
``llm.collective_rpc("save_tensorizer_manifest", args=(out_dir,))``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field

from .. import _vllm_compat
from .._constants import (
    CAPTURE_LOAD_FORMAT,
    CPU_GEMM_ENV,
    ENCRYPTION_KEY_ENV,
    SIGNING_KEY_ENV,
    SPILL_DIR_ENV,
    WORKER_EXTENSION,
)
from .._error_relay import errors_typed
from .._signatures import takes_keywords_of
from ..errors import CheckpointNotFoundError, ConfigurationError, TensorizerManifestError
from ..storage.checkpoint import encryption_key_from, signing_key_from
from ..storage.generations import LocalCheckpoint
from ..storage.option_models import S3Options, parse_options
from ..storage.remote import RemoteDir, is_remote, probe_conditional_writes
from ..storage.remote_checkpoint import publish_to_s3, upload_checkpoint


class SaveOptions(S3Options):
    """Engine options a user sets when saving (validated, with readable errors).

    The one declaration of the save options: ``save_checkpoint``'s signature and the options of
    ``tensorizer-manifest save`` are made from these fields (name, type, default, description).
    """

    model_config = ConfigDict(extra="forbid")

    dtype: str = Field("auto", description="Model dtype, as vLLM's --dtype.")
    quantization: str | None = Field(None, description="As vLLM's --quantization.")
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    max_model_len: int | None = Field(
        None,
        ge=1,
        description=(
            "The saving engine's context. By default a short one (SAVING_CONTEXT_LEN tokens, or the model's own "
            "if shorter): the saving engine serves no request, and nothing saved depends on it, so the "
            "checkpoint loads in an engine of any max_model_len."
        ),
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1 << 20,
        description=(
            "The saving engine's KV cache. By default 64 MiB, or room for 256 tokens where a model's are larger "
            "(vLLM's CPU cache blocks are 128 or 256 tokens): saving serves no request."
        ),
    )
    revision: str | None = None
    trust_remote_code: bool = False
    cpu_gemm: Literal["auto", "fallback"] = Field(
        "auto",
        description=(
            "On CPU, 'fallback' keeps linear weights (vLLM's torch path, not oneDNN) so linear layers save processed."
        ),
    )
    portable: bool = Field(
        False,
        description="Save every layer raw: loads on any machine whose engine settings match "
        "(vLLM's step runs at load).",
    )
    allow_unverified: bool = Field(
        False,
        description="Save processed also where the restorer is not verified on this device kind (recorded per layer).",
    )
    fallbacks: bool = Field(
        True,
        description=(
            "Keep, beside each layer saved processed in a form that belongs to one machine kind or one kernel "
            "(4-bit repacks, prepacked experts), its raw tensors: the checkpoint then loads on other machines and "
            "other vLLM versions, those layers through vLLM's own step. False (--no-fallbacks) saves only the "
            "processed form (smaller; refused where the form does not fit). docs/performance.md has the bytes it adds."
        ),
    )
    engine_args: dict[str, Any] = Field(default_factory=dict, description="Any further vllm.LLM keyword arguments.")
    signing_key_file: str | None = Field(
        None,
        description=(
            "Path of a key file (else $TENSORIZER_MANIFEST_SIGNING_KEY): the manifest is sealed with a MAC that "
            "only the key's holders can make; without one, with a plain digest. Loading and validating then need "
            "the same key."
        ),
    )
    encryption_key_file: str | None = Field(
        None,
        description=(
            "Path of a key file (else $TENSORIZER_MANIFEST_ENCRYPTION_KEY): the tensor data is encrypted with "
            "tensorizer's encryption under a key derived from it; without a signing key, the manifest is sealed "
            "with a MAC keyed from it too. Loading needs the same key (encryption_key_file in "
            "model_loader_extra_config)."
        ),
    )
    progress: bool = Field(
        False, description="Draw a progress bar of the write on stderr (when stdout and stderr are terminals)."
    )
    allow_unconditional_writes: bool = Field(
        False,
        description=(
            "Write to an S3 server that ignores conditional writes (If-Match, If-None-Match), accepting that of two "
            "writers of one checkpoint the last one wins, silently. Refused by default (UnsafeStorageError)."
        ),
    )
    format_version: Literal[2, 3] = Field(
        3,
        description=(
            "3: the checkpoint as immutable generations behind one pointer, committed once for every rank, with "
            "the model files inside (docs/design.md, 'Format version 3'; "
            "read by tensorizer-manifest 0.5 and later). 2: one manifest per rank, read by 0.4 and later."
        ),
    )

    base: Literal["auto", "inside", "reference", "none"] = Field(
        "auto",
        description=(
            "inside: write the layout-free base too (the source's tensors as vLLM's loader reads them, with the "
            "modules each one fills): the checkpoint then loads at any tensor- or pipeline-parallel layout and on "
            "another vLLM release, through vLLM's own weight loaders where no saved form fits, and its form set "
            "stores only what vLLM's step changed (format version 3; a save at pipeline_parallel_size=1 without "
            "expert parallelism). reference: the same, the source's own safetensors files named with their sizes "
            "and every tensor's hash instead of copied (no extra disk; the checkpoint then needs the source where it "
            "was, or named at load with base_source_dir; a local output, unencrypted). none: the saved layout only. "
            "auto: inside wherever the save can observe it, none elsewhere."
        ),
    )

    def writes_base(self) -> bool:
        """Whether this save writes a base: ``inside``, or ``auto`` where the saving engine can observe it."""
        if self.base != "auto":
            return self.base in ("inside", "reference")
        return self.format_version == 3 and self.pipeline_parallel_size == 1 and not self.expert_parallel()

    def expert_parallel(self) -> bool:
        return bool(self.engine_args.get("enable_expert_parallel"))

    @classmethod
    def parse(cls, options: dict[str, Any]) -> SaveOptions:
        """Validated options; a mistake is a ``ConfigurationError`` naming the option (never its value)."""
        return parse_options(cls, options, "save option")


_NO_REMOTE = {"s3_access_key_id": None, "s3_secret_access_key": None, "s3_endpoint": None}


@dataclass
class SaveResult:
    out_dir: Path | str
    """The local directory, or the ``s3://`` URI the checkpoint was uploaded to."""
    ranks: list[dict] = field(default_factory=list)
    copied_files: list[str] = field(default_factory=list)


def resolve_model_dir(src: str, revision: str | None = None) -> Path:
    """A local directory for ``src``: itself, or its snapshot in the Hugging Face cache (never downloaded)."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(src, revision=revision, local_files_only=True))
    except Exception as exc:
        raise CheckpointNotFoundError(
            f"{src}: not a local directory and not in the Hugging Face cache ({exc.__class__.__name__}); "
            "download the model first or pass a local path"
        ) from None


def apply_cpu_gemm(mode: str) -> None:
    """Select vLLM's CPU GEMM path in this process and (through the env) in its workers."""
    if mode == "fallback":
        os.environ[CPU_GEMM_ENV] = "fallback"
        _vllm_compat.disable_onednn()


#: The saving engine's context when none is asked for. vLLM sizes the KV cache to hold one sequence of
#: ``max_model_len`` tokens, and a model's own context (128k for Llama 3) would need gigabytes of it; the
#: saving engine only loads and processes weights, which no context length changes
#: (``docs/fingerprint-policy.md``). Short enough that 64 MiB of KV cache holds it for any model that fits.
SAVING_CONTEXT_LEN = 32

#: Config keys vLLM derives a model's context from (``derive_max_model_len_and_key``), smallest wins.
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """The model's config.json, its text part merged over it (multimodal configs); {} when unreadable, and
    vLLM then says what is wrong with it."""
    import json

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def saving_context_len(config: dict[str, Any]) -> int:
    """``SAVING_CONTEXT_LEN``, or the model's own context where that is shorter (vLLM refuses a longer one)."""
    lengths = [v for k in _CONTEXT_KEYS if isinstance(v := config.get(k), int) and v > 0]
    return min([SAVING_CONTEXT_LEN, *lengths])


#: What the saving engine's KV cache holds at least: two blocks of vLLM's CPU cache (128 tokens, 256 for some
#: backends), whatever the context, so that vLLM's check that one sequence fits passes for any model.
_SAVING_KV_TOKENS = 256


def saving_kv_cache_bytes(config: dict[str, Any]) -> int:
    """64 MiB, or ``_SAVING_KV_TOKENS`` of the model's keys and values in float32 where that is more (a 405B
    model's 126 layers take 1 MiB a token). A config without the sizes gets 64 MiB."""
    fields = ("num_hidden_layers", "num_attention_heads", "hidden_size")
    if not all(isinstance(config.get(k), int) and config[k] > 0 for k in fields):
        return 64 << 20
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * heads * head_dim * 4
    return max(64 << 20, per_token * _SAVING_KV_TOKENS)


def engine_kwargs(options: SaveOptions, model_dir: Path) -> dict[str, Any]:
    """The saving engine's ``vllm.LLM`` keyword arguments for the model in ``model_dir``."""
    config = read_model_config(model_dir)
    max_model_len = options.max_model_len
    if max_model_len is None and "max_model_len" not in options.engine_args:
        max_model_len = saving_context_len(config)
    kv_cache_memory_bytes = options.kv_cache_memory_bytes
    if kv_cache_memory_bytes is None:
        kv_cache_memory_bytes = saving_kv_cache_bytes(config)
    kwargs: dict[str, Any] = dict(
        dtype=options.dtype,
        quantization=options.quantization,
        tensor_parallel_size=options.tensor_parallel_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        revision=options.revision,
        trust_remote_code=options.trust_remote_code,
        enforce_eager=True,
        max_num_seqs=1,
        model_loader_extra_config={
            "portable": options.portable,
            "allow_unverified": options.allow_unverified,
            "fallbacks": options.fallbacks,
            "base": options.writes_base(),
        },
    )
    kwargs.update(options.engine_args)
    return kwargs


@takes_keywords_of(SaveOptions)
def save_checkpoint(src: str | os.PathLike, out: str | os.PathLike, **options: Any) -> SaveResult:
    """Load ``src`` with vLLM and write a self-describing checkpoint into ``out``.

    The options, keyword-only, are ``SaveOptions``' fields (the signature shows them; a mistake in one is a
    ``ConfigurationError`` naming it).

    ``out`` receives the config and tokenizer files of ``src`` (copied), one
    ``*.tensors`` file and one ``*.manifest.json`` per rank. While saving, the
    pre-step tensors of layers with a post-load step wait in a nameless
    temporary file on ``out``'s filesystem (``$TENSORIZER_MANIFEST_SPILL_DIR``
    when set), not in memory: about the model's size of free disk besides it.
    An ``s3://bucket/prefix``
    ``out`` is saved into a temporary directory first, then uploaded: tensor files,
    then config and tokenizer files, manifests last (credentials: the ``s3_*``
    options, else ``~/.s3cfg``, else ``AWS_*`` variables).
    """
    opts = SaveOptions.parse(options)
    if opts.base in ("inside", "reference") and opts.format_version != 3:
        raise ConfigurationError(f"base={opts.base!r} needs format_version=3: a base is a file of a generation")
    if opts.base in ("inside", "reference") and (opts.pipeline_parallel_size > 1 or opts.expert_parallel()):
        raise ConfigurationError(
            f"base={opts.base!r} is observed by a saving engine whose first rank holds every layer and expert: save "
            "with pipeline_parallel_size=1 and without expert parallelism (the checkpoint then loads at other "
            "layouts through its base)"
        )
    encrypted = (opts.encryption_key_file or os.environ.get(ENCRYPTION_KEY_ENV)) is not None
    if opts.base == "reference" and (is_remote(str(out)) or encrypted):
        raise ConfigurationError(
            "base='reference' names the source's files on this machine: an s3:// output or an encrypted checkpoint "
            "must hold its own base (save with base='inside')"
        )
    if is_remote(str(out)):
        remote = opts.remote()
        target = RemoteDir(str(out), remote)  # a malformed URI is refused before an engine starts
        if not str(out).lower().startswith("s3://"):
            raise ConfigurationError(f"{out}: only s3:// checkpoints can be written; http(s) is read-only")
        probe_conditional_writes(target, opts.allow_unconditional_writes)  # before an engine starts, too
        with tempfile.TemporaryDirectory(prefix="tensorizer-manifest-save-") as staging:
            local = save_checkpoint(src, staging, **{**options, **_NO_REMOTE})
            if opts.format_version == 3:
                publish_to_s3(
                    Path(staging),
                    str(out),
                    remote,
                    signing_key=signing_key_from(opts.signing_key_file),
                    encryption_key=encryption_key_from(opts.encryption_key_file),
                    allow_unconditional_writes=opts.allow_unconditional_writes,
                )
            else:
                upload_checkpoint(Path(staging), str(out), remote, opts.allow_unconditional_writes)
        return SaveResult(out_dir=str(out).rstrip("/"), ranks=local.ranks, copied_files=local.copied_files)
    if opts.s3_access_key_id or opts.s3_secret_access_key or opts.s3_endpoint:
        raise ConfigurationError("the s3_* options are for an s3:// output; this output is a local directory")
    key_file = signing_key_file_path(opts.signing_key_file)
    encryption_key_file = encryption_key_file_path(opts.encryption_key_file)
    src_dir = resolve_model_dir(str(src), opts.revision)
    out_dir = Path(out).expanduser().resolve()
    if out_dir == src_dir.resolve():
        raise TensorizerManifestError(f"{out_dir}: the output directory must differ from the source model directory")
    apply_cpu_gemm(opts.cpu_gemm)

    # The capture copies pre-step tensors to a nameless file beside the output, not into memory.
    with _environ(SPILL_DIR_ENV, os.environ.get(SPILL_DIR_ENV) or str(existing_parent(out_dir))):
        llm = _vllm_compat.start_engine(
            model=str(src_dir),
            load_format=CAPTURE_LOAD_FORMAT,
            worker_extension_cls=WORKER_EXTENSION,
            **engine_kwargs(opts, src_dir),
        )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with errors_typed():
            ranks = _vllm_compat.collective_rpc(
                llm,
                "save_tensorizer_manifest",
                args=(str(out_dir), False, key_file, encryption_key_file, opts.progress),
                kwargs={"format_version": opts.format_version, "base_reference": opts.base == "reference"},
            )
    finally:
        shutdown(llm)
    if opts.format_version == 3:  # the model files are the generation's, copied by its commit
        current = LocalCheckpoint(out_dir).current()
        copied = [] if current is None else [model_file.name for model_file in current.model_files]
    else:
        from .write import copy_model_files  # torch: imported by a save, not by its options

        copied = copy_model_files(src_dir, out_dir)
    return SaveResult(out_dir=out_dir, ranks=list(ranks), copied_files=copied)


def signing_key_file_path(option: str | None) -> str | None:
    """The key file a save uses, checked now (before an engine starts), as an absolute path for the workers."""
    path = option if option is not None else os.environ.get(SIGNING_KEY_ENV) or None
    if path is None:
        return None
    signing_key_from(option)  # the option, else the variable: a ConfigurationError now, not in every worker
    return str(Path(path).expanduser().resolve())


def encryption_key_file_path(option: str | None) -> str | None:
    """The encryption key file a save uses, checked now, as an absolute path for the workers."""
    path = option if option is not None else os.environ.get(ENCRYPTION_KEY_ENV) or None
    if path is None:
        return None
    encryption_key_from(option)
    return str(Path(path).expanduser().resolve())


def existing_parent(path: Path) -> Path:
    """``path`` if it is a directory, else its nearest existing ancestor (the filesystem it will be on)."""
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return candidate
    return Path.cwd()


@contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` within the block (worker processes started in it inherit it)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def shutdown(llm: Any) -> None:
    """Stop an engine and free its memory, so another can start in this process."""
    _vllm_compat.shutdown_engine(llm)
