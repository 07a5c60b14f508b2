"""``add-form --compile``: what a cold engine of this machine kind compiles, kept in the checkpoint.

An engine starts here on the checkpoint, compiling as it would when serving (the settings given here must be the
serving engine's: they shape the graph, and a load uses the form only where vLLM's hash of them is equal). Its
compile cache goes to a fresh directory; after a warm-up request the directory's files become one archive of a new
generation, with the machine kind, the vLLM and torch versions, that hash and every file's content hash
(``load.compile_placement`` says when a load uses it). The generation is committed over the one the engine loaded, so a
writer that came between is a ``ConcurrentWriteError``, and the form of the same machine kind and settings that it
replaces is dropped with it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from .. import _vllm_compat
from .._constants import LOAD_FORMAT, WORKER_EXTENSION
from ..checks.fingerprint import engine_settings
from ..errors import CheckpointNotFoundError, ConcurrentWriteError, ConfigurationError
from ..format.generation import CompileForm, new_generation_id
from ..format.schema import MANIFEST_SUFFIX, blake3_hex
from ..load.compile_placement import CACHE_ROOT_VARIABLE, arrange_aot_artifacts
from ..storage.checkpoint import encryption_key_from, load_generation, signing_key_from
from ..storage.compile_archive import pack
from . import publish
from .from_source import encryption_key_file_path, read_model_config, shutdown, signing_key_file_path


def add_compile_form(directory: Path, engine_args: dict[str, Any], signing_key_file: str | None,
                     encryption_key_file: str | None, tensors_at: dict[str, Any] | None = None,
                     for_server: bool = False) -> dict:  # fmt: skip
    """Make this machine's compile form of the local checkpoint ``directory`` and commit it there; what was added.
    ``tensors_at``: loader options that name where its tensors are, when not beside it (a checkpoint on S3, staged
    in ``directory``). At a parallel layout every rank compiles into the one directory packed (inductor's cache is
    keyed by what each graph is, so ranks of one layout share a form), and they must agree on what it is for.
    ``for_server``: the batch sizes ``vllm serve`` defaults to where ``engine_args`` give none."""
    found = load_generation(directory) if directory.is_dir() else None
    if found is None:
        if directory.is_dir() and any(directory.glob(f"*{MANIFEST_SUFFIX}")):
            raise ConfigurationError(
                f"{directory}: compile forms need a checkpoint of format version 3; save it again with this version"
            )
        raise CheckpointNotFoundError(f"{directory}: not a tensorizer-manifest checkpoint")
    generation = found[0]
    if engine_args.get("enforce_eager"):
        raise ConfigurationError("add-form --compile makes what a compiling engine compiles: enforce_eager is off")
    key_file = signing_key_file_path(signing_key_file)
    encryption_file = encryption_key_file_path(encryption_key_file)
    signing_key, encryption_key = signing_key_from(key_file), encryption_key_from(encryption_file)
    # The saved engine's settings, the serving engine's on top (a difference the load refuses is refused there).
    engine = engine_settings(generation.form_sets[0].fingerprint) if generation.form_sets else {}
    engine.update(engine_args)
    engine.pop("enforce_eager", None)
    if for_server:  # what `vllm serve` runs with where engine_args say nothing
        world = engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1)
        for name, value in _vllm_compat.server_batch_defaults(world).items():
            engine.setdefault(name, value)
    read_model_config(directory)  # a checkpoint vLLM cannot read is refused here, before an engine starts
    with tempfile.TemporaryDirectory(prefix="tensorizer-manifest-compile-cache-") as cache:
        loader_config: dict[str, Any] = {"compile_form_dir": cache, **(tensors_at or {})}
        if key_file is not None:
            loader_config["signing_key_file"] = key_file
        if encryption_file is not None:
            loader_config["encryption_key_file"] = encryption_file
        # vLLM's AOT artifacts where it makes them (load.compile_placement); else inductor's cache alone. The
        # workers point vLLM's cache root at ``cache`` (compile_into): in a process of their own, or in this one.
        aot = _vllm_compat.aot_compile_enabled()
        cache_root = os.environ.get(CACHE_ROOT_VARIABLE)
        try:
            llm = _vllm_compat.start_engine(
                model=str(directory),
                load_format=LOAD_FORMAT,
                worker_extension_cls=WORKER_EXTENSION,
                enforce_eager=False,
                **engine,
                model_loader_extra_config=loader_config,
            )
            try:
                _vllm_compat.greedy_token_ids(llm, ["Compile forms are made here."], max_tokens=4)
                identities = _vllm_compat.collective_rpc(llm, "tensorizer_manifest_compile_identity")
                loaded = _vllm_compat.collective_rpc(llm, "tensorizer_manifest_report")[0] or {}
                saved = _vllm_compat.collective_rpc(llm, "_tm_aot_artifacts") if aot else []
            finally:
                shutdown(llm)
        finally:
            if cache_root is None:
                os.environ.pop(CACHE_ROOT_VARIABLE, None)
            else:
                os.environ[CACHE_ROOT_VARIABLE] = cache_root
        if loaded.get("generation") != generation.id:
            raise ConcurrentWriteError(
                f"{directory}: the engine loaded generation {loaded.get('generation')}, not {generation.id}, which "
                "was current when add-form started: another writer committed meanwhile; run add-form again"
            )
        identity = identities[0]
        if any(other != identity for other in identities):
            raise ConfigurationError(
                f"{directory}: the engine's ranks compiled for different machines or settings ({identities}); make "
                "a compile form where every rank runs on one machine kind"
            )
        if aot:
            arrange_aot_artifacts(Path(cache), saved)
        if not any(Path(cache).rglob("*")):
            raise ConfigurationError(
                f"{directory}: the engine compiled nothing with these settings (compilation off in engine_args?): "
                "there is no compile form to add"
            )
        publication = publish.begin(directory, new_generation_id(), parent=generation.id, read_parent=False)
        name = f"compile-{blake3_hex(' '.join(identity['machine']).encode())[7:23]}.bin"
        archive, files = pack(Path(cache), publication.folder / name, publication.relative(name))
    form = CompileForm(**identity, aot=aot, archive=archive, files=files)  # identity: ``EngineCompile``'s fields
    kept = [f for f in generation.compile_forms if (f.machine, f.vllm_version, f.torch_version, f.config_hash)
            != (form.machine, form.vllm_version, form.torch_version, form.config_hash)]  # fmt: skip
    committed = publish.commit_over(
        publication,
        generation,
        made_by="add-form-compile",
        compile_forms=[*kept, form],
        signing_key=signing_key,
        encryption_key=encryption_key,
    )
    return {
        "generation": committed.id,
        "archive": archive.path,
        "bytes": archive.size,
        "files": len(files),
        "machine": form.machine,
        "replaced": len(generation.compile_forms) - len(kept),
    }
