"""``add-form``: a second machine kind (or another vLLM) adds its own processed form to a checkpoint.

A checkpoint saved with raw fallbacks loads everywhere, but on a machine whose kernels lay a layer out
otherwise it loads that layer through its fallback and vLLM's step, at every start. ``add_form`` starts
an engine here on the checkpoint (the saved engine settings, the manifest loader), observes vLLM's step
on each layer that falls back, and adds what it made to the checkpoint where a verified restorer covers
it: a tensor file of its own, a new entry in the manifest's ``added_forms``, a new seal. From then on this
machine kind loads those layers processed too; the others are unchanged.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field

from .. import _vllm_compat
from .._constants import LOAD_FORMAT, WORKER_EXTENSION
from .._error_relay import errors_typed
from .._signatures import takes_keywords_of
from ..checks.fingerprint import engine_settings as fingerprint_settings
from ..errors import CheckpointNotFoundError, ConfigurationError
from ..format.schema import MANIFEST_SUFFIX
from ..storage.checkpoint import load_generation, read_manifest
from ..storage.generations import LocalCheckpoint, S3Checkpoint
from ..storage.option_models import S3Options, parse_options
from ..storage.remote import RemoteDir, is_remote, probe_conditional_writes
from ..storage.remote_checkpoint import fetch_model_files, publish_to_s3
from .from_source import (
    encryption_key_file_path,
    read_model_config,
    saving_context_len,
    saving_kv_cache_bytes,
    shutdown,
    signing_key_file_path,
)


class AddFormOptions(S3Options):
    """What ``add_form`` accepts (validated, with readable errors): the one declaration of its options, which
    ``add_form``'s signature and ``tensorizer-manifest add-form``'s options are made from."""

    model_config = ConfigDict(extra="forbid")

    signing_key_file: str | None = Field(
        None, description="The key the checkpoint is sealed with (else $TENSORIZER_MANIFEST_SIGNING_KEY)."
    )
    encryption_key_file: str | None = Field(
        None, description="An encrypted checkpoint's key (else $TENSORIZER_MANIFEST_ENCRYPTION_KEY)."
    )
    allow_unconditional_writes: bool = Field(
        False, description="Write to an S3 server that ignores conditional writes (the last writer wins, silently)."
    )
    tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        description="The layout to add forms for (default: the saved one). A checkpoint with a base takes a whole "
        "form set at a new layout: loaded there from its base, what vLLM's steps make is kept for that layout.",
    )
    pipeline_parallel_size: int | None = Field(None, ge=1, description="As tensor_parallel_size.")
    compile: bool = Field(
        False,
        description="Add this machine kind's compile form instead: an engine compiles here with the engine_args "
        "given (the serving engine's: they shape the graph), and its compile cache is kept in the checkpoint; an "
        "engine with the same settings on this machine kind then loads the compiled graphs instead of compiling, "
        "under a seal checked with its signing key (or trust_compile_forms). A checkpoint of format 3; at another "
        "layout (tensor_parallel_size, pipeline_parallel_size), one form serves every rank of it.",
    )
    for_server: bool = Field(
        False,
        description="With compile: make the form for `vllm serve`, whose batch sizes default otherwise than "
        "LLM()'s (max_num_seqs, max_num_batched_tokens: on CPU 128 and 2048 a rank, against 256 and 4096); they "
        "shape the compiled graph, so a form made for one is not used by the other. Those given in engine_args win.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further vllm.LLM keyword arguments. The engine settings a checkpoint records (dtype, "
        "quantization, parallel sizes, KV-cache dtype) are taken from it; one given here that differs is refused.",
    )


@dataclass
class AddFormResult:
    checkpoint: Path | str
    """The local directory, or the ``s3://`` URI."""
    ranks: list[dict] = field(default_factory=list)
    """Per rank, what it added: the layers' forms (``added``, the fallback layers no verified restorer covers here
    in ``not_added`` with why, the new ``tensor_file`` and its ``bytes``); a layout's form set (those and
    ``layout``); or, with ``compile``, one entry for the compile form (``archive``, ``bytes``, ``files``,
    ``machine``, ``replaced``) and no ``not_added``."""


def engine_settings(manifest_path: Path) -> dict[str, Any]:
    """The engine settings the checkpoint was saved with, as ``vllm.LLM`` keyword arguments."""
    return fingerprint_settings(read_manifest(manifest_path).fingerprint)


@takes_keywords_of(AddFormOptions)
def add_form(checkpoint: str | os.PathLike, **options: Any) -> AddFormResult:
    """Add this machine's processed form of the layers that load here through their raw fallback.

    ``checkpoint`` is a directory or an ``s3://bucket/prefix`` (credentials: the ``s3_*`` options, else
    ``~/.s3cfg``, else ``AWS_*`` variables). Refused before an engine starts when no layer of the checkpoint
    has a fallback (saved with ``--no-fallbacks`` or ``--portable``, or by 0.3 and older: re-save it).
    Crash-safe as saving is: the new tensor file first, the manifest replaced in one rename (one upload on
    S3); a loader reading the old manifest meanwhile still loads, and an interrupted run leaves the
    checkpoint as it was.
    """
    opts = parse_options(AddFormOptions, options, "add-form option")
    if opts.for_server and not opts.compile:
        raise ConfigurationError("for_server is an option of compile forms (add-form --compile --for-server)")
    if opts.compile:
        return _add_compile_form(checkpoint, opts)
    if is_remote(str(checkpoint)):
        return _add_form_remote(str(checkpoint), opts)
    if opts.s3_access_key_id or opts.s3_secret_access_key or opts.s3_endpoint:
        raise ConfigurationError("the s3_* options are for an s3:// checkpoint; this one is a local directory")
    return _add_form(Path(checkpoint).expanduser().resolve(), opts)


def _add_form_remote(uri: str, opts: AddFormOptions) -> AddFormResult:
    """An ``s3://`` checkpoint: its manifests and model files are staged in a temporary directory, the engine
    streams the tensors from ``uri``, and the new tensor files are uploaded first, the manifests that changed
    last (each upload is atomic: a loader meanwhile reads the old manifest and its files, all still there), each
    only over the version staged (``RemoteFile.upload_if``: ``ConcurrentWriteError`` when another writer came
    first)."""
    remote = opts.remote()
    store = _writable_store(uri, opts)
    location = store.root
    if store.read_pointer() is not None:
        return _add_form_to_generations(uri, store, opts)
    with tempfile.TemporaryDirectory(prefix="tensorizer-manifest-add-form-") as staging:
        stage = Path(staging)
        fetch_model_files(uri, stage, remote)
        staged: dict[str, tuple[str | None, bytes]] = {}  # manifest -> (its ETag, its bytes) as staged
        for name in location.list_names():
            if name.endswith(MANIFEST_SUFFIX):
                manifest = location / name
                manifest.download(stage / name)
                staged[name] = (manifest.etag or manifest.current_etag(), (stage / name).read_bytes())
        result = _add_form(stage, opts, checkpoint_dir=uri)
        new_files = [rank["tensor_file"] for rank in result.ranks if rank["tensor_file"]]
        for name in new_files:
            (location / name).upload(stage / name)
        for name, (etag, before) in sorted(staged.items()):
            if (stage / name).read_bytes() != before:  # a rank that added a form: only over the version staged
                (location / name).upload_if(stage / name, etag)
    return AddFormResult(checkpoint=uri, ranks=result.ranks)


def _add_form_to_generations(
    uri: str, store: S3Checkpoint, opts: AddFormOptions, write: Callable[[Path], AddFormResult] | None = None
) -> AddFormResult:
    """An ``s3://`` checkpoint of format version 3: its current generation is staged without its tensor files (the
    engine streams those from ``uri``), ``write`` (by default the layers' or layout's form, ``_add_form``) commits
    there a new generation over it, and that one is published to ``uri`` only over the generation the engine loaded
    (``ConcurrentWriteError`` when a save or another add-form committed since: nothing of this one is then current,
    and ``gc`` removes what it uploaded)."""
    with tempfile.TemporaryDirectory(prefix="tensorizer-manifest-add-form-") as staging:
        stage = Path(staging)
        store.stage(stage)  # a checkpoint of an older format has no pointer: refused here, by name
        LocalCheckpoint(stage).refresh_top_level()  # the model files and stubs where vLLM's ``model`` path reads them
        result = write(stage) if write is not None else _add_form(stage, opts, checkpoint_dir=uri)
        if any(rank.get("generation") for rank in result.ranks):
            publish_to_s3(  # over its parent, as sealed in the stage: nothing to seal again, no key needed
                stage,
                uri,
                opts.remote(),
                allow_unconditional_writes=opts.allow_unconditional_writes,
                only_over_its_parent=True,
            )
    return AddFormResult(checkpoint=uri, ranks=result.ranks)


def _add_compile_form(checkpoint: str | os.PathLike, opts: AddFormOptions) -> AddFormResult:
    """``compile``: this machine kind's compile form (``save.add_compile_form``) at the layout of ``engine_args``
    (or of ``tensor_parallel_size``/``pipeline_parallel_size``), local or on S3 (staged as a layout's add-form is,
    the form committed over the generation the engine loaded)."""
    engine_args = dict(opts.engine_args)
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        wanted = getattr(opts, name)
        if wanted is not None and engine_args.setdefault(name, wanted) != wanted:
            raise ConfigurationError(f"{name} is given twice, as {wanted} and in engine_args as {engine_args[name]}")
    from .add_compile_form import add_compile_form

    if not is_remote(str(checkpoint)):
        if opts.s3_access_key_id or opts.s3_secret_access_key or opts.s3_endpoint:
            raise ConfigurationError("the s3_* options are for an s3:// checkpoint; this one is a local directory")
        directory = Path(checkpoint).expanduser().resolve()
        added = add_compile_form(directory, engine_args, opts.signing_key_file, opts.encryption_key_file,
                                 for_server=opts.for_server)  # fmt: skip
        return AddFormResult(checkpoint=directory, ranks=[added])
    uri = str(checkpoint)

    def write(stage: Path) -> AddFormResult:
        added = add_compile_form(stage, engine_args, opts.signing_key_file, opts.encryption_key_file,
                                 tensors_at=_remote_loader_options(uri, opts), for_server=opts.for_server)  # fmt: skip
        return AddFormResult(checkpoint=stage, ranks=[added])

    result = _add_form_to_generations(uri, _writable_store(uri, opts), opts, write)
    for added in result.ranks:
        added["archive"] = f"{uri}/{added['archive']}"
    return result


def _writable_store(uri: str, opts: AddFormOptions) -> S3Checkpoint:
    """The ``s3://`` checkpoint at ``uri``, once its server is known to honour conditional writes (or the user
    accepts that it does not): http(s) is refused, read-only."""
    location = RemoteDir(uri, opts.remote())
    if location.scheme != "s3":
        raise ConfigurationError(f"{uri}: only s3:// checkpoints can be written; http(s) is read-only")
    probe_conditional_writes(location, opts.allow_unconditional_writes)
    return S3Checkpoint(location, opts.allow_unconditional_writes)


def _remote_loader_options(uri: str, opts: AddFormOptions) -> dict[str, Any]:
    """The loader options of an engine that reads the tensors of the checkpoint at ``uri`` (its files staged)."""
    remote = opts.remote()
    options: dict[str, Any] = {"checkpoint_dir": uri}
    options.update(
        {k: v for k, v in (("s3_access_key_id", remote.access_key_id),
                           ("s3_secret_access_key", remote.secret_access_key),
                           ("s3_endpoint", remote.endpoint)) if v is not None}
    )  # fmt: skip
    return options


def _has_base(directory: Path) -> bool:
    """Whether the checkpoint in ``directory`` (format version 3) has a base: other layouts load through it."""
    found = load_generation(directory) if directory.is_dir() else None
    return found is not None and found[0].base is not None


def _add_form(directory: Path, opts: AddFormOptions, checkpoint_dir: str | None = None) -> AddFormResult:
    """Add the form to the checkpoint whose manifests are in ``directory`` (its tensors at ``checkpoint_dir``,
    by default beside them)."""
    manifests = sorted(directory.glob(f"*{MANIFEST_SUFFIX}")) if directory.is_dir() else []
    if not manifests:
        raise CheckpointNotFoundError(f"{directory}: no *{MANIFEST_SUFFIX} here: not a tensorizer-manifest checkpoint")
    with_base = _has_base(directory)
    for path in manifests:
        if not with_base and not any(m.fallback for m in read_manifest(path).modules):
            raise ConfigurationError(
                f"{path}: no layer has a raw fallback, so there is nothing another machine can make its form from "
                "(saved with --no-fallbacks or --portable, or by tensorizer-manifest 0.3). Re-save it from the "
                "source weights with `tensorizer-manifest save` (fallbacks are kept by default), then add forms"
            )
    key_file = signing_key_file_path(opts.signing_key_file)
    encryption_key_file = encryption_key_file_path(opts.encryption_key_file)
    config = read_model_config(directory)
    loader_config: dict[str, Any] = {"add_form": True}
    if checkpoint_dir is not None:
        loader_config.update(_remote_loader_options(checkpoint_dir, opts))
    if key_file is not None:
        loader_config["signing_key_file"] = key_file
    if encryption_key_file is not None:
        loader_config["encryption_key_file"] = encryption_key_file
    kwargs: dict[str, Any] = dict(
        engine_settings(manifests[0]),
        max_model_len=saving_context_len(config),
        kv_cache_memory_bytes=saving_kv_cache_bytes(config),
        enforce_eager=True,
        max_num_seqs=1,
        model_loader_extra_config=loader_config,
    )
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        wanted = getattr(opts, name)
        if wanted is not None and wanted != kwargs[name]:
            if not with_base:
                raise ConfigurationError(
                    f"{directory}: {name} other than the saved one ({kwargs[name]}) needs a checkpoint with a base "
                    "(save --base inside)"
                )
            kwargs[name] = wanted
    kwargs.update(opts.engine_args)

    llm = _vllm_compat.start_engine(
        model=str(directory), load_format=LOAD_FORMAT, worker_extension_cls=WORKER_EXTENSION, **kwargs
    )
    try:
        with errors_typed():
            ranks = _vllm_compat.collective_rpc(
                llm, "add_tensorizer_manifest_form", args=(str(directory), key_file, encryption_key_file)
            )
    finally:
        shutdown(llm)
    return AddFormResult(checkpoint=directory, ranks=list(ranks))
