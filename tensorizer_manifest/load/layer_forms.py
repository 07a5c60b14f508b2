"""Load side: each layer's form, chosen before a byte of weights is read.

A processed layer whose form belongs to one machine kind or one kernel may carry
a raw fallback (``ModuleRecord.fallback``). This module decides, per layer and
from the freshly built model alone, which form this engine loads: the saved
processed form where this machine and this vLLM would produce it, else the
first form another engine added (``add-form``) that fits, else the raw
fallback, which then replays as any raw layer does (vLLM's own step, once).
The choice becomes an *effective manifest* in which the layers that fall back
are plain raw records (and those that take an added form, that form's record),
so that everything after it (``restore.check_model``, the reader, ``replay``) works
on one form per layer and never sees the other. A
processed layer that does not fit and has no fallback stays as it is, and
``restore.check_forms`` or ``fingerprint.check_compatible`` refuses it as before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from ..checks.fingerprint import PROCESSED_ONLY, differences
from ..format.schema import REPLAY_POST_LOAD, Fingerprint, Manifest, ModuleRecord, kernel_map, qualified_class
from ..live_model.layers import find_kernels
from ..restorers import RESTORERS


@dataclass(frozen=True)
class Fallback:
    """A layer loaded through its raw fallback, and why its processed form was not loaded."""

    path: str
    reason: str


@dataclass(frozen=True)
class FormChoice:
    """What ``choose_forms`` decided: the manifest to load, and the layers that fell back."""

    manifest: Manifest
    """The effective manifest: the saved one with every layer that falls back turned into a raw record, and
    every layer that loads an added form given that form's record."""
    fallbacks: tuple[Fallback, ...] = ()
    processed: int = 0
    """Layers that have a fallback and load processed all the same (their saved form fits here)."""
    added: dict[str, int] = field(default_factory=dict)
    """Layers that load a form another engine added, and which one (its index in ``manifest.added_forms``):
    their tensors are in that form's tensor file."""
    skipped_forms: dict[int, str] = field(default_factory=dict)
    """Added forms this loader cannot use (``validate.CheckedFiles.skipped``), by index: why."""

    def to_dict(self) -> dict:
        """For the load report: how many layers load in each form, and why each fallback was taken."""
        return {
            "processed_with_fallback": self.processed,
            "added_form": len(self.added),
            "added_form_layers": dict(self.added),
            "fallback": len(self.fallbacks),
            "fallback_reasons": dict(Counter(f.reason for f in self.fallbacks)),
            "fallback_layers": [f.path for f in self.fallbacks],
            "skipped_forms": {str(index): reason for index, reason in sorted(self.skipped_forms.items())},
        }


def why_not_processed(
    record: ModuleRecord, module: torch.nn.Module, saved: Fingerprint, current: Fingerprint
) -> str | None:
    """Why this engine cannot load ``record``'s processed form into the freshly built ``module``; None when it can.

    In order: the engine (a kernel-specific form needs the saving vLLM, device and backends), the layout
    this machine's kernels would write (``Restorer.form``), the kernels the model was built with, and
    whether the restorer is verified on this device kind.
    """
    restorer = RESTORERS.get(record.replay)
    if restorer is None:
        return f"no restorer {record.replay!r} in this tensorizer-manifest"
    if not restorer.kernel_independent:
        changed = differences(saved, current, PROCESSED_ONLY)
        if changed:
            return "saved by an engine with " + ", ".join(
                f"{name} {was!r} (this engine: {now!r})" for name, was, now in changed
            )
    here = restorer.form(module)
    if here != record.form:
        return f"form {record.form} recorded, this machine gives {here}"
    if changed_kernels := kernel_differences(record, module):
        owner, attr, saved_class, now = changed_kernels[0]
        return f"kernel {owner}.{attr} {saved_class} recorded, this engine builds {now}"
    if record.verified is not False and not restorer.verified_for(current.device_type):
        return f"restorer {restorer.name} is not verified on {current.device_type}"
    return None


def kernel_differences(record: ModuleRecord, module: torch.nn.Module) -> list[tuple[str, str, str, str]]:
    """``(owner, attr, saved class, built class)`` for each recorded kernel the freshly built layer already has
    in another class (kernels made later, by vLLM's step, are not compared here)."""
    fresh = kernel_map(find_kernels(module))
    return [
        (owner, attr, saved_class, fresh[(owner, attr)])
        for (owner, attr), saved_class in kernel_map(record.kernels).items()
        if fresh.get((owner, attr)) not in (None, saved_class)
    ]


def as_raw(record: ModuleRecord) -> ModuleRecord:
    """The record of a layer loaded through its fallback: raw, its tensors the fallback's, replayed by vLLM's step.

    The runtime state recorded is the processed form's, which vLLM's step on this machine need not repeat
    (another experts class has other attributes): it is not checked. The kernels are, as for any raw layer,
    only reported where they changed.
    """
    return msgspec.structs.replace(
        record,
        state="raw",
        replay=REPLAY_POST_LOAD,
        tensors=record.fallback,
        runtime_state=[],
        form={},
        verified=None,
        fallback=[],
    )


def choose_forms(
    manifest: Manifest,
    model: torch.nn.Module,
    current: Fingerprint,
    usable: Callable[[int], bool] = lambda index: True,
) -> FormChoice:
    """Each layer with a fallback: its saved processed form where that fits here, else the first added form
    that fits (``add-form``) and that ``usable`` can read, else its fallback (``why_not_processed`` decides
    each). ``usable`` is asked only about a form that fits, so only the forms chosen are ever opened."""
    if not any(m.fallback for m in manifest.modules):
        return FormChoice(manifest)
    built = dict(model.named_modules())
    added_by_path: list[dict[str, ModuleRecord]] = [{} for _ in manifest.added_forms]
    for index, form in manifest.readable_forms():
        added_by_path[index] = form.module_map()
    modules: list[ModuleRecord] = []
    fallbacks: list[Fallback] = []
    added: dict[str, int] = {}
    processed = 0
    for record in manifest.modules:
        module = built.get(record.path)
        if not record.fallback or module is None or qualified_class(module) != record.module_class:
            modules.append(record)  # nothing to choose, or a model that does not match: check_model says how
            continue
        reason = why_not_processed(record, module, manifest.fingerprint, current)
        if reason is None:
            processed += 1
            modules.append(msgspec.structs.replace(record, fallback=[]))
            continue
        for index, form in manifest.readable_forms():
            other = added_by_path[index].get(record.path)
            if other is None:
                continue
            if why_not_processed(other, module, form.fingerprint, current) is None and usable(index):
                added[record.path] = index
                modules.append(msgspec.structs.replace(other, fallback=[]))
                break
        else:
            tried = sum(record.path in forms for forms in added_by_path)
            also = f" (and {tried} added form(s) do not fit here or cannot be read)" if tried else ""
            fallbacks.append(Fallback(record.path, reason + also))
            modules.append(as_raw(record))
    effective = msgspec.structs.replace(manifest, modules=modules)
    return FormChoice(effective, tuple(fallbacks), processed, added)
