"""What the saving engine was, and what the loading engine must share with it.

The field list follows vLLM's own ``WeightCacheKey`` (the Fast Start cache key)
plus torch and tensorizer versions and the device. The policy is written per
field, because not every difference matters equally:

- ``EXACT`` fields decide the shape or meaning of every saved tensor
  (architecture, dtype, quantization, parallel layout): any difference is refused.
- ``PROCESSED_ONLY`` fields decide the *format* of processed tensors (the vLLM
  version and device decide which kernel repacked them). They must match when
  the checkpoint holds a processed layer whose replay depends on a kernel;
  raw layers run vLLM's own post-load step on the loading engine, so they
  tolerate a different kernel.
- ``INFORMATIONAL`` fields are recorded for people and ``diff``, never refused.

Some engine settings decide a rank's tensors as much as these fields do, and the manifest does not record them
(vLLM 0.33's ``WeightCacheKey`` added them; 0.32 already has the settings): ``UNRECORDED_SETTINGS``. Until a
format version records them, a checkpoint can only be saved at vLLM's default for each, so an engine away from
the default is refused, at save always and at load under the same policy as the fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .. import _vllm_compat
from ..errors import CompatibilityError, ConfigurationError
from ..format.schema import REPLAY_NONE, Fingerprint, Manifest
from ..restorers import RESTORERS
from ..storage.tensorizer_names import tensorizer_version

EXACT = (
    "architectures",
    "model_class",
    "dtype",
    "quantization",
    "quant_config_hash",
    "kv_cache_dtype",
    "tensor_parallel_size",
    "tensor_parallel_rank",
    "pipeline_parallel_size",
    "pipeline_parallel_rank",
    "expert_parallel",
)
PROCESSED_ONLY = ("vllm_version", "device_type", "device_capability", "linear_backend", "moe_backend")
INFORMATIONAL = (
    "torch_version",
    "tensorizer_version",
    "data_parallel_size",
    "data_parallel_rank",
    "cpu_onednn",
    "revision",
    "cpu_features",
)


class UnrecordedSetting(NamedTuple):
    """An engine setting the manifest does not record: its policy (``EXACT`` or ``PROCESSED_ONLY``), vLLM's
    default, why it matters, and how to read it from a ``VllmConfig`` (a release without it has its default)."""

    policy: tuple[str, ...]
    default: Any
    why: str
    read: Callable[[Any], Any]


def _expert_placement(vllm_config: Any) -> str:
    parallel = vllm_config.parallel_config
    if not getattr(parallel, "enable_expert_parallel", False):
        return "linear"  # without expert parallelism it places nothing
    return getattr(parallel, "expert_placement_strategy", "linear")


def _batch_invariant(vllm_config: Any) -> bool:
    return _vllm_compat.batch_invariant()


def _config_overrides(vllm_config: Any) -> Any:
    overrides = getattr(vllm_config.model_config, "hf_overrides", None) or {}
    return dict(overrides) if isinstance(overrides, dict) else f"a function ({getattr(overrides, '__name__', '?')})"


#: Saved at vLLM's default only (``refuse_unrecorded_settings``). The model's config itself is not here: the
#: generation holds ``config.json`` by its hash, and a load checks the one vLLM read against it.
UNRECORDED_SETTINGS: dict[str, UnrecordedSetting] = {
    "hf_overrides": UnrecordedSetting(
        EXACT, {}, "it changes the config the saved tensors were made from (0.33's key has its rope parameters: "
        "the rotary caches are saved)", _config_overrides,
    ),
    "kv_cache_dtype_skip_layers": UnrecordedSetting(
        EXACT, [], "which attention layers keep an unquantized KV cache, and so their scales",
        lambda c: sorted(getattr(c.cache_config, "kv_cache_dtype_skip_layers", None) or []),
    ),
    "expert_placement_strategy": UnrecordedSetting(
        EXACT, "linear", "which experts each expert-parallel rank holds", _expert_placement
    ),
    "enable_eplb": UnrecordedSetting(
        EXACT, False, "expert load balancing moves experts between ranks",
        lambda c: bool(getattr(c.parallel_config, "enable_eplb", False)),
    ),
    "linear_backend_per_quant": UnrecordedSetting(
        PROCESSED_ONLY, {}, "the linear kernel per scheme, and so its processed layout",
        lambda c: dict(getattr(getattr(c, "kernel_config", None), "linear_backend_per_quant", None) or {}),
    ),
    "VLLM_BATCH_INVARIANT": UnrecordedSetting(
        PROCESSED_ONLY, False, "it overrides the linear and MoE kernel choice", _batch_invariant
    ),
}  # fmt: skip

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32", "fp32": "float32"}


def engine_fingerprint(vllm_config: Any) -> Fingerprint:
    """Fingerprint of the engine in this process. Call before weights are processed."""
    import torch

    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    tp_rank, pp_rank = _vllm_compat.parallel_ranks()
    cap = _vllm_compat.device_capability()
    on_cpu = _vllm_compat.on_cpu()
    kernel_config = getattr(vllm_config, "kernel_config", None)
    return Fingerprint(
        vllm_version=_vllm_compat.vllm_version(),
        torch_version=str(torch.__version__),
        tensorizer_version=tensorizer_version(),
        architectures=list(getattr(model_config.hf_config, "architectures", None) or []),
        model_class=_vllm_compat.model_class_name(model_config),
        dtype=str(model_config.dtype).removeprefix("torch."),
        quantization=model_config.quantization,
        quant_config_hash=_vllm_compat.quant_config_hash(model_config),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        tensor_parallel_size=parallel.tensor_parallel_size,
        tensor_parallel_rank=tp_rank,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        pipeline_parallel_rank=pp_rank,
        data_parallel_size=parallel.data_parallel_size,
        device_type=str(vllm_config.device_config.device_type),
        device_capability=None if cap is None else f"{cap[0]}.{cap[1]}",
        cpu_onednn=_vllm_compat.onednn_enabled() if on_cpu else None,
        data_parallel_rank=getattr(parallel, "data_parallel_rank", 0) or 0,
        expert_parallel=bool(getattr(parallel, "enable_expert_parallel", False)),
        linear_backend=_opt_str(getattr(kernel_config, "linear_backend", None)),
        moe_backend=_opt_str(getattr(kernel_config, "moe_backend", None)),
        revision=model_config.revision,
        cpu_features=_vllm_compat.cpu_features() if on_cpu else [],
    )


def engine_settings(fingerprint: Fingerprint) -> dict[str, Any]:
    """The engine settings a fingerprint records, as ``vllm.LLM`` keyword arguments: what an engine started on the
    checkpoint by a writer (add-form) takes from it."""
    return dict(
        dtype=fingerprint.dtype,
        quantization=fingerprint.quantization,
        tensor_parallel_size=fingerprint.tensor_parallel_size,
        pipeline_parallel_size=fingerprint.pipeline_parallel_size,
        kv_cache_dtype=fingerprint.kv_cache_dtype,
        enable_expert_parallel=fingerprint.expert_parallel,
    )


def unrecorded_settings(vllm_config: Any) -> dict[str, Any]:
    """The ``UNRECORDED_SETTINGS`` this engine has away from vLLM's default, with their values."""
    current = {name: setting.read(vllm_config) for name, setting in UNRECORDED_SETTINGS.items()}
    return {name: value for name, value in current.items() if value != UNRECORDED_SETTINGS[name].default}


def refuse_unrecorded_settings(vllm_config: Any, manifest: Manifest | None, source: str) -> None:
    """Refuse an engine whose ``unrecorded_settings`` a checkpoint cannot carry: any of them at save (``manifest``
    None), and at load those its policy says matter for this checkpoint (a kernel setting only where a processed
    layer depends on the kernel), since the checkpoint was saved at the defaults."""
    settings = unrecorded_settings(vllm_config)
    if manifest is None:
        if settings:
            names = ", ".join(f"{name}={value!r} ({UNRECORDED_SETTINGS[name].why})" for name, value in settings.items())
            raise ConfigurationError(
                f"{source}: this engine runs with {names}, which a manifest does not record yet, so a checkpoint "
                "saved with it would load wrong elsewhere; save with vLLM's default for it"
            )
        return
    kernels_matter = needs_same_kernels(manifest)
    differing: list[tuple[str, object, object]] = [
        (name, "vLLM's default", value)
        for name, value in settings.items()
        if UNRECORDED_SETTINGS[name].policy is EXACT or kernels_matter
    ]
    if differing:
        lines = "; ".join(f"{name}: saved at vLLM's default, this engine {value!r}" for name, _, value in differing)
        raise CompatibilityError(
            f"{source}: this checkpoint was saved at vLLM's default for a setting this engine changes ({lines}). "
            "Start vLLM without it.",
            differing,
        )


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def needs_same_kernels(manifest: Manifest) -> bool:
    """True when a processed layer's tensors are in a kernel-specific form and it has no raw fallback
    (a layer with one loads through it where the engine differs: ``layer_forms.choose_forms``)."""
    for module in manifest.modules:
        if module.state == "processed" and module.replay != REPLAY_NONE and not module.fallback:
            restorer = RESTORERS.get(module.replay)
            if restorer is None or not restorer.kernel_independent:
                return True
    return False


def differences(saved: Fingerprint, current: Fingerprint, fields) -> list[tuple[str, object, object]]:
    """``(field, saved, current)`` for each of ``fields`` that differs."""
    return [
        (name, getattr(saved, name), getattr(current, name))
        for name in fields
        if getattr(saved, name) != getattr(current, name)
    ]


def compare(saved: Fingerprint, current: Fingerprint, manifest: Manifest) -> list[tuple[str, object, object]]:
    """Every field that differs and matters under the policy above: ``(field, saved, current)``."""
    return differences(saved, current, EXACT + (PROCESSED_ONLY if needs_same_kernels(manifest) else ()))


def check_compatible(saved: Fingerprint, current: Fingerprint, manifest: Manifest, source: str) -> None:
    differences = compare(saved, current, manifest)
    if differences:
        lines = "; ".join(f"{name}: saved {a!r}, this engine {b!r}" for name, a, b in differences)
        raise CompatibilityError(
            f"{source}: this checkpoint was saved by a different engine configuration ({lines}). "
            "Start vLLM with the saved settings, or re-save the checkpoint with "
            "`tensorizer-manifest save` on this engine.",
            differences,
        )


def normalize_dtype(dtype: str) -> str:
    """A dtype as vLLM's ``--dtype`` accepts it, named as the fingerprint names it."""
    return _DTYPE_ALIASES.get(dtype, dtype).removeprefix("torch.")


def settings_differences(
    saved: Fingerprint,
    *,
    dtype: str | None = None,
    quantization: str | None = None,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
) -> list[tuple[str, object, object]]:
    """The fields an engine's command line decides, checked without vLLM: ``(field, saved, wanted)``."""
    wanted: list[tuple[str, object, object]] = []
    if dtype not in (None, "auto"):
        wanted.append(("dtype", saved.dtype, normalize_dtype(dtype)))
    if quantization is not None:
        wanted.append(("quantization", saved.quantization, None if quantization.lower() == "none" else quantization))
    if tensor_parallel_size is not None:
        wanted.append(("tensor_parallel_size", saved.tensor_parallel_size, tensor_parallel_size))
    if pipeline_parallel_size is not None:
        wanted.append(("pipeline_parallel_size", saved.pipeline_parallel_size, pipeline_parallel_size))
    return [(name, was, now) for name, was, now in wanted if was != now]
