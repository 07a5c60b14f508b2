"""``validate --engine``: build the model vLLM would build (on the meta device, no weights) and compare.

This is the loader's own pre-weight check (fingerprint policy, each layer's form
chosen, and every layer's class, quant method, kernels and raw tensor shapes),
run without starting an engine or reading a byte of tensor data.
"""

from __future__ import annotations

from .. import _vllm_compat
from .._constants import LOAD_FORMAT
from ..checks.fingerprint import check_compatible, engine_fingerprint, refuse_unrecorded_settings
from ..checks.report import Problem
from ..errors import TensorizerManifestError
from ..storage.checkpoint import FileLocation, read_manifest
from .layer_forms import choose_forms
from .restore import check_model


def check_against_engine(
    manifest_path: FileLocation, *, dtype: str | None = None, quantization: str | None = None
) -> list[Problem]:
    import torch

    manifest = read_manifest(manifest_path)
    fp = manifest.fingerprint
    if fp.tensor_parallel_size != 1 or fp.pipeline_parallel_size != 1:
        return [
            Problem(
                TensorizerManifestError,
                str(manifest_path),
                "--engine checks single-rank checkpoints only; the loader checks sharded ones at start-up",
            )
        ]
    vllm_config = _vllm_compat.engine_config(
        model=str(manifest_path.parent),
        load_format=LOAD_FORMAT,
        dtype=dtype or fp.dtype,
        quantization=quantization if quantization not in (None, "none") else None,
        enforce_eager=True,
        max_model_len=None,
    )
    with _vllm_compat.single_rank_group(vllm_config):
        model_config = vllm_config.model_config
        try:
            fingerprint = engine_fingerprint(vllm_config)
            check_compatible(fp, fingerprint, manifest, str(manifest_path))
            refuse_unrecorded_settings(vllm_config, manifest, str(manifest_path))
            with _vllm_compat.model_built(vllm_config, model_config, torch.device("meta")) as model:
                pass
            check_model(choose_forms(manifest, model, fingerprint).manifest, model)  # as the loader: one form a layer
        except TensorizerManifestError as exc:
            return [Problem(type(exc), str(manifest_path), str(exc))]
    return []
