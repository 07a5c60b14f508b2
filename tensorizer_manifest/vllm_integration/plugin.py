"""The plugin: ``register`` (the ``vllm.general_plugins`` entry point, run in every vLLM process) registers both
load formats, pins a format-3 checkpoint given as vLLM's ``model`` to its current generation before vLLM reads
it (``pin_current_generation``) and has the engine's processes hand their typed errors back to the process that
started it (``_error_relay``); ``apply_cpu_gemm_from_env`` applies ``TENSORIZER_MANIFEST_CPU_GEMM``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .. import _error_relay, _vllm_compat
from .._constants import CAPTURE_LOAD_FORMAT, CPU_GEMM_ENV, LOAD_FORMAT
from ..errors import TensorizerManifestError
from ..format.generation import Generation
from ..storage.remote import CREDENTIAL_OPTIONS
from .loaders import CaptureModelLoader, ManifestModelLoader

logger = logging.getLogger("vllm.tensorizer_manifest")  # vLLM's handler and level apply


def apply_cpu_gemm_from_env() -> None:
    """``TENSORIZER_MANIFEST_CPU_GEMM=fallback``: vLLM's torch CPU GEMM in this process (workers too)."""
    if os.environ.get(CPU_GEMM_ENV, "").lower() == "fallback":
        _vllm_compat.disable_onednn()


def pin_current_generation(engine_args) -> tuple[Path, Generation, dict] | None:
    """Where vLLM's ``model`` is a local checkpoint of format version 3 loaded with this load format, make it the
    current generation's own folder (``CKPT/generations/<id>``), once, in the process that parses the engine's
    arguments: everything vLLM reads itself (``config.json`` as it makes its config, the tokenizer in the frontend,
    ``generation_config.json`` after the load) and every rank and replica of this engine is then that generation's,
    whatever is committed meanwhile. The served model name stays the path given; the tokenizer follows the model
    where it was the model's. A checkpoint named apart from ``model`` (``checkpoint_dir``, ``tensorizer_uri``) is
    left as it is (its model files are checked against the generation at load). The generation's folder, the
    generation and the loader's options where it pinned one."""
    import json

    from ..storage.checkpoint import current_generation_folder

    if engine_args.load_format != LOAD_FORMAT or not isinstance(engine_args.model, str):
        return None
    extra = engine_args.model_loader_extra_config or {}
    if isinstance(extra, str):
        extra = json.loads(extra)
    if any(extra.get(name) for name in ("checkpoint_dir", "tensorizer_dir", "tensorizer_uri")):
        return None
    found = current_generation_folder(engine_args.model)
    if found is None:
        return None
    folder, generation = found
    given = engine_args.model
    if engine_args.tokenizer in (None, given):
        engine_args.tokenizer = str(folder)
    if engine_args.served_model_name is None:
        engine_args.served_model_name = given
    engine_args.model = str(folder)
    logger.info("%s: serving its current generation %s from %s", given, generation.id, folder)
    return folder, generation, extra


def place_model_class_records(folder: Path, generation: Generation, extra: dict) -> None:
    """vLLM's record of the model's class that the pinned generation carries, placed where vLLM looks before it
    inspects the class (``load.model_class_record``), under the keys and trust the loader's options give. A bad
    option is left for the loader to refuse, with its typed error."""
    from ..load.model_class_record import place_records
    from ..load.options import LoadOptions
    from ..storage.checkpoint import encryption_key_from, signing_key_from

    try:
        options = LoadOptions(**extra)
        signing_key = signing_key_from(options.signing_key_file)
        encryption_key = encryption_key_from(options.encryption_key_file)
    except (ValueError, TensorizerManifestError):  # pydantic's ValidationError is a ValueError
        return
    place_records(folder, generation, signing_key, encryption_key, options.trust_compile_forms)


def before_engine_config(engine_args) -> None:
    """In the process that starts an engine, before vLLM reads its model or starts a process: a relay for the typed
    errors of the engine's processes, the current generation pinned, and vLLM's record of the model's class placed."""
    _error_relay.open_relay()
    pinned = pin_current_generation(engine_args)
    if pinned is not None:
        place_model_class_records(*pinned)


def register() -> None:
    """``vllm.general_plugins`` entry point: register both load formats in this process.

    It also keeps every log record of the process from showing S3 credentials given in
    ``model_loader_extra_config`` (vLLM logs its engine arguments, that dict included, after loading plugins;
    the redaction is in the log record factory, so no logger or handler escapes it), and records each layer's
    attributes before vLLM's post-load step in any engine (a few dicts), so that one the default loader loaded
    can save itself. A typed error raised in the engine's processes while it starts reaches the caller of
    ``LLM()`` (or ``vllm serve``) as that error, not as vLLM's "Engine core initialization failed".
    """
    _vllm_compat.redact_logged_options(CREDENTIAL_OPTIONS)
    apply_cpu_gemm_from_env()
    _vllm_compat.register_model_loader_once(LOAD_FORMAT, ManifestModelLoader)
    _vllm_compat.register_model_loader_once(CAPTURE_LOAD_FORMAT, CaptureModelLoader)
    from ..save.rebuild import remember_pre_step_attributes

    _vllm_compat.before_every_post_load_step(remember_pre_step_attributes)  # so any engine can save itself
    _vllm_compat.before_engine_config(before_engine_config)
    _vllm_compat.on_engine_start_failure(lambda _vllms_error: _error_relay.relayed_error())
