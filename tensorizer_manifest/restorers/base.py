"""What a restorer is, and the registry that finds one for a layer.

A restorer rebuilds, for one kind of layer, the runtime state that vLLM's
``process_weights_after_loading`` created, from tensors that are already in
their processed form, without transforming them again. At save time a layer
is marked ``processed`` only when a restorer ``covers`` everything the step
did to it; at load time that restorer replays it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from .. import _vllm_compat
from ..format.schema import REPLAY_NONE, REPLAY_POST_LOAD, qualified_class
from ..live_model.layers import LayerDiff


class Restorer:
    """Rebuilds the runtime state of one kind of processed layer.

    A built-in one: subclass it in a module of its own under
    ``tensorizer_manifest/restorers/``, named after the restorer, ``register`` an
    instance there, and list the module in ``BUILT_IN_MODULES``
    (``restorers/__init__.py``), whose order is the order ``find_restorer`` asks
    them in. Elsewhere, ``register`` (``tensorizer_manifest.register_restorer``)
    adds one, asked after every built-in.
    """

    name: ClassVar[str]
    """Written into manifests as the layer's ``replay``: part of the format, never rename one."""
    #: True when the processed tensors are still what any kernel accepts, so
    #: the loading engine may pick a different kernel than the saving one.
    kernel_independent: ClassVar[bool] = False
    #: False when ``replay`` never writes the layer's tensors in place (it may read them, or put new
    #: tensors in their place): then it runs while the layer's content hashes are still being checked.
    #: Every hash is checked before the load returns either way.
    writes_tensors: ClassVar[bool] = True
    #: Qualified names of the vLLM classes (quant methods, kernels, experts) whose layers this restorer
    #: replays, for ``tensorizer-manifest kernels``; the classes may not exist in every vLLM.
    handles: ClassVar[tuple[str, ...]] = ()
    #: What ``replay`` rebuilds, in a few words (shown by ``tensorizer-manifest kernels``).
    rebuilds: ClassVar[str] = ""
    #: Device kinds (``cpu``, ``cuda``) where this project's end-to-end tests prove the restorer on real
    #: vLLM (token-exact, processed tensors bitwise, no post-load step run). Elsewhere a layer it covers
    #: saves raw unless the user opts in; ``verify-kernels`` records can add a kind.
    verified_on: ClassVar[frozenset[str]] = frozenset()
    #: Restorers asked before this one that may apply to a layer this one applies to, by name, each with what
    #: decides between them (why at most one covers a layer). Required for one that names a class in
    #: ``handles`` an earlier one names too (``undeclared_overlaps``, checked when the package is imported),
    #: and for an overlap ``handles`` does not show (one's ``applies_to`` reaching the other's class).
    asked_after: ClassVar[dict[str, str]] = {}

    def verified_for(self, device_type: str) -> bool:
        """Verified on this device kind: by this project's tests, or by a ``verify-kernels`` record."""
        from ..format.verification_records import recorded_verified

        return device_type in self.verified_on or recorded_verified(self.name, device_type)

    def applies_to(self, module: torch.nn.Module) -> bool:
        """Whether this restorer is about this kind of layer at all."""
        raise NotImplementedError

    def covers(self, module: torch.nn.Module, diff: LayerDiff) -> str | None:
        """None when ``replay`` rebuilds everything in ``diff``; else why not (shown to users)."""
        raise NotImplementedError

    def form(self, module: torch.nn.Module) -> dict[str, Any]:
        """What decides the processed tensors' layout on this machine (ISA, kernel flags), read from a
        freshly built layer before any weights are in: recorded at save, compared before reading at load.

        Plain values only. Empty (the default) when the layout is the same on every machine.
        """
        return {}

    def creates_tensors(self, module: torch.nn.Module) -> set[str]:
        """Tensors a processed layer holds that a freshly built one lacks (the loader adds exactly these)."""
        return set()

    def replay(self, module: torch.nn.Module, model_config: Any) -> None:
        """Rebuild the layer's runtime state from its processed tensors. Never transform them."""
        raise NotImplementedError


#: Every registered restorer, by name.
RESTORERS: dict[str, Restorer] = {}


def register(restorer: Restorer) -> Restorer:
    """Add a restorer, asked after every one added before it (every built-in first). Names are part of the
    manifest format: never rename one."""
    if restorer.name in RESTORERS or restorer.name in (REPLAY_NONE, REPLAY_POST_LOAD):
        raise ValueError(f"restorer name {restorer.name!r} is taken")
    RESTORERS[restorer.name] = restorer
    return restorer


def undeclared_overlaps(restorers: Iterable[Restorer]) -> list[str]:
    """What breaks the asking order, for restorers in the order ``find_restorer`` asks them: two that name one
    class in ``handles`` where the later does not declare the earlier in ``asked_after``, and an ``asked_after``
    that names no earlier restorer (the order turned round, or a rule left behind). Empty when none."""
    problems = []
    earlier: list[Restorer] = []
    for restorer in restorers:
        asked_before = {r.name for r in earlier}
        problems += [
            f"{restorer.name} is declared to be asked after {name}, which is not asked before it"
            for name in sorted(set(restorer.asked_after) - asked_before)
        ]
        for other in earlier:
            shared = set(other.handles) & set(restorer.handles)
            if shared and other.name not in restorer.asked_after:
                problems.append(
                    f"{other.name} and {restorer.name} both handle {sorted(shared)}, and {restorer.name} "
                    f"does not declare in asked_after what decides between them"
                )
        earlier.append(restorer)
    return problems


def known_replays() -> set[str]:
    """Every value a manifest's ``replay`` may have with the restorers installed here."""
    return {REPLAY_POST_LOAD, REPLAY_NONE, *RESTORERS}


def device_capability() -> int | None:
    """This machine's GPU compute capability as vLLM reads it (``90`` for sm_90); None without a GPU.

    Part of the ``form`` of GPU restorers: vLLM picks kernels and weight layouts by it.
    """
    capability = _vllm_compat.device_capability()
    return None if capability is None else capability[0] * 10 + capability[1]


def layer_kernel(module: torch.nn.Module, attr: str, class_names: set[str]) -> tuple[str, Any] | None:
    """``(owner, kernel)``: the kernel object named ``attr`` on the layer's quant method or scheme, when its
    class is one of ``class_names`` (qualified). ``owner`` is the name the capture's diff gives the kernel's
    own attributes (``quant_method.kernel``, ``scheme.kernel``)."""
    for owner_name in ("quant_method", "scheme"):
        owner = getattr(module, owner_name, None) if owner_name == "quant_method" else module.__dict__.get("scheme")
        kernel = getattr(owner, attr, None) if owner is not None else None
        if kernel is not None and qualified_class(kernel) in class_names:
            return f"{owner_name}.{attr}", kernel
    return None


def state_beyond(diff: LayerDiff, rebuilt: Iterable[tuple[str, str]]) -> str | None:
    """Why a restorer does not cover ``diff``: the step created or removed ``(owner, name)`` state beyond what
    its replay rebuilds (``rebuilt``); None when it did not."""
    extra = (set(diff.changed_attrs) - set(rebuilt)) | diff.removed_attrs
    return f"the step created state no restorer rebuilds: {sorted(extra)}" if extra else None


def only_state_and_tensors_in_place(diff: LayerDiff, rebuilt: Iterable[tuple[str, str]]) -> str | None:
    """``state_beyond``, and the step neither added nor removed a tensor (the MoE kernels' steps change their
    tensors in place and build a kernel): None when so, else why not."""
    why_not = state_beyond(diff, rebuilt)
    if why_not is None and (diff.added_tensors or diff.removed_tensors):
        why_not = f"the step added or removed tensors {sorted(diff.added_tensors | diff.removed_tensors)}"
    return why_not


def find_restorer(module: torch.nn.Module, diff: LayerDiff) -> tuple[Restorer | None, str]:
    """The first restorer, in registration order, that covers ``diff`` on ``module``; or None and why none does."""
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
