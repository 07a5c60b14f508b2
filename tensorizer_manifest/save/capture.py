"""Observe a live vLLM model around its post-load step and decide, per layer, what to save.

Nothing here guesses from class names what ``process_weights_after_loading``
does: the model is snapshotted before and after the step (``layers``), and
the difference is what the step created. A layer is saved ``processed`` only
when a restorer (``restorers``) covers every part of that difference;
otherwise its pre-processing tensors are kept and it is saved ``raw``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import UnsupportedModelError
from ..format.schema import (
    REPLAY_NONE,
    REPLAY_POST_LOAD,
    Fingerprint,
    KernelRecord,
    LayerState,
    RuntimeAttr,
    plain_value,
)
from ..live_model.layers import (
    LayerDiff,
    ModuleSnapshot,
    PreStepCopies,
    TensorSlot,
    describe,
    diff_snapshots,
    has_post_load,
    owned_quant_methods,
    refuse_model_level_hook,
    snapshot_module,
)
from ..restorers import Restorer, find_restorer
from ..storage.spill import SpillFile

if TYPE_CHECKING:
    from ..live_model.sources import ObservedSource


@dataclass
class CapturedLayer:
    path: str
    module: torch.nn.Module
    state: LayerState
    replay: str
    tensors: dict[str, TensorSlot]
    kernels: list[KernelRecord]
    runtime_state: list[RuntimeAttr]
    reason: str
    form: dict[str, Any] = field(default_factory=dict)
    verified: bool | None = None
    fallback: dict[str, TensorSlot] = field(default_factory=dict)
    """A processed layer's pre-step tensors, kept when its form is one machine's or one kernel's
    (``CapturePolicy.fallbacks``)."""
    as_loaded: bool = False
    """Its ``tensors`` are as vLLM's weight loaders left them: a raw layer's, or a step's that touched none (it
    made runtime state only). Where the save writes a base, such a layer can be fed from it (``write``)."""


@dataclass(frozen=True)
class CapturePolicy:
    """Which layers may be saved processed (``save --portable``, ``--allow-unverified``)."""

    portable: bool = False
    """Save every layer raw: the checkpoint loads on any machine whose engine settings match."""
    allow_unverified: bool = False
    """Save processed also where the restorer is not verified on this device kind (recorded per layer)."""
    device_type: str = "cpu"
    fallbacks: bool = True
    """Keep the raw tensors of processed layers whose form belongs to one machine kind or one kernel beside
    them (``save --no-fallbacks`` drops them): such a checkpoint loads on any machine and any vLLM whose
    engine settings match, processed where the form fits, through vLLM's step elsewhere."""

    def keeps_fallback(self, restorer: Restorer, form: dict[str, Any]) -> bool:
        """Whether a layer saved processed by ``restorer`` in ``form`` also keeps its raw tensors."""
        return self.fallbacks and (bool(form) or not restorer.kernel_independent)

    def refuses(self, restorer: Restorer) -> str | None:
        """Why a layer this restorer covers is saved raw anyway; None when it may be saved processed."""
        if self.portable:
            return "saved raw: --portable"
        if not restorer.verified_for(self.device_type) and not self.allow_unverified:
            return (
                f"saved raw: restorer {restorer.name} is not verified on {self.device_type} "
                "(--allow-unverified saves it processed)"
            )
        return None


@dataclass
class Capture:
    """Everything the save step needs, recorded by the capture loader."""

    fingerprint: Fingerprint
    layers: list[CapturedLayer]
    stem: str = "model"
    spill: SpillFile | None = None
    """Holds raw layers' pre-step tensors (their slots' ``stored``) until ``close``."""
    source: ObservedSource | None = None
    """What vLLM's loader read and which modules it filled, observed for a base (the first rank, ``base=True``)."""
    base_fills: dict[str, list[str]] | None = None
    """Module path -> the parameters vLLM's weight loaders filled from the source on this rank, where the save
    writes a base: a layer whose tensors are all among them is left to the base (``write.build_manifest``)."""

    def close(self) -> None:
        """Release the pre-step copies; the capture cannot be written after this."""
        if self.spill is not None:
            self.spill.close()


def runtime_attrs(diff: LayerDiff, rebuilt_by: str) -> list[RuntimeAttr]:
    out = []
    for (owner, name), value in sorted(diff.changed_attrs.items(), key=lambda kv: kv[0]):
        _, plain = plain_value(value)
        out.append(RuntimeAttr(owner=owner, name=name, type=describe(value), rebuilt_by=rebuilt_by, value=plain))
    return out


def classify(
    path: str,
    module: torch.nn.Module,
    before: ModuleSnapshot,
    after: ModuleSnapshot,
    policy: CapturePolicy = CapturePolicy(),
) -> CapturedLayer:
    """Decide raw or processed for one layer; never guess."""
    diff = diff_snapshots(before, after)
    if diff.empty:
        return CapturedLayer(
            path,
            module,
            "processed",
            REPLAY_NONE,
            after.tensors,
            after.kernels,
            [],
            "post-load changed nothing",
            as_loaded=True,
        )
    restorer, why_not = find_restorer(module, diff)
    if restorer is not None and (refused := policy.refuses(restorer)) is not None:
        restorer, why_not = None, refused
    if restorer is not None:
        form = restorer.form(module)
        return CapturedLayer(
            path,
            module,
            "processed",
            restorer.name,
            after.tensors,
            after.kernels,
            runtime_attrs(diff, restorer.name),
            f"restorer {restorer.name} rebuilds all the step created",
            form=form,
            verified=restorer.verified_for(policy.device_type),
            fallback=before.tensors if policy.keeps_fallback(restorer, form) else {},
            as_loaded=diff.tensors_untouched,
        )
    # Tensors the step creates (e.g. int8's ``azp_adj``) are runtime state of a raw layer too.
    created = [
        RuntimeAttr(owner="layer", name=name, type=describe(after.tensors[name].tensor), rebuilt_by=REPLAY_POST_LOAD)
        for name in sorted(diff.added_tensors)
    ]
    return CapturedLayer(
        path,
        module,
        "raw",
        REPLAY_POST_LOAD,
        before.tensors,
        after.kernels,
        created + runtime_attrs(diff, REPLAY_POST_LOAD),
        why_not,
        as_loaded=True,
    )


class Recorder:
    """Snapshots the whole model before the post-load step and classifies it after.

    The tensors of layers with a post-load step are copied before it into a
    nameless temporary file in ``spill_dir`` (``spill.SpillFile``), not into
    memory: the capture it returns owns that file, and ``Capture.close`` (or an
    error here) frees it.
    """

    def __init__(self, model: torch.nn.Module, spill_dir: str | None = None, policy: CapturePolicy = CapturePolicy()):
        refuse_model_level_hook(model)
        self.model = model
        self.policy = policy
        self.spill = SpillFile(spill_dir)
        try:
            self._copies = PreStepCopies(self.spill)
            self.before = {
                path: snapshot_module(module, self._copies if has_post_load(module) else None)
                for path, module in self._layers()
            }
        except BaseException:
            self.close()
            raise

    def _layers(self):
        """Every module but quant methods that are modules themselves: their state is their layer's."""
        owned = owned_quant_methods(self.model)
        return [(path, module) for path, module in self.model.named_modules() if id(module) not in owned]

    def close(self) -> None:
        """Free the pre-step copies (after an error; a finished capture owns them)."""
        self.before = {}
        self.spill.close()

    def finish(self, fingerprint: Fingerprint) -> Capture:
        try:
            layers = self._classify()
        except BaseException:
            self.close()
            raise
        self._copies.forget()
        self.before = {}
        return Capture(fingerprint=fingerprint, layers=layers, spill=self.spill)

    def _classify(self) -> list[CapturedLayer]:
        layers = []
        for path, module in self._layers():
            after = snapshot_module(module, None)
            before = self.before.get(path)
            if before is None:
                raise UnsupportedModelError(
                    f"module {path!r} appeared during the post-load step; tensorizer-manifest "
                    "cannot describe modules the step creates"
                )
            layer = classify(path, module, before, after, self.policy)
            if layer.state == "raw" and not has_post_load(module):
                raise UnsupportedModelError(
                    f"module {path!r} ({type(module).__name__}) was changed by the post-load step "
                    "although it has no post-load step of its own (a model-level hook?); "
                    "tensorizer-manifest cannot replay that"
                )
            if layer.tensors or layer.runtime_state or layer.kernels:
                layers.append(layer)
        return layers


def capture_around(model: torch.nn.Module, run_steps, policy: CapturePolicy, fingerprint: Fingerprint) -> Capture:
    """vLLM's post-load step (``run_steps``) run with a ``Recorder`` around it: the capture of what it made (a
    save's, or ``add-form``'s at a new layout). The pre-step copies are freed if the step fails."""
    recorder = Recorder(model, policy=policy)
    try:
        run_steps()
    except BaseException:
        recorder.close()
        raise
    return recorder.finish(fingerprint)


class FallbackRecorder:
    """For ``add-form``: the layers a load takes through their raw fallback, observed around vLLM's step.

    ``layer_ready`` snapshots such a layer once its fallback tensors are in, before vLLM's step runs on it
    (references and content hashes, no copy: its pre-step bytes are the fallback, already in the checkpoint; the
    hashes see a step that writes a same-shaped result through ``.data``, as vLLM 0.33's ``replace_parameter``
    does); ``finish`` classifies
    each as a save does, so that the processed form this engine made is kept where a verified restorer
    covers it, ready to be added to the checkpoint (``write.write_added_form``).
    """

    def __init__(self, model: torch.nn.Module, paths: set[str], device_type: str):
        self.model = model
        self.paths = paths
        self.policy = CapturePolicy(device_type=device_type, fallbacks=False)
        self.before: dict[str, ModuleSnapshot] = {}

    def layer_ready(self, path: str, module: torch.nn.Module) -> None:
        if path in self.paths:
            self.before[path] = snapshot_module(module, None, content_hashes=True)  # no copy: its hashes

    def finish(self, fingerprint: Fingerprint, stem: str) -> tuple[Capture, dict[str, str]]:
        """The processed layers to add, and why each other fallback layer cannot be (no restorer covers it)."""
        layers, not_added = [], {}
        for path, module in self.model.named_modules():
            if path not in self.paths:
                continue
            layer = classify(path, module, self.before[path], snapshot_module(module, None), self.policy)
            if layer.state == "processed" and layer.replay != REPLAY_NONE:
                layers.append(layer)
            else:
                not_added[path] = layer.reason
        self.before = {}
        return Capture(fingerprint=fingerprint, layers=layers, stem=stem), not_added
