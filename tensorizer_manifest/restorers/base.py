"""What a restorer is, and the registry that finds one for a layer.

A restorer rebuilds, for one kind of layer, the runtime state that vLLM's
``process_weights_after_loading`` created, from tensors that are already in
their processed form, without transforming them again. At save time a layer
is marked ``processed`` only when a restorer ``covers`` everything the step
did to it; at load time that restorer replays it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..layers import LayerDiff
from ..schema import REPLAY_NONE, REPLAY_POST_LOAD


class Restorer:
    """Rebuilds the runtime state of one kind of processed layer.

    Subclass it in a module of its own under ``tensorizer_manifest/restorers/``
    and ``register`` an instance there: the package imports every module in
    that folder, so nothing else needs to change.
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

    def applies_to(self, module: torch.nn.Module) -> bool:
        """Whether this restorer is about this kind of layer at all."""
        raise NotImplementedError

    def covers(self, module: torch.nn.Module, diff: LayerDiff) -> str | None:
        """None when ``replay`` rebuilds everything in ``diff``; else why not (shown to users)."""
        raise NotImplementedError

    def replay(self, module: torch.nn.Module, model_config: Any) -> None:
        """Rebuild the layer's runtime state from its processed tensors. Never transform them."""
        raise NotImplementedError


#: Every registered restorer, by name.
RESTORERS: dict[str, Restorer] = {}


def register(restorer: Restorer) -> Restorer:
    """Add a restorer. Names are part of the manifest format: never rename one."""
    if restorer.name in RESTORERS or restorer.name in (REPLAY_NONE, REPLAY_POST_LOAD):
        raise ValueError(f"restorer name {restorer.name!r} is taken")
    RESTORERS[restorer.name] = restorer
    return restorer


def known_replays() -> set[str]:
    """Every value a manifest's ``replay`` may have with the restorers installed here."""
    return {REPLAY_POST_LOAD, REPLAY_NONE, *RESTORERS}


def find_restorer(module: torch.nn.Module, diff: LayerDiff) -> tuple[Restorer | None, str]:
    """The restorer that covers ``diff`` on ``module``, or None and why none does."""
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
