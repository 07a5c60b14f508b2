"""The two load formats vLLM is given: ``ManifestModelLoader`` (``tensorizer_manifest``: its options parsed, then
``load.plan`` and ``load.load_model`` do the load) and ``CaptureModelLoader`` (``tensorizer_manifest_capture``: vLLM's
default loader, its post-load step observed), with the capture's options (the load's, ``LoadOptions``, are
``load.options``'). The attributes they leave on the model (``CAPTURE_ATTR``, ``REPORT_ATTR``, ``ADDED_FORM_ATTR``,
``GENERATION_ATTR``, ``LAYOUT_FORM_SET_ATTR``, ``COMPILE_IDENTITY_ATTR``) are named here, for the worker extension that
reads them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import _vllm_compat
from .._constants import CAPTURE_LOAD_FORMAT, LOAD_FORMAT
from .._error_relay import relaying
from ..checks.fingerprint import engine_fingerprint, refuse_unrecorded_settings
from ..errors import ConfigurationError, UnsupportedModelError
from ..format.generation import Layout
from ..format.schema import Manifest
from ..live_model.sources import SourceObserver
from ..load import compile_placement
from ..load.load_model import load_model
from ..load.options import LoadOptions
from ..load.plan import LoadPlan, first_rank, plan_load, rank_stem
from ..save.capture import Capture, CapturePolicy, FallbackRecorder, capture_around
from ..storage.option_models import describe_validation_error

#: What the loaders leave on the model they return, for the worker extension (``worker``) to read.
CAPTURE_ATTR = "_tensorizer_manifest_capture"
REPORT_ATTR = "_tensorizer_manifest_report"
ADDED_FORM_ATTR = "_tensorizer_manifest_added_form"
GENERATION_ATTR = "_tensorizer_manifest_generation"
LAYOUT_FORM_SET_ATTR = "_tensorizer_manifest_layout_form"
COMPILE_IDENTITY_ATTR = "_tensorizer_manifest_compile_identity"

#: Under vLLM's own logger, so that its handler and level apply: `vllm serve` shows the load line.
logger = logging.getLogger("vllm.tensorizer_manifest")


class CaptureOptions(BaseModel):
    """What ``model_loader_extra_config`` may hold for ``tensorizer_manifest_capture`` (saving)."""

    model_config = ConfigDict(extra="forbid")

    portable: bool = Field(False, description="Save every layer raw: loads wherever the engine settings match.")
    allow_unverified: bool = Field(
        False, description="Save processed also with restorers not verified on this device kind."
    )
    fallbacks: bool = Field(
        True, description="Keep raw tensors beside processed layers whose form is one machine's or one kernel's."
    )
    base: bool = Field(
        False,
        description="Observe which source tensor fills which module, so that the save writes a layout-free base "
        "(format version 3; the first rank reads the source again at the save).",
    )

    @classmethod
    def from_load_config(cls, load_config: Any) -> CaptureOptions:
        raw = dict(getattr(load_config, "model_loader_extra_config", None) or {})
        try:
            return cls(**raw)
        except ValidationError as exc:
            raise ConfigurationError(
                f"invalid model_loader_extra_config for {CAPTURE_LOAD_FORMAT}: {describe_validation_error(exc)}"
            ) from None


_RELEASES_SAID: set[str] = set()


def refuse_unknown_releases() -> None:
    """First in each loader: a vLLM release this package has neither run nor read-checked is refused before anything
    is read (``_vllm_compat.release_status``); the first load in a process says which of the two this one is."""
    version = _vllm_compat.vllm_version()
    status = _vllm_compat.release_status(version)
    if version not in _RELEASES_SAID:
        _RELEASES_SAID.add(version)
        how = (
            "run by its tests on CPU"
            if status == "run"
            else "read-checked (every vLLM name it uses found in this release's sources; not run by its tests)"
        )
        logger.info("tensorizer-manifest on vLLM %s: %s", version, how)


class ManifestModelLoader(_vllm_compat.BaseModelLoader):
    """Loads a tensorizer-manifest checkpoint: validate, restore, replay (``load.plan``, ``load.load_model``)."""

    def download_model(self, model_config) -> None:  # tensors are streamed from checkpoint_dir at load
        return None

    def load_weights(self, model, model_config) -> None:
        raise UnsupportedModelError(f"{LOAD_FORMAT} loads whole models; in-place weight reloading is not supported")

    @relaying
    def load_model(self, vllm_config, model_config, prefix: str = ""):
        refuse_unknown_releases()
        options = LoadOptions.from_load_config(self.load_config)
        device = _vllm_compat.load_device(vllm_config, self.load_config)
        plan = plan_load(vllm_config, model_config, prefix, options, device)
        add_form = _AddForm(plan) if options.add_form else None
        model, report = load_model(plan, add_form)
        if plan.compile_form is not None and plan.compile_form.aot:  # the weights are in: the compiled functions
            report["aot_artifacts_loaded"] = compile_placement.load_aot_artifacts(
                model, vllm_config, plan.compile_form.directory, f"{plan.root}: compile form"
            )
        setattr(model, REPORT_ATTR, report)
        setattr(model, GENERATION_ATTR, plan.generation)
        if plan.compile_identity is not None:  # add-form --compile: what the form is made for
            setattr(model, COMPILE_IDENTITY_ATTR, plan.compile_identity)
        if add_form is not None:
            add_form.leave_on(model)
        return model


class _AddForm:
    """``add-form``'s observation of a load (``load_model.FormObserver``), captured as a save captures: this
    layout's form set where the load takes the base, the processed form of the layers a form set's load takes
    through their raw fallback; left on the model for the worker's add-form to write and commit."""

    def __init__(self, plan: LoadPlan):
        self.plan, self.stem = plan, plan.stem
        self.layout_forms: list[Capture] = []
        self.recorder: FallbackRecorder | None = None
        self.added: tuple | None = None

    def around_base_steps(self, model: torch.nn.Module, run_steps, filled: dict[str, list[str]]) -> None:
        policy = CapturePolicy(device_type=self.plan.engine.device_type)
        self.layout_forms.append(capture_around(model, run_steps, policy, self.plan.engine))
        self.layout_forms[-1].base_fills = filled  # this layout's form set stores only what the steps changed

    def watch_fallbacks(self, model: torch.nn.Module, paths: set[str]):
        self.recorder = FallbackRecorder(model, paths, self.plan.engine.device_type)
        return self.recorder.layer_ready

    def fallbacks_replayed(self, loaded: Manifest) -> None:
        # with the manifest it was made from: add-form commits only over that one (write_added_form)
        assert self.recorder is not None  # the load watches the fallbacks before it replays them
        self.added = (*self.recorder.finish(self.plan.engine, self.stem), loaded)

    def leave_on(self, model: torch.nn.Module) -> None:
        for capture in self.layout_forms:  # this layout's form set, for the worker's add-form to write and commit
            capture.stem = self.stem
            setattr(model, LAYOUT_FORM_SET_ATTR, capture)
        if self.added is not None:
            setattr(model, ADDED_FORM_ATTR, self.added)


class CaptureModelLoader(_vllm_compat.DefaultModelLoader):
    """vLLM's default loader, with the post-load step observed so the engine can save itself."""

    def __init__(self, load_config: Any) -> None:
        self.options = CaptureOptions.from_load_config(load_config)
        self.observer: SourceObserver | None = None
        # The default loader picks weight files by load format; read them as "auto" does.
        super().__init__(_vllm_compat.source_load_config(load_config))

    def get_all_weights(self, model_config, model):
        weights = super().get_all_weights(model_config, model)
        return weights if self.observer is None else self.observer.source(weights)

    def load_weights(self, model, model_config) -> None:
        if self.observer is None:
            return super().load_weights(model, model_config)
        with self.observer.watching(model):
            return super().load_weights(model, model_config)

    @relaying
    def load_model(self, vllm_config, model_config, prefix: str = ""):
        refuse_unknown_releases()
        fingerprint = engine_fingerprint(vllm_config)
        refuse_unrecorded_settings(vllm_config, None, str(model_config.model))
        if self.options.base:
            self.observer = _base_observer(vllm_config)
        captured: list[Capture] = []

        def observe(model: torch.nn.Module, run_step) -> None:
            policy = CapturePolicy(
                portable=self.options.portable,
                allow_unverified=self.options.allow_unverified,
                device_type=fingerprint.device_type,
                fallbacks=self.options.fallbacks,
            )
            # pre-step copies go to a nameless file in $TENSORIZER_MANIFEST_SPILL_DIR
            captured.append(capture_around(model, run_step, policy, fingerprint))

        try:
            with _vllm_compat.observe_post_load(observe):
                model = super().load_model(vllm_config, model_config, prefix)
        except BaseException:
            for capture in captured:
                capture.close()
            raise
        for stale in captured[:-1]:
            stale.close()
        if not captured:
            raise UnsupportedModelError(
                f"vLLM {_vllm_compat.vllm_version()}'s default loader did not run its post-load step where "
                "tensorizer-manifest observes it; this vLLM cannot save with a manifest"
            )
        capture = captured[-1]
        capture.stem = rank_stem(vllm_config)
        if self.observer is not None:  # rank 0's observation writes the base; every rank's leaves its layers to it
            capture.source = self.observer.observed if first_rank() else None
            capture.base_fills = self.observer.observed.loaded
        setattr(model, CAPTURE_ATTR, capture)
        return model


def _base_observer(vllm_config) -> SourceObserver:
    """Every rank's observer of the source: the first rank's records it, content hashes and all, for the base (the
    others read the same tensors into the same modules); each rank's says which parameters its weight loaders
    filled, the layers its form set can leave to the base. A layout whose first rank does not see every module is
    refused, for now, before anything is loaded."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1 or getattr(parallel, "enable_expert_parallel", False):
        raise ConfigurationError(
            "a base is observed by a saving engine that holds every layer and every expert on its first rank: save "
            "with pipeline_parallel_size=1 and without expert parallelism (the checkpoint then loads at those "
            "layouts through its base), or without a base"
        )
    return SourceObserver(Layout(tp=parallel.tensor_parallel_size), content_hashes=first_rank())
