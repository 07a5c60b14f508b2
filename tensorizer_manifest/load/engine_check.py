"""``validate --engine``: build the model vLLM would build (on the meta device, no weights) and compare.

This is the loader's own pre-weight check (fingerprint policy, each layer's form
chosen, and every layer's class, quant method, kernels and raw tensor shapes),
run without starting an engine or reading a byte of tensor data.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .._constants import LOAD_FORMAT
from ..checks.fingerprint import check_compatible, engine_fingerprint, refuse_unrecorded_settings
from ..checks.report import Problem
from ..errors import TensorizerManifestError
from ..storage.checkpoint import read_manifest
from .forms import choose_forms
from .restore import check_model


def check_against_engine(
    manifest_path: Path, *, dtype: str | None = None, quantization: str | None = None
) -> list[Problem]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

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
    args = EngineArgs(
        model=str(manifest_path.parent),
        load_format=LOAD_FORMAT,
        dtype=dtype or fp.dtype,
        quantization=quantization if quantization not in (None, "none") else None,
        enforce_eager=True,
        max_model_len=None,
    )
    vllm_config = args.create_engine_config()
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{tmp}/dist", backend="gloo"
        )
        initialize_model_parallel(1, 1)
        model_config = vllm_config.model_config
        try:
            fingerprint = engine_fingerprint(vllm_config)
            check_compatible(fp, fingerprint, manifest, str(manifest_path))
            refuse_unrecorded_settings(vllm_config, manifest, str(manifest_path))
            with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
                model = initialize_model(vllm_config=vllm_config, model_config=model_config)
            check_model(choose_forms(manifest, model, fingerprint).manifest, model)  # as the loader: one form a layer
        except TensorizerManifestError as exc:
            return [Problem(type(exc), str(manifest_path), str(exc))]
    return []
