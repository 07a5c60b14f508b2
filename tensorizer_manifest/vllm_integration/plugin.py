"""The plugin: ``register`` (the ``vllm.general_plugins`` entry point, run in every vLLM process) registers both
load formats, and ``apply_cpu_gemm_from_env`` applies ``TENSORIZER_MANIFEST_CPU_GEMM``.
"""

from __future__ import annotations

import os

from .. import _vllm_compat
from .._constants import CAPTURE_LOAD_FORMAT, CPU_GEMM_ENV, LOAD_FORMAT
from ..storage.remote import CREDENTIAL_OPTIONS
from .loaders import CaptureModelLoader, ManifestModelLoader


def apply_cpu_gemm_from_env() -> None:
    """``TENSORIZER_MANIFEST_CPU_GEMM=fallback``: vLLM's torch CPU GEMM in this process (workers too)."""
    if os.environ.get(CPU_GEMM_ENV, "").lower() == "fallback":
        _vllm_compat.disable_onednn()


def register() -> None:
    """``vllm.general_plugins`` entry point: register both load formats in this process.

    It also keeps every log record of the process from showing S3 credentials given in
    ``model_loader_extra_config`` (vLLM logs its engine arguments, that dict included, after loading plugins;
    the redaction is in the log record factory, so no logger or handler escapes it), and records each layer's
    attributes before vLLM's post-load step in any engine (a few dicts), so that one the default loader loaded
    can save itself.
    """
    _vllm_compat.redact_logged_options(CREDENTIAL_OPTIONS)
    apply_cpu_gemm_from_env()
    _vllm_compat.register_model_loader_once(LOAD_FORMAT, ManifestModelLoader)
    _vllm_compat.register_model_loader_once(CAPTURE_LOAD_FORMAT, CaptureModelLoader)
    from ..save.rebuild import remember_pre_step_attributes

    _vllm_compat.before_every_post_load_step(remember_pre_step_attributes)  # so any engine can save itself
