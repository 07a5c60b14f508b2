"""Names every part of the package shares: the version, vLLM load formats, environment variables.

Nothing here imports anything, so any module may import it without creating a cycle.
"""

from __future__ import annotations

__version__ = "0.5.0.dev0"

#: What wrote a manifest (its ``producer`` field).
PRODUCER = f"tensorizer-manifest {__version__}"

#: ``LLM(load_format=LOAD_FORMAT)`` loads a checkpoint this package saved.
LOAD_FORMAT = "tensorizer_manifest"
#: vLLM's default loader, observed around its post-load step so that the engine can save itself.
CAPTURE_LOAD_FORMAT = "tensorizer_manifest_capture"
#: ``worker_extension_cls`` that adds ``save_tensorizer_manifest`` and ``tensorizer_manifest_report``.
WORKER_EXTENSION = "tensorizer_manifest.vllm_integration.ManifestWorkerExtension"

#: Set to ``fallback`` to keep CPU linear weights (vLLM's torch path instead of oneDNN), in every process.
CPU_GEMM_ENV = "TENSORIZER_MANIFEST_CPU_GEMM"

#: Path of a signing key file, used when no ``signing_key_file`` option is given (save, load, validate).
SIGNING_KEY_ENV = "TENSORIZER_MANIFEST_SIGNING_KEY"

#: Path of an encryption key file, used when no ``encryption_key_file`` option is given (save, load, validate).
ENCRYPTION_KEY_ENV = "TENSORIZER_MANIFEST_ENCRYPTION_KEY"

#: Directory for the nameless temporary file that holds pre-step tensors while saving (default: the temp dir;
#: ``save_checkpoint`` sets it to the output's filesystem).
SPILL_DIR_ENV = "TENSORIZER_MANIFEST_SPILL_DIR"

#: Seconds a remote read may go without a byte from the server before it fails (``RemoteStalledError``), used
#: when no ``RemoteOptions.stall_timeout_s`` is given (default ``storage.remote.credentials.STALL_TIMEOUT_S``, 60).
STALL_TIMEOUT_ENV = "TENSORIZER_MANIFEST_STALL_TIMEOUT_S"
