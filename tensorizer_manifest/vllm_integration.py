"""vLLM integration: the two model loaders, the worker extension used to save, the plugin hook.

- ``load_format="tensorizer_manifest"``: load a checkpoint this package saved.
- ``load_format="tensorizer_manifest_capture"``: vLLM's default loader, observed
  around its post-load step so the engine can later save itself.
- ``worker_extension_cls=WORKER_EXTENSION``: adds ``save_tensorizer_manifest``
  (``llm.collective_rpc``), the counterpart of vLLM's ``save_tensorized_model``.
- ``register()`` is the ``vllm.general_plugins`` entry point; it runs in every
  vLLM process, workers included.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from . import CAPTURE_LOAD_FORMAT, LOAD_FORMAT  # noqa: E402  (names live in __init__)
from .errors import CompatibilityError, TensorizerManifestError, UnsupportedModelError

#: Set to ``fallback`` to keep CPU linear weights (vLLM's torch path instead of oneDNN).
CPU_GEMM_ENV = "TENSORIZER_MANIFEST_CPU_GEMM"

_CAPTURE_ATTR = "_tensorizer_manifest_capture"
_REPORT_ATTR = "_tensorizer_manifest_report"

logger = logging.getLogger("tensorizer_manifest")


class LoadOptions(BaseModel):
    """What users may pass in ``model_loader_extra_config`` for ``tensorizer_manifest``."""

    model_config = ConfigDict(extra="forbid")

    verify_hashes: bool = Field(True, description="Check each tensor's content hash as it is read.")
    checkpoint_dir: str | None = Field(None, description="Checkpoint directory, when not the model path.")


def _load_options(load_config: Any) -> LoadOptions:
    raw = dict(getattr(load_config, "model_loader_extra_config", None) or {})
    try:
        return LoadOptions(**raw)
    except ValidationError as exc:
        raise CompatibilityError(f"invalid model_loader_extra_config for {LOAD_FORMAT}: {exc}") from None


def _rank_stem(vllm_config: Any) -> str:
    from vllm.distributed import parallel_state

    from .write import checkpoint_stem

    parallel = vllm_config.parallel_config
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    pp_rank = parallel_state.get_pp_group().rank_in_group if parallel_state.model_parallel_is_initialized() else 0
    return checkpoint_stem(tp_rank, parallel.tensor_parallel_size, pp_rank, parallel.pipeline_parallel_size)


def _model_class_name(model_config: Any) -> str:
    from vllm.model_executor.model_loader.utils import get_model_architecture

    from .tensors import qualified_class

    model_class, _ = get_model_architecture(model_config)
    return qualified_class(model_class)


class _Clock:
    """Named laps, for the load report: what validation costs next to the load itself."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._last, 6)
        self._last = now


class ManifestModelLoader(BaseModelLoader):
    """Loads a tensorizer-manifest checkpoint: validate, restore, replay."""

    def download_model(self, model_config) -> None:  # local checkpoints only
        return None

    def load_weights(self, model, model_config) -> None:
        raise UnsupportedModelError(f"{LOAD_FORMAT} loads whole models; in-place weight reloading is not supported")

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        from .checkpoint import find_manifest, read_manifest
        from .fingerprint import check_compatible, engine_fingerprint
        from .load import check_model, restore_tensors
        from .replay import replay_model
        from .tensors import TensorFileReader
        from .validate import check_files

        clock = _Clock()
        options = _load_options(self.load_config)
        checkpoint = Path(options.checkpoint_dir or model_config.model)
        manifest_path = find_manifest(checkpoint, _rank_stem(vllm_config))
        manifest = read_manifest(manifest_path)
        tensor_path = check_files(manifest, manifest_path)
        current = engine_fingerprint(vllm_config, _model_class_name(model_config))
        check_compatible(manifest.fingerprint, current, manifest, str(manifest_path))
        clock.lap("check_files")

        device_config = vllm_config.device_config
        load_device = device_config.device if self.load_config.device is None else self.load_config.device
        target_device = torch.device(load_device)
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            clock.lap("build_model")
            check_model(manifest, model)  # before a byte of weights is read
            clock.lap("check_model")
            reader = TensorFileReader(tensor_path, device=str(target_device))
            try:
                nbytes = restore_tensors(model, manifest, reader, verify_hashes=options.verify_hashes)
            finally:
                reader.close()
            clock.lap("read_tensors")
            report = replay_model(model, manifest, model_config, target_device)
            clock.lap("replay")
        setattr(
            model,
            _REPORT_ATTR,
            {**report.to_dict(), "bytes_read": nbytes, "verify_hashes": options.verify_hashes, "seconds": clock.laps},
        )
        logger.info(
            "tensorizer_manifest: loaded %s (%d raw layer steps run once, %d processed layers restored) in %.2fs",
            manifest_path,
            len(report.post_load),
            len(report.restored),
            sum(clock.laps.values()),
        )
        return model.eval()


class CaptureModelLoader(DefaultModelLoader):
    """vLLM's default loader, with the post-load step observed so the engine can save itself."""

    def __init__(self, load_config):
        from vllm.config import replace

        # The default loader picks weight files by load format; read them as "auto" does.
        super().__init__(replace(load_config, load_format="auto"))

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        from vllm.model_executor.model_loader import base_loader

        from .capture import Recorder
        from .fingerprint import engine_fingerprint

        original = getattr(base_loader, "process_weights_after_loading", None)
        if original is None:
            raise UnsupportedModelError(
                "this vLLM's BaseModelLoader has no process_weights_after_loading step to observe"
            )
        holder: dict[str, Any] = {}
        fingerprint = engine_fingerprint(vllm_config, _model_class_name(model_config))

        def observed(model, model_config_, target_device):
            recorder = Recorder(model)
            original(model, model_config_, target_device)
            holder["capture"] = recorder.finish(fingerprint)

        base_loader.process_weights_after_loading = observed
        try:
            model = super().load_model(vllm_config, model_config, prefix)
        finally:
            base_loader.process_weights_after_loading = original
        holder["capture"].stem = _rank_stem(vllm_config)
        setattr(model, _CAPTURE_ATTR, holder["capture"])
        return model


def register() -> None:
    """``vllm.general_plugins`` entry point: register both load formats in this process."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, register_model_loader

    if os.environ.get(CPU_GEMM_ENV, "").lower() == "fallback":
        from vllm import _custom_ops

        _custom_ops._supports_onednn = False
    if LOAD_FORMAT in _LOAD_FORMAT_TO_MODEL_LOADER:
        return
    register_model_loader(LOAD_FORMAT)(ManifestModelLoader)
    register_model_loader(CAPTURE_LOAD_FORMAT)(CaptureModelLoader)


class ManifestWorkerExtension:
    """Worker methods, reached with ``llm.collective_rpc(name, args=...)``."""

    def _tm_model(self) -> torch.nn.Module:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def save_tensorizer_manifest(self, output_dir: str, keep_capture: bool = False) -> dict:
        """Write this rank's tensor file and manifest into ``output_dir``.

        The capture holds a copy of every raw layer's pre-processing tensors; it
        is released after the save (so an engine that goes on serving gets that
        memory back) unless ``keep_capture`` asks to save again later.
        """
        from .write import write_checkpoint

        model = self._tm_model()
        capture = getattr(model, _CAPTURE_ATTR, None)
        if capture is None:
            raise TensorizerManifestError(
                f"this engine was not loaded with load_format={CAPTURE_LOAD_FORMAT!r}, so the state before "
                "vLLM's post-load step was not observed; start it with that load format to save"
            )
        manifest = write_checkpoint(capture, Path(output_dir), capture.stem)
        if not keep_capture:
            delattr(model, _CAPTURE_ATTR)
        raw = sum(1 for m in manifest.modules if m.state == "raw")
        return {
            "manifest": str(Path(output_dir) / (capture.stem + ".manifest.json")),
            "tensor_file": manifest.tensor_file.path,
            "bytes": manifest.tensor_file.size,
            "layers": len(manifest.modules),
            "raw_layers": raw,
        }

    def tensorizer_manifest_report(self) -> dict | None:
        """What the manifest loader did in this worker (None when it was not used)."""
        return getattr(self._tm_model(), _REPORT_ATTR, None)
