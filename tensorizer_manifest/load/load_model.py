"""A planned load (``plan.LoadPlan``) carried out: from a form set (the rank's manifest checked, the model built
and checked against it, its tensors restored, then the replay) or, where the plan says why not, every layer from
the generation's base (``from_base``). Returns the model and its load report; what the loader leaves on the model
for the worker is the loader's (``vllm_integration``).

``add-form`` observes vLLM's steps of a load through a ``FormObserver`` the layer above gives (it captures as a
save does), so that this folder never imports ``save``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from .. import _vllm_compat
from ..checks.fingerprint import check_compatible, refuse_unrecorded_settings
from ..checks.generation_files import check_generation
from ..checks.seal import unsealed_warning
from ..checks.validate import open_checked_base, open_checked_forms
from ..errors import ConfigurationError, IntegrityError, NoManifestError
from ..format.generation import BaseDocument
from ..format.schema import Manifest, fed_from_base
from ..progress import terminal_progress
from ..storage.checkpoint import (
    FileLocation,
    check_named_tensor_file,
    check_one_save,
    checkpoint_stem,
    has_rank,
    load_base,
    load_manifest,
    no_manifest_error,
)
from ..storage.remote import RemoteFile
from . import replay
from .from_base import feed_layers, load_from_base
from .layer_forms import choose_forms
from .plan import LoadPlan, first_rank
from .restore import check_model, restore_tensors, without_layers

#: Under vLLM's own logger, so that its handler and level apply: `vllm serve` shows the load line.
logger = logging.getLogger("vllm.tensorizer_manifest")


class FormObserver(Protocol):
    """What ``add-form`` observes of a load: vLLM's steps on the layers whose processed form this engine would
    add (the layer above implements it with ``save.capture``)."""

    def around_base_steps(
        self, model: torch.nn.Module, run_steps: Callable[[], None], filled: dict[str, list[str]]
    ) -> None:
        """A load from the base: runs ``run_steps`` (vLLM's step on every layer) inside its observation;
        ``filled``: the parameters the base filled (``from_base.load_from_base``'s ``around_steps``)."""

    def watch_fallbacks(self, model: torch.nn.Module, paths: set[str]) -> Callable[[str, torch.nn.Module], None]:
        """A load from a form set, before a tensor is read: the layers it takes through their raw fallback. The
        callable is given each layer once its tensors are in, before vLLM's step runs on it."""

    def fallbacks_replayed(self, loaded: Manifest) -> None:
        """After the replay: vLLM's steps ran on those layers; ``loaded``: the rank's manifest as read (before one
        form a layer was chosen), the one an added form is committed over."""


def load_model(plan: LoadPlan, add_form: FormObserver | None = None) -> tuple[torch.nn.Module, dict]:
    """The model, in eval mode, and its load report (``compile_form`` included)."""
    if plan.why_base is not None:
        model, report = _load_from_base(plan, add_form)
    else:
        model, report = _load_forms(plan, add_form)
    report["compile_form"] = None if plan.compile_form is None else str(plan.compile_form.directory)
    return model, report


def overlap_policy(overlap_steps: bool | None, device: torch.device) -> dict[str, bool]:
    """Which steps run while later layers are still read: ``raw_steps`` (vLLM's own), ``restorers``.

    Unset, restorers always do (light, or packing one layer while the rest streams in), and vLLM's steps on
    raw layers only off the CPU: on CPU they pack every raw linear with oneDNN on every core, and beside
    the readers that is slower than reading first (docs/performance.md has the paired runs).
    """
    if overlap_steps is not None:
        return {"raw_steps": overlap_steps, "restorers": overlap_steps}
    return {"raw_steps": device.type != "cpu", "restorers": True}


def _load_forms(plan: LoadPlan, add_form: FormObserver | None) -> tuple[torch.nn.Module, dict]:
    """The rank's manifest found and checked (its tensor file named, its generation's files and seal, the engine
    against what saved it), then the model restored and replayed from it."""
    if plan.fingerprint is None:
        raise plan.undescribed  # type: ignore[misc]
    options, generation = plan.options, plan.generation
    try:
        manifest, manifest_path = load_manifest(
            plan.root, plan.stem, remote=options.remote(), generation=generation, follow_pointer=False,
            vllm_version=plan.engine.vllm_version,
        )  # fmt: skip
    except NoManifestError as exc:
        model_path = plan.model_config.model
        source = model_path if str(model_path).rstrip("/") != plan.checkpoint.rstrip("/") else None
        tensor_file = exc.tensor_file
        assert isinstance(tensor_file, (Path, RemoteFile))  # load_manifest names the file it found alone
        raise no_manifest_error(
            tensor_file, source=source or "SOURCE_MODEL", save_flags=_save_flags(plan.vllm_config)
        ) from None
    if plan.named_file is not None and plan.stem == checkpoint_stem():
        check_named_tensor_file(manifest, manifest_path, plan.named_file)
    if generation is None:
        check_one_save(manifest, plan.stem, plan.checkpoint, options.remote())
    else:
        encrypted = manifest.tensor_file.encryption != "none"
        check_generation(generation, encrypted, plan.signing_key, plan.encryption_key, plan.model_config.model)
    with open_checked_forms(
        manifest,
        manifest_path,
        signing_key=plan.signing_key,
        encryption_key=plan.encryption_key,
        device=str(plan.device),
        num_readers=options.num_readers,
        base_available=generation is not None and generation.base is not None,
    ) as readers:
        unsealed = unsealed_warning(manifest) if plan.signing_key is None and plan.encryption_key is None else None
        if unsealed:
            logger.warning("%s: %s", manifest_path, unsealed)
        check_compatible(manifest.fingerprint, plan.engine, manifest, str(manifest_path))
        refuse_unrecorded_settings(plan.vllm_config, manifest, str(manifest_path))
        plan.clock.lap("check_files")
        base = None if generation is None else _CheckedBase(plan)
        model, summary = _restore_and_replay(plan, manifest, readers, base, add_form)
    summary["encrypted"] = plan.encryption_key is not None
    summary["generation"] = None if generation is None else generation.id
    _log_load(manifest_path, summary)
    return model.eval(), summary


def _restore_and_replay(
    plan: LoadPlan, manifest: Manifest, readers, base: _CheckedBase | None, add_form: FormObserver | None
) -> tuple[torch.nn.Module, dict]:
    """Build the model, choose each layer's form and check the model against them, then read, restore and
    replay; returns the model and its report. ``readers``: the tensor files (``validate.CheckedFiles``);
    ``base``: the generation's base (None without one), where the layers the form set leaves to it are fed from,
    first (``from_base.feed_layers``)."""
    options, clock, target_device = plan.options, plan.clock, plan.device
    with _vllm_compat.model_built(plan.vllm_config, plan.model_config, target_device, plan.prefix) as model:
        clock.lap("build_model")
        loaded = manifest
        forms = choose_forms(manifest, model, plan.engine, readers.usable)
        forms = dataclasses.replace(forms, skipped_forms=dict(readers.skipped))
        for index, reason in sorted(forms.skipped_forms.items()):
            logger.warning("added form %d is skipped, its layers load their next choice: %s", index, reason)
        manifest = forms.manifest  # one form a layer from here on: the reader skips the other's bytes
        check_model(manifest, model)  # before a byte of weights is read
        clock.lap("check_model")
        overlap = overlap_policy(options.overlap_steps, target_device)
        replayer = replay.Replayer(
            model,
            manifest,
            plan.model_config,
            target_device,
            overlap_raw_steps=overlap["raw_steps"],
            overlap_restorers=overlap["restorers"],
        )
        on_layer = replayer.layer_ready
        if add_form is not None:
            fallback_ready = add_form.watch_fallbacks(model, {f.path for f in forms.fallbacks})

            def on_layer(record, module, check_hashes):  # the layer as loaded, then vLLM's step (or not yet)
                fallback_ready(record.path, module)
                replayer.layer_ready(record, module, check_hashes)

        fed = [record for record in manifest.modules if fed_from_base(record.tensors)]
        fed_report: dict[str, Any] = {}
        if fed:  # before any other layer is read: a tensor that also feeds a form layer is overwritten there
            if base is None:  # checks.records refused this already; a loader never feeds from no base
                raise IntegrityError(
                    f"{fed[0].path!r} is recorded in the base, and this checkpoint has none: it was edited, or "
                    "its generation's base is gone; save the checkpoint again"
                )
            with base.open(target_device) as base_reader:
                fed_report = feed_layers(
                    model,
                    base.document,
                    base_reader,
                    fed,
                    verify_hashes=options.verify_hashes,
                    not_this_ranks=_vllm_compat.other_ranks_experts(plan.vllm_config, model),
                )
            for record in fed:  # its hashes were checked as it was fed
                on_layer(record, model.get_submodule(record.path), lambda path: None)
        sources = {path: readers.form(index) for path, index in forms.added.items()}
        with terminal_progress("loading", enabled=options.progress and first_rank()) as progress:
            nbytes = restore_tensors(
                model,
                without_layers(manifest, {record.path for record in fed}),
                readers.main,
                verify_hashes=options.verify_hashes,
                on_layer=on_layer,
                progress=progress,
                sources=sources,
            )
        readers.close()  # replay needs no file
        overlapped = replayer.step_seconds
        clock.lap("read_tensors")
        report = replayer.finish()
        if add_form is not None:
            add_form.fallbacks_replayed(loaded)
        clock.lap("replay")
    return model, {
        **report.to_dict(),
        "bytes_read": nbytes,
        "verify_hashes": options.verify_hashes,
        "num_readers": readers.main.num_readers,
        "forms": forms.to_dict(),
        "overlap_steps": overlap,
        "seconds": clock.laps,
        "step_seconds": {"while_reading": round(overlapped, 6), "total": round(replayer.step_seconds, 6)},
        **fed_report,
    }


def _load_from_base(plan: LoadPlan, add_form: FormObserver | None) -> tuple[torch.nn.Module, dict]:
    """No form set of the generation fits this engine (``plan.why_base``): every layer from its base
    (``from_base``). With ``add_form``, vLLM's steps are observed as a save's are, for this layout's form set."""
    root, generation, why, fingerprint = plan.root, plan.generation, plan.why_base, plan.fingerprint
    assert generation is not None  # a plan takes the base only where its generation has one
    if add_form is not None and fingerprint is None:
        raise ConfigurationError(
            f"{root}: this vLLM cannot describe the forms it would make, so add-form cannot run on it ({why})"
        )
    if add_form is not None and has_rank(generation, plan.stem, plan.engine.vllm_version):
        raise ConfigurationError(
            f"{root}: {why}; add-form adds a form set at a layout only where this vLLM release made none (one "
            "form set a layout and release): start its engine with the settings that form set was made with"
        )
    checked_base = _CheckedBase(plan)
    base = checked_base.document
    encrypted = base.tensor_file is not None and base.tensor_file.encryption != "none"
    check_generation(generation, encrypted, plan.signing_key, plan.encryption_key, plan.model_config.model)
    clock = plan.clock
    with checked_base.open(plan.device) as reader:
        clock.lap("check_files")
        with _vllm_compat.model_built(plan.vllm_config, plan.model_config, plan.device, plan.prefix) as model:
            clock.lap("build_model")
            report = load_from_base(
                model,
                base,
                reader,
                plan.model_config,
                plan.device,
                verify_hashes=plan.options.verify_hashes,
                around_steps=None if add_form is None else add_form.around_base_steps,
                not_this_ranks=_vllm_compat.other_ranks_experts(plan.vllm_config, model),
            )
        clock.lap("read_and_post_load")
    summary = {**report, "seconds": clock.laps, "generation": generation.id, "encrypted": encrypted, "why": why}
    logger.warning(
        "%s: %s; loaded from its base through vLLM's weight loaders (%d of %d base tensors, %.1f MB), vLLM's "
        "post-load step ran on %d layer(s); %.2f s",
        root,
        why,
        report["tensors_read"],
        report["tensors_in_base"],
        report["bytes_read"] / 1e6,
        len(report["post_load"]),
        sum(clock.laps.values()),
    )
    return model.eval(), summary


class _CheckedBase:
    """A generation's base, read only when a load needs it: its document checked against the generation
    (``checkpoint.load_base``), its tensor file checked and opened (``open``)."""

    def __init__(self, plan: LoadPlan):
        assert plan.generation is not None and not isinstance(plan.root, str)  # a generation is found in a folder
        self._root, self._generation = plan.root, plan.generation
        self._encryption_key = plan.encryption_key
        self._num_readers = plan.options.num_readers
        self._source_dir = plan.options.base_source_dir
        self._found: tuple[BaseDocument, FileLocation, FileLocation] | None = None

    def _checked(self) -> tuple[BaseDocument, FileLocation, FileLocation]:
        if self._found is None:
            self._found = load_base(self._root, self._generation, self._source_dir)
        return self._found

    @property
    def document(self) -> BaseDocument:
        return self._checked()[0]

    def open(self, device: torch.device):
        document, where, tensor_file = self._checked()
        return open_checked_base(
            document,
            where,
            tensor_file,
            encryption_key=self._encryption_key,
            device=str(device),
            num_readers=self._num_readers,
        )


def _save_flags(vllm_config: Any) -> str:
    """The ``tensorizer-manifest save`` flags that give a checkpoint this engine's settings."""
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    flags = [f"--dtype {str(model.dtype).removeprefix('torch.')}"]
    if parallel.tensor_parallel_size > 1:
        flags.append(f"-tp {parallel.tensor_parallel_size}")
    if parallel.pipeline_parallel_size > 1:
        flags.append(f"-pp {parallel.pipeline_parallel_size}")
    if getattr(cache, "cache_dtype", "auto") not in ("auto", None):
        flags.append(f"--kv-cache-dtype {cache.cache_dtype}")
    return " ".join(flags)


def _log_load(manifest_path: FileLocation, summary: dict) -> None:
    laps = summary["seconds"]
    raw = len({step.rpartition(":")[0] for step in summary["post_load"]})
    logger.info(
        "Loading weights with tensorizer_manifest took %.2f s (%s): %.1f MB read by %d readers (%d layer(s) fed "
        "from the base: %.1f MB of it), content hashes %s; %d raw layer(s) got vLLM's post-load step (%.2f s of it "
        "while reading), %d processed layer(s) restored; checks %.3f s, model built %.2f s, read %.2f s, rest of "
        "replay and audit %.2f s",
        sum(laps.values()),
        manifest_path,
        (summary["bytes_read"] + summary.get("base_bytes_read", 0)) / 1e6,
        summary["num_readers"],
        len(summary.get("layers_fed", ())),
        summary.get("base_bytes_read", 0) / 1e6,
        "checked" if summary["verify_hashes"] else "NOT checked",
        raw,
        summary["step_seconds"]["while_reading"],
        len(summary["restored"]),
        laps["check_files"] + laps["check_model"],
        laps["build_model"],
        laps["read_tensors"],
        laps["replay"],
    )
    forms = summary["forms"]
    if forms["added_form"]:
        logger.info(
            "%s: %d processed layer(s) loaded from forms other engines added (add-form), no post-load step",
            manifest_path,
            forms["added_form"],
        )
    if forms["fallback"]:
        reasons = "; ".join(f"{n} layer(s): {why}" for why, n in forms["fallback_reasons"].items())
        logger.warning(
            "%s: %d processed layer(s) loaded through their raw fallback, vLLM's post-load step ran on them "
            "(%d loaded processed): %s. `tensorizer-manifest add-form` on this machine kind adds its processed form.",
            manifest_path,
            forms["fallback"],
            forms["processed_with_fallback"],
            reasons,
        )
