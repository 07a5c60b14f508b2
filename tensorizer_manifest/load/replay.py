"""The deterministic replay that rebuilds a loaded model's runtime state.

Raw layers get vLLM's own step, exactly once; processed layers get their
restorer (``restorers``), which rebuilds state without transforming tensors
again. A layer's quant-method step runs as soon as its tensors are in (while
the rest is still being read); what must wait follows vLLM's
``process_weights_after_loading`` order (``layers.post_load_steps``).
Afterwards every runtime attribute and kernel the manifest lists is checked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _vllm_compat
from ..errors import ReplayError
from ..format.schema import REPLAY_NONE, Manifest, ModuleRecord, kernel_map
from ..live_model.layers import QUANT_METHOD_STEP, find_kernels, owners_of, post_load_steps, refuse_model_level_hook
from ..restorers import RESTORERS


@dataclass
class ReplayReport:
    """What replay did, per layer: the audit trail behind 'nothing ran twice'."""

    post_load: list[str] = field(default_factory=list)
    restored: dict[str, str] = field(default_factory=dict)
    kernel_changes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"post_load": self.post_load, "restored": self.restored, "kernel_changes": self.kernel_changes}


def run_post_load_step(module: torch.nn.Module, kind: str, model_config: Any, target_device: torch.device) -> None:
    """One of vLLM's own post-load steps on one layer, as ``process_weights_after_loading`` runs it."""
    if kind == QUANT_METHOD_STEP:
        _vllm_compat.run_quant_method_step(module, target_device)
    else:
        _vllm_compat.run_attention_step(module, model_config.dtype, target_device)


class Replayer:
    """Replays a model's layers as their tensors arrive, then finishes what must wait.

    vLLM's quant-method step of a layer touches that layer alone, so it gives
    the same result whether it runs while later layers are still being read or
    after all of them: ``layer_ready`` runs it (or the layer's restorer) at
    once, unless ``overlap_raw_steps`` / ``overlap_restorers`` say to wait (the
    ``load_model.overlap_policy``). Two kinds always wait for ``finish``, which then
    follows vLLM's order: layers whose tensors other layers alias (a tie must see
    the tensor as loaded, not as processed), and attention steps, which vLLM runs
    after every quant step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        manifest: Manifest,
        model_config: Any,
        target_device: torch.device,
        overlap_raw_steps: bool = True,
        overlap_restorers: bool = True,
    ):
        refuse_model_level_hook(model)
        self.overlap_raw_steps = overlap_raw_steps
        """Whether ``layer_ready`` runs vLLM's step on a raw layer at once; else ``finish`` does, after the reading."""
        self.overlap_restorers = overlap_restorers
        """The same for the restorers of processed layers."""
        self.model = model
        self.manifest = manifest
        self.model_config = model_config
        self.target_device = target_device
        self.report = ReplayReport()
        self._records = manifest.module_map()
        self._steps = post_load_steps(model)
        self._early = {path for path, _, kind in self._steps if kind == QUANT_METHOD_STEP} - _alias_targets(manifest)
        self._done: set[tuple[str, str]] = set()
        self.step_seconds = 0.0
        """Time spent in vLLM's own steps and in restorers (the rest of replay is our bookkeeping)."""

    def layer_ready(self, record: ModuleRecord, module: torch.nn.Module, check_hashes: Callable[[str], None]) -> None:
        """Called once a layer's tensors are in place; ``check_hashes(path)`` waits for their hashes."""
        overlap = self.overlap_raw_steps if record.state == "raw" else self.overlap_restorers
        if overlap and record.path in self._early:
            restorer = RESTORERS.get(record.replay)
            if record.state == "raw" or restorer is None or restorer.writes_tensors:
                check_hashes(record.path)  # nothing may change a tensor in place before its hash is checked
            self._step(record.path, module, QUANT_METHOD_STEP)

    def finish(self) -> ReplayReport:
        """Every step not run yet, in vLLM's order; then the runtime state is checked."""
        for path, module, kind in self._steps:
            self._step(path, module, kind)
        _check_runtime_state(self.model, self.manifest, self.report)
        return self.report

    def _step(self, path: str, module: torch.nn.Module, kind: str) -> None:
        if (path, kind) in self._done:
            return
        self._done.add((path, kind))
        record = self._records.get(path)
        if record is None:
            raise ReplayError(f"layer {path!r} has a post-load step but no manifest record")
        started = time.perf_counter()
        if record.state == "raw":
            # Raw layers take each of vLLM's steps (quant method, then attention) once.
            run_post_load_step(module, kind, self.model_config, self.target_device)
            self.report.post_load.append(f"{path}:{kind}")
        elif record.replay != REPLAY_NONE and path not in self.report.restored:
            _restore(path, module, record, self.model_config)
            self.report.restored[path] = record.replay
        self.step_seconds += time.perf_counter() - started


def _alias_targets(manifest: Manifest) -> set[str]:
    """Paths of layers holding a tensor that a record of another layer is an alias of."""
    return {t.alias_of.rpartition(".")[0] for m in manifest.modules for t in m.tensors if t.alias_of is not None}


def replay_model(
    model: torch.nn.Module, manifest: Manifest, model_config: Any, target_device: torch.device
) -> ReplayReport:
    """Run the post-load step once on raw layers, and restorers on processed ones, in vLLM's order."""
    return Replayer(model, manifest, model_config, target_device).finish()


def _restore(path: str, module: torch.nn.Module, record: ModuleRecord, model_config: Any) -> None:
    restorer = RESTORERS.get(record.replay)
    if restorer is None:
        raise ReplayError(f"layer {path!r}: unknown restorer {record.replay!r}; upgrade tensorizer-manifest")
    try:
        restorer.replay(module, model_config)
    except Exception as exc:
        raise ReplayError(f"layer {path!r}: restorer {record.replay} failed: {exc}") from exc


def _check_runtime_state(model: torch.nn.Module, manifest: Manifest, report: ReplayReport) -> None:
    """Every runtime attribute the manifest lists must now exist (with its value, when processed)."""
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
    now = kernel_map(find_kernels(module))
    for (owner, attr), saved_class in kernel_map(record.kernels).items():
        current = now.get((owner, attr))
        if current == saved_class:
            continue
        restorer = RESTORERS.get(record.replay)
        tolerated = record.state == "raw" or (restorer is not None and restorer.kernel_independent)
        message = f"{record.path}: {owner}.{attr} saved as {saved_class}, now {current}"
        if not tolerated:
            raise ReplayError(message + "; re-save the checkpoint on this engine")
        report.kernel_changes.append(message)
