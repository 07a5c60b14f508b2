"""Restorers, and the deterministic replay that rebuilds a loaded model's runtime state.

A restorer rebuilds, for one kind of layer, the runtime state that vLLM's
``process_weights_after_loading`` created, from tensors that are already in
their processed form, without transforming them again. At save time a layer
is marked ``processed`` only when a restorer ``covers`` everything the step
did to it; at load time that restorer replays it. Raw layers get vLLM's own
post-load step, exactly once. Order follows vLLM: quantized layers in module
order, then deferred attention layers.

To support a new kernel, add a ``Restorer`` subclass and ``register`` it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .capture import LayerDiff, describe, find_kernels
from .errors import ReplayError
from .schema import Manifest, ModuleRecord


class Restorer:
    """Rebuilds the runtime state of one kind of processed layer."""

    name: ClassVar[str]
    #: True when the processed tensors are still what any kernel accepts, so
    #: the loading engine may pick a different kernel than the saving one.
    kernel_independent: ClassVar[bool] = False

    def applies_to(self, module: torch.nn.Module) -> bool:
        raise NotImplementedError

    def covers(self, module: torch.nn.Module, diff: LayerDiff) -> str | None:
        """None when replay rebuilds everything in ``diff``; else why not."""
        raise NotImplementedError

    def replay(self, module: torch.nn.Module, model_config: Any) -> None:
        raise NotImplementedError


class CpuUnquantizedGemmRestorer(Restorer):
    """CPU unquantized linear and embedding layers: rebuild the ``cpu_linear`` dispatch.

    vLLM's step builds ``layer.cpu_linear`` from the weight. When the step left
    every tensor as it was (vLLM's torch fallback, or an embedding, which keeps
    its weight), the saved weight is the raw one and calling vLLM's own
    dispatch on it rebuilds the closure. When the step packed the weight into
    a oneDNN handle and dropped it, nothing savable is left and the layer is
    saved raw instead.
    """

    name = "cpu_unquantized_gemm"
    kernel_independent = True

    def applies_to(self, module):
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.platforms import current_platform

        return current_platform.is_cpu() and type(getattr(module, "quant_method", None)) in (
            UnquantizedLinearMethod,
            UnquantizedEmbeddingMethod,
        )

    def covers(self, module, diff):
        if not diff.tensors_untouched:
            changed = sorted(diff.added_tensors | diff.removed_tensors | diff.changed_tensors)
            return f"the step replaced or packed tensors {changed} (e.g. into a oneDNN handle)"
        extra = set(diff.changed_attrs) - {("layer", "cpu_linear")}
        if extra or diff.removed_attrs:
            return f"the step created state no restorer rebuilds: {sorted(extra | diff.removed_attrs)}"
        return None

    def replay(self, module, model_config):
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        if getattr(module, "_cpu_skip_gemm_dispatch", False):
            module.cpu_linear = torch.nn.functional.linear
            return
        remove_weight = isinstance(module.quant_method, UnquantizedLinearMethod)
        dispatch_cpu_unquantized_gemm(module, remove_weight=remove_weight)


class AttentionScalesRestorer(Restorer):
    """Attention layers: host copies of the q/k/v/prob scales.

    The step turns the scale buffers into plain floats and CPU copies (and may
    drop the checkpoint-facing ``k_scale`` placeholders). The buffers are saved
    processed; replay derives the floats from them. Running vLLM's step again
    instead would reset calibrated scales to 1.0.
    """

    name = "attention_scales"
    kernel_independent = True
    _FLOATS = {
        "_q_scale_float": "_q_scale",
        "_k_scale_float": "_k_scale",
        "_v_scale_float": "_v_scale",
        "_prob_scale_float": "_prob_scale",
    }
    _CPU_COPIES = {"_k_scale_cpu": "_k_scale", "_v_scale_cpu": "_v_scale"}
    _SCALE_BUFFERS = {"_q_scale", "_k_scale", "_v_scale", "_prob_scale"}
    _PLACEHOLDERS = {"q_scale", "k_scale", "v_scale", "prob_scale", "q_zero_point", "k_zero_point", "v_zero_point"}

    def applies_to(self, module):
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        return is_deferred_attention_layer(module)

    def covers(self, module, diff):
        if diff.added_tensors:
            return f"the step added tensors {sorted(diff.added_tensors)}"
        if diff.removed_tensors - self._PLACEHOLDERS:
            return f"the step removed tensors {sorted(diff.removed_tensors - self._PLACEHOLDERS)}"
        if diff.changed_tensors - self._SCALE_BUFFERS:
            return f"the step changed tensors {sorted(diff.changed_tensors - self._SCALE_BUFFERS)}"
        allowed = {("layer", n) for n in (*self._FLOATS, *self._CPU_COPIES)}
        extra = (set(diff.changed_attrs) - allowed) | diff.removed_attrs
        if extra:
            return f"the step created state no restorer rebuilds: {sorted(extra)}"
        return None

    def replay(self, module, model_config):
        for attr, buffer in self._FLOATS.items():
            if hasattr(module, buffer):
                setattr(module, attr, getattr(module, buffer).item())
        for attr, buffer in self._CPU_COPIES.items():
            if hasattr(module, buffer):
                setattr(module, attr, getattr(module, buffer).detach().to("cpu", copy=True))


RESTORERS: dict[str, Restorer] = {}


def register(restorer: Restorer) -> Restorer:
    """Add a restorer. Names are part of the manifest format: never rename one."""
    if restorer.name in RESTORERS or restorer.name in ("none", "post_load"):
        raise ValueError(f"restorer name {restorer.name!r} is taken")
    RESTORERS[restorer.name] = restorer
    return restorer


register(CpuUnquantizedGemmRestorer())
register(AttentionScalesRestorer())


def find_restorer(module: torch.nn.Module, diff: LayerDiff) -> tuple[Restorer | None, str]:
    reasons = []
    for restorer in RESTORERS.values():
        if not restorer.applies_to(module):
            continue
        why_not = restorer.covers(module, diff)
        if why_not is None:
            return restorer, ""
        reasons.append(f"{restorer.name}: {why_not}")
    if not reasons:
        qm = getattr(module, "quant_method", None)
        return None, f"no restorer for {type(module).__name__} with {type(qm).__name__ if qm else 'no quant method'}"
    return None, "; ".join(reasons)


@dataclass
class ReplayReport:
    """What replay did, per layer: the audit trail behind 'nothing ran twice'."""

    post_load: list[str] = field(default_factory=list)
    restored: dict[str, str] = field(default_factory=dict)
    kernel_changes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"post_load": self.post_load, "restored": self.restored, "kernel_changes": self.kernel_changes}


def _run_raw_step(module: torch.nn.Module, model_config: Any, target_device: torch.device, quant: bool) -> None:
    from vllm.model_executor.model_loader.utils import device_loading_context

    if quant:
        quant_method = module.quant_method
        ctx = device_loading_context(module, target_device) if quant_method.requires_device_loading else nullcontext()
        with ctx:
            quant_method.process_weights_after_loading(module)
        if hasattr(module, "update_param_tp_status"):
            module.update_param_tp_status()
    else:
        with device_loading_context(module, target_device):
            module.process_weights_after_loading(model_config.dtype)


def replay_model(
    model: torch.nn.Module, manifest: Manifest, model_config: Any, target_device: torch.device
) -> ReplayReport:
    """Run the post-load step once on raw layers, and restorers on processed ones, in vLLM's order."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    records = manifest.module_map()
    report = ReplayReport()
    done: set[str] = set()
    modules = list(model.named_modules())

    def step(path: str, module: torch.nn.Module, quant: bool) -> None:
        record = records.get(path)
        if record is None:
            raise ReplayError(f"layer {path!r} has a post-load step but no manifest record")
        if record.state == "raw":
            # Raw layers take each of vLLM's steps (quant method, then attention) once.
            _run_raw_step(module, model_config, target_device, quant)
            report.post_load.append(f"{path}:{'quant_method' if quant else 'attention'}")
            return
        if path in done or record.replay == "none":
            return
        restorer = RESTORERS.get(record.replay)
        if restorer is None:
            raise ReplayError(f"layer {path!r}: unknown restorer {record.replay!r}; upgrade tensorizer-manifest")
        try:
            restorer.replay(module, model_config)
        except Exception as exc:
            raise ReplayError(f"layer {path!r}: restorer {record.replay} failed: {exc}") from exc
        report.restored[path] = record.replay
        done.add(path)

    for path, module in modules:
        if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
            step(path, module, quant=True)
    for path, module in modules:
        if is_deferred_attention_layer(module):
            step(path, module, quant=False)
    if hasattr(model, "process_weights_after_loading"):
        raise ReplayError(
            f"{type(model).__name__} has a model-level post-load hook; checkpoints of it cannot be replayed"
        )
    _check_runtime_state(model, manifest, report)
    return report


def _check_runtime_state(model: torch.nn.Module, manifest: Manifest, report: ReplayReport) -> None:
    """Every runtime attribute the manifest lists must now exist (with its value, when processed)."""
    from .capture import owners_of

    for record in manifest.modules:
        if not record.runtime_state and not record.kernels:
            continue
        module = model.get_submodule(record.path)
        owners = owners_of(module)
        for attr in record.runtime_state:
            owner = owners.get(attr.owner)
            if owner is None or not hasattr(owner, attr.name):
                raise ReplayError(
                    f"layer {record.path!r}: runtime attribute {attr.owner}.{attr.name} is missing after replay"
                )
            if record.state == "processed" and attr.value is not None:
                current = getattr(owner, attr.name)
                current = list(current) if isinstance(current, tuple) else current
                if current != attr.value:
                    raise ReplayError(
                        f"layer {record.path!r}: {attr.owner}.{attr.name} is {current!r} after replay, "
                        f"the saving engine had {attr.value!r}"
                    )
        _check_kernels(record, module, report)


def _check_kernels(record: ModuleRecord, module: torch.nn.Module, report: ReplayReport) -> None:
    now = {(k.owner, k.attr): k.kernel_class for k in find_kernels(module)}
    for kernel in record.kernels:
        current = now.get((kernel.owner, kernel.attr))
        if current == kernel.kernel_class:
            continue
        restorer = RESTORERS.get(record.replay)
        tolerated = record.state == "raw" or (restorer is not None and restorer.kernel_independent)
        message = f"{record.path}: {kernel.owner}.{kernel.attr} saved as {kernel.kernel_class}, now {current}"
        if not tolerated:
            raise ReplayError(message + "; re-save the checkpoint on this engine")
        report.kernel_changes.append(message)


__all__ = ["Restorer", "RESTORERS", "register", "replay_model", "ReplayReport", "describe"]
