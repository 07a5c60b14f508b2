"""vLLM integration: the two model loaders, the worker extension used to save, the plugin hook.

- ``load_format="tensorizer_manifest"``: load a checkpoint this package saved.
- ``load_format="tensorizer_manifest_capture"``: vLLM's default loader, observed
  around its post-load step so the engine can later save itself.
- ``worker_extension_cls=WORKER_EXTENSION``: adds ``save_tensorizer_manifest``
  (``llm.collective_rpc``), the counterpart of vLLM's ``save_tensorized_model``.
- ``register()`` is the ``vllm.general_plugins`` entry point; it runs in every
  vLLM process, workers included.

``loaders`` holds the two load formats (the load itself is ``load``'s: ``load.plan``, ``load.load_model``),
``worker`` the worker extension, ``plugin`` the entry point (which also pins a format-3 checkpoint to its current
generation before vLLM reads it).

The names vLLM is given (``tensorizer_manifest.vllm_integration:register``, ``WORKER_EXTENSION``) are this
package's: they stay put whatever moves inside it. Below the CLI, above everything else (it saves and loads);
every vLLM name it uses, the loaders' base classes included, comes from ``_vllm_compat``.
"""

from __future__ import annotations

from ..load.options import LoadOptions
from .loaders import CaptureModelLoader, CaptureOptions, ManifestModelLoader
from .plugin import register
from .worker import ManifestWorkerExtension

__all__ = [
    "CaptureModelLoader",
    "CaptureOptions",
    "LoadOptions",
    "ManifestModelLoader",
    "ManifestWorkerExtension",
    "register",
]
