"""The plugin entry point, without starting an engine."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_plugin_registers_both_load_formats_once():
    from vllm.model_executor.model_loader import get_model_loader  # noqa: F401  (public API)

    from tensorizer_manifest import _vllm_compat
    from tensorizer_manifest._constants import CAPTURE_LOAD_FORMAT, LOAD_FORMAT
    from tensorizer_manifest.vllm_integration.loaders import CaptureModelLoader, ManifestModelLoader
    from tensorizer_manifest.vllm_integration.plugin import register

    register()
    assert not _vllm_compat.register_model_loader_once(LOAD_FORMAT, ManifestModelLoader)
    assert not _vllm_compat.register_model_loader_once(CAPTURE_LOAD_FORMAT, CaptureModelLoader)
