"""The two load formats vLLM is given: ``ManifestModelLoader`` (``tensorizer_manifest``: validate, restore, replay)
and ``CaptureModelLoader`` (``tensorizer_manifest_capture``: vLLM's default loader, its post-load step observed),
with their option models. The attributes they leave on the model (``CAPTURE_ATTR``, ``REPORT_ATTR``,
``ADDED_FORM_ATTR``, ``GENERATION_ATTR``, ``LAYOUT_FORM_ATTR``, ``COMPILE_IDENTITY_ATTR``) are named here, for the
worker extension that reads them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import _failpoints, _vllm_compat
from .._constants import CAPTURE_LOAD_FORMAT, LOAD_FORMAT
from .._error_relay import relaying
from ..checks.fingerprint import check_compatible, engine_fingerprint, refuse_unrecorded_settings
from ..checks.generation_files import check_generation
from ..checks.seal import check_generation_seal, unsealed_warning
from ..checks.validate import open_checked_base, open_checked_forms
from ..errors import (
    CompatibilityError,
    ConcurrentWriteError,
    ConfigurationError,
    IntegrityError,
    NoManifestError,
    TensorizerManifestError,
    UnsupportedModelError,
    UnsupportedVLLMError,
)
from ..format.generation import BaseDocument, Generation, Layout, decode_pointer, encode_pointer
from ..format.schema import fed_from_base
from ..load import compile_placement, replay
from ..load.forms import choose_forms
from ..load.from_base import feed_layers, load_from_base
from ..load.restore import check_model, restore_tensors, without_layers
from ..model.sources import SourceObserver
from ..progress import terminal_progress
from ..save.capture import Capture, CapturePolicy, FallbackRecorder, capture_around
from ..storage.checkpoint import (
    check_named_tensor_file,
    check_one_save,
    checkpoint_location,
    checkpoint_root,
    checkpoint_stem,
    encryption_key_from,
    form_set_of,
    has_rank,
    load_base,
    load_generation,
    load_manifest,
    no_manifest_error,
    pinned_generation,
    read_pointer,
    signing_key_from,
)
from ..storage.options import (
    S3Options,
    describe_validation_error,
    from_tensorizer_config_names,
    tensorizer_config_options,
)
from ..storage.remote import RemoteDir

#: What the loaders leave on the model they return, for the worker extension (``worker``) to read.
CAPTURE_ATTR = "_tensorizer_manifest_capture"
REPORT_ATTR = "_tensorizer_manifest_report"
ADDED_FORM_ATTR = "_tensorizer_manifest_added_form"
GENERATION_ATTR = "_tensorizer_manifest_generation"
LAYOUT_FORM_ATTR = "_tensorizer_manifest_layout_form"
COMPILE_IDENTITY_ATTR = "_tensorizer_manifest_compile_identity"

#: Under vLLM's own logger, so that its handler and level apply: `vllm serve` shows the load line.
logger = logging.getLogger("vllm.tensorizer_manifest")


def _log_load(manifest_path: Path, summary: dict) -> None:
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


class LoadOptions(S3Options):
    """What users may pass in ``model_loader_extra_config`` for ``tensorizer_manifest``.

    vLLM's ``TensorizerConfig`` names work too, with the same meaning (``tensorizer_uri``, ``tensorizer_dir``,
    ``verify_hash``, ``encryption_keyfile``, ``num_readers``, ``s3_*``): ``options.TENSORIZER_CONFIG_NAMES``.
    """

    model_config = ConfigDict(extra="forbid")

    verify_hashes: bool = Field(True, description="Check each tensor's content hash as it is read (verify_hash).")
    checkpoint_dir: str | None = Field(
        None, description="Checkpoint directory or URI, when not the model path (tensorizer_dir)."
    )
    tensorizer_uri: str | None = Field(
        None,
        description="A tensor file of the checkpoint (local, s3:// or https://), as vLLM's tensorizer_uri; its "
        "manifest is the one beside it. A sharded engine's ranks each read their own files in that directory.",
    )
    num_readers: int | None = Field(
        None, ge=1, le=64, description="Parallel readers of the tensor file (default: one per core, at most 8)."
    )
    overlap_steps: bool | None = Field(
        None,
        description="true: run each layer's post-load step or restorer as soon as its tensors are in, while "
        "later layers are still being read; false: every step after the reading. Default: restorers at once, "
        "vLLM's own steps on raw layers at once on accelerators and after the reading on CPU, where they "
        "(oneDNN packing) use every core and slow the readers more than the overlap gains (docs/performance.md).",
    )
    signing_key_file: str | None = Field(
        None,
        description="Path of the key the checkpoint was saved with (else $TENSORIZER_MANIFEST_SIGNING_KEY); "
        "with a key, only a manifest sealed with it loads.",
    )
    encryption_key_file: str | None = Field(
        None,
        description="Path of the key an encrypted checkpoint was saved with "
        "(else $TENSORIZER_MANIFEST_ENCRYPTION_KEY); "
        "with a key, only an encrypted checkpoint whose seal the key (or the signing key) checks loads.",
    )
    progress: bool = Field(
        False, description="Draw a progress bar of the read on stderr (rank 0, when stdout and stderr are terminals)."
    )
    source: Literal["auto", "base"] = Field(
        "auto",
        description="auto: each rank takes its form set where one fits this engine, the base otherwise. base: "
        "every layer from the checkpoint's base through vLLM's own weight loaders, even where a form set fits (to "
        "check a base, or to measure it); a checkpoint without a base is refused.",
    )
    base_source_dir: str | None = Field(
        None,
        description="Where the source a base by reference (save --base reference) names is now, if it moved since "
        "the save (else the directory recorded then); its files must be the ones saved (size, content hashes).",
    )
    add_form: bool = Field(
        False,
        description="Observe vLLM's step on the layers loaded through their raw fallback, so that the worker "
        "method add_tensorizer_manifest_form can add this engine's processed form of them (`add-form`).",
    )
    trust_compile_forms: bool = Field(
        False,
        description="Use a compile form of a checkpoint whose seal is not checked with your signing key: trusts "
        "whoever can write the checkpoint to run code in this process (compiled graphs are code). Without it, a "
        "compile form is used only where signing_key_file checked the seal.",
    )
    compile_form_dir: str | None = Field(
        None,
        description="Where this engine's compile cache goes, for add-form --compile to make a compile form of "
        "(no compile form of the checkpoint is used then).",
    )

    @classmethod
    def from_load_config(cls, load_config: Any) -> LoadOptions:
        extra = getattr(load_config, "model_loader_extra_config", None) or {}
        if hasattr(extra, "to_serializable"):  # a vLLM TensorizerConfig given as it is
            extra = tensorizer_config_options(extra)
        raw = from_tensorizer_config_names(dict(extra), LOAD_FORMAT)
        try:
            return cls(**raw)
        except ValidationError as exc:
            raise ConfigurationError(
                f"invalid model_loader_extra_config for {LOAD_FORMAT}: {describe_validation_error(exc)}"
            ) from None

    def checkpoint_location(self, model_path: str) -> tuple[str, str | None]:
        """Where the checkpoint is, and the tensor file ``tensorizer_uri`` names there (None if none)."""
        return checkpoint_location(self.tensorizer_uri, self.checkpoint_dir, model_path)


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


def first_rank() -> bool:
    """Rank 0 of every parallel group: the one that draws progress bars."""
    return _vllm_compat.parallel_ranks() == (0, 0)


def rank_stem(vllm_config: Any) -> str:
    """This process's checkpoint stem (``model``, ``model-tp1-of-2``...)."""
    parallel = vllm_config.parallel_config
    tp_rank, pp_rank = _vllm_compat.parallel_ranks()
    return checkpoint_stem(tp_rank, parallel.tensor_parallel_size, pp_rank, parallel.pipeline_parallel_size)


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


class _Clock:
    """Named laps, for the load report: what validation costs next to the load itself."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._last, 6)
        self._last = now


def overlap_policy(overlap_steps: bool | None, device: torch.device) -> dict[str, bool]:
    """Which steps run while later layers are still read: ``raw_steps`` (vLLM's own), ``restorers``.

    Unset, restorers always do (light, or packing one layer while the rest streams in), and vLLM's steps on
    raw layers only off the CPU: on CPU they pack every raw linear with oneDNN on every core, and beside
    the readers that is slower than reading first (docs/performance.md has the paired runs).
    """
    if overlap_steps is not None:
        return {"raw_steps": overlap_steps, "restorers": overlap_steps}
    return {"raw_steps": device.type != "cpu", "restorers": True}


#: Room for a pointer's compact encoding in the first rank's broadcast (about 200 bytes).
_POINTER_BYTES = 1024
_NO_POINTER, _NO_READ, _PINNED = b"-", b"!", b"pinned:"


def agreed_generation(checkpoint: str, options: LoadOptions) -> tuple[Path | RemoteDir, Generation] | None:
    """The checkpoint and the generation every rank of this engine reads, every data-parallel replica included:
    the first rank of the first replica reads the pointer and broadcasts it (``_vllm_compat.first_rank_bytes``), so
    a save committed while the ranks start is read by all or by none. A generation's own folder given as the
    checkpoint (what the plugin makes of vLLM's ``model``: ``plugin.pin_current_generation``) is that generation,
    and every rank must have been given the same one (each node of a multi-node engine resolves its own), else
    every rank raises ``ConcurrentWriteError``. None: the checkpoint has no pointer (format version 1 or 2). Every
    rank must call it."""
    root = checkpoint_root(checkpoint, options.remote())
    pinned = None if root is None else pinned_generation(root)
    payload, failure = _NO_POINTER, None
    if first_rank() and _vllm_compat.data_parallel_rank() == 0 and root is not None:
        try:
            if pinned is not None:
                payload = _PINNED + pinned[1].id.encode()
            else:
                pointer = read_pointer(root)
                payload = _NO_POINTER if pointer is None else encode_pointer(pointer, compact=True)
        except TensorizerManifestError as exc:
            payload, failure = _NO_READ, exc
        _failpoints.pause("before-agreement", "first-rank")
    agreed = _vllm_compat.first_rank_bytes(payload, _POINTER_BYTES, replicas=True).rstrip(b"\0")
    mine = _PINNED + pinned[1].id.encode() if pinned is not None else None
    matches = mine == agreed or (mine is None and not agreed.startswith(_PINNED))
    if not _vllm_compat.every_rank_succeeded(matches, replicas=True):
        theirs = agreed.removeprefix(_PINNED).decode() if agreed.startswith(_PINNED) else "its pointer's"
        given = f"this rank was given {pinned[1].id if pinned else 'its pointer'}" if not matches else (
            "another rank was given another one"
        )  # fmt: skip
        raise ConcurrentWriteError(
            f"{checkpoint}: the ranks of this engine were given different generations as vLLM's model (the first "
            f"rank {theirs}; {given}): a save was committed between the starts of its nodes or replicas; nothing was "
            "loaded. Start them again, or give every node the same CKPT/generations/<id>"
        )
    if pinned is not None:
        return pinned
    if failure is not None:
        raise failure
    if agreed == _NO_READ:
        raise TensorizerManifestError(
            f"{checkpoint}: the first rank of this engine could not read the checkpoint's pointer (its error is "
            "raised beside this one); nothing was loaded"
        )
    if agreed == _NO_POINTER or root is None:
        return None
    found = load_generation(root, decode_pointer(agreed, f"{checkpoint} (the first rank's pointer)"))
    return None if found is None else (root, found[0])


class ManifestModelLoader(_vllm_compat.BaseModelLoader):
    """Loads a tensorizer-manifest checkpoint: validate, restore, replay."""

    def download_model(self, model_config) -> None:  # tensors are streamed from checkpoint_dir at load
        return None

    def load_weights(self, model, model_config) -> None:
        raise UnsupportedModelError(f"{LOAD_FORMAT} loads whole models; in-place weight reloading is not supported")

    @relaying
    def load_model(self, vllm_config, model_config, prefix: str = ""):
        refuse_unknown_releases()
        clock = _Clock()
        options = LoadOptions.from_load_config(self.load_config)
        try:  # first: a vLLM it cannot describe is refused before any weight is read (unless a base serves it)
            fingerprint, undescribed = engine_fingerprint(vllm_config), None
        except UnsupportedVLLMError as exc:
            fingerprint, undescribed = None, exc
        checkpoint, named_file = options.checkpoint_location(model_config.model)
        signing_key = signing_key_from(options.signing_key_file)
        encryption_key = encryption_key_from(options.encryption_key_file)
        stem = rank_stem(vllm_config)
        agreed = agreed_generation(checkpoint, options)  # every rank, before anything can fail on one alone
        root, generation = agreed if agreed is not None else (checkpoint, None)
        _failpoints.pause("after-agreement", stem)
        compile_dir, identity = self._plan_compile_form(
            vllm_config, options, root, generation, signing_key, encryption_key
        )
        if options.source == "base" and (generation is None or generation.base is None):
            raise ConfigurationError(
                f"{checkpoint}: the load options ask for the base (source='base'), and this checkpoint has none (save "
                "it with --base inside, or load it with source='auto')"
            )
        if generation is not None and generation.base is not None:
            why = _why_not_its_forms(root, generation, stem, fingerprint, undescribed, options, vllm_config)
            if why is not None:
                model = self._load_from_base(
                    vllm_config, model_config, prefix, root, generation, options, signing_key, encryption_key, clock,
                    why, fingerprint,
                )  # fmt: skip
                return self._compile_ready(model, compile_dir, identity)
        if fingerprint is None:
            raise undescribed  # type: ignore[misc]
        try:
            manifest, manifest_path = load_manifest(
                root, stem, remote=options.remote(), generation=generation, follow_pointer=False,
                vllm_version=fingerprint.vllm_version,
            )  # fmt: skip
        except NoManifestError as exc:
            source = model_config.model if str(model_config.model).rstrip("/") != checkpoint.rstrip("/") else None
            raise no_manifest_error(
                exc.tensor_file, source=source or "SOURCE_MODEL", save_flags=_save_flags(vllm_config)
            ) from None
        if named_file is not None and stem == checkpoint_stem():
            check_named_tensor_file(manifest, manifest_path, named_file)
        if generation is None:
            check_one_save(manifest, stem, checkpoint, options.remote())
        else:
            check_generation(
                generation, manifest.tensor_file.encryption != "none", signing_key, encryption_key, model_config.model
            )
        device_config = vllm_config.device_config
        load_device = device_config.device if self.load_config.device is None else self.load_config.device
        target_device = torch.device(load_device)
        with open_checked_forms(
            manifest,
            manifest_path,
            signing_key=signing_key,
            encryption_key=encryption_key,
            device=str(target_device),
            num_readers=options.num_readers,
            base_available=generation is not None and generation.base is not None,
        ) as readers:
            unsealed = unsealed_warning(manifest) if signing_key is None and encryption_key is None else None
            if unsealed:
                logger.warning("%s: %s", manifest_path, unsealed)
            check_compatible(manifest.fingerprint, fingerprint, manifest, str(manifest_path))
            refuse_unrecorded_settings(vllm_config, manifest, str(manifest_path))
            clock.lap("check_files")
            base = None if generation is None else _CheckedBase(root, generation, encryption_key, options)
            model, summary = self._restore_and_replay(
                vllm_config, model_config, prefix, manifest, fingerprint, readers, target_device, options, clock, base
            )
        summary["encrypted"] = encryption_key is not None
        summary["generation"] = None if generation is None else generation.id
        setattr(model, REPORT_ATTR, summary)
        setattr(model, GENERATION_ATTR, generation)
        _log_load(manifest_path, summary)
        return self._compile_ready(model.eval(), compile_dir, identity)

    @staticmethod
    def _plan_compile_form(
        vllm_config, options, root, generation, signing_key, encryption_key
    ) -> tuple[Path | None, dict | None]:
        """Before the model is built (vLLM reads its compile settings then): the compile form this engine uses, in
        a private directory, or None (said in the log where the checkpoint has one). ``add-form --compile`` compiles
        into the directory it packs and uses no form; what that form is for (``EngineCompile``) is taken here, at
        the moment a load decides on a form, because building a model may change its config (a MoE model's)."""
        if options.compile_form_dir is not None:
            compile_placement.compile_into(vllm_config, Path(options.compile_form_dir))
            return None, dataclasses.asdict(compile_placement.EngineCompile.of(vllm_config))
        if generation is None or not generation.compile_forms:
            return None, None  # the usual load: no seal computed twice for a form that is not there
        trusted_by = "signing key" if signing_key is not None else None
        if trusted_by is None and options.trust_compile_forms:
            trusted_by = "trust_compile_forms"
        seal = check_generation_seal(generation, False, signing_key, encryption_key)
        used = compile_placement.use_compile_form(
            vllm_config, generation, root, trusted_by, None if seal is None else seal[1]
        )
        return used, None

    @staticmethod
    def _compile_ready(model, compile_dir: Path | None, identity: dict | None):
        """What the report says of the compile form, and (``add-form --compile``) what the form is made for."""
        getattr(model, REPORT_ATTR)["compile_form"] = None if compile_dir is None else str(compile_dir)
        if identity is not None:
            setattr(model, COMPILE_IDENTITY_ATTR, identity)
        return model

    def _load_from_base(
        self, vllm_config, model_config, prefix, root, generation, options, signing_key, encryption_key, clock, why,
        fingerprint,
    ):  # fmt: skip
        """No form set of the generation fits this engine (``why``): every layer from its base (``load.from_base``).
        With ``add_form``, vLLM's steps are observed as a save's are, for this layout's form set."""
        if options.add_form and fingerprint is None:
            raise ConfigurationError(
                f"{root}: this vLLM cannot describe the forms it would make, so add-form cannot run on it ({why})"
            )
        if options.add_form and has_rank(generation, rank_stem(vllm_config), fingerprint.vllm_version):
            raise ConfigurationError(
                f"{root}: {why}; add-form adds a form set at a layout only where this vLLM release made none (one "
                "form set a layout and release): start its engine with the settings that form set was made with"
            )
        captured: list[Capture] = []

        def observe(model: torch.nn.Module, run_steps, filled: dict[str, list[str]]) -> None:
            policy = CapturePolicy(device_type=fingerprint.device_type)
            captured.append(capture_around(model, run_steps, policy, fingerprint))
            captured[-1].base_fills = filled  # this layout's form set stores only what the steps changed

        checked_base = _CheckedBase(root, generation, encryption_key, options)
        base = checked_base.document
        encrypted = base.tensor_file is not None and base.tensor_file.encryption != "none"
        check_generation(generation, encrypted, signing_key, encryption_key, model_config.model)
        target_device = torch.device(
            vllm_config.device_config.device if self.load_config.device is None else self.load_config.device
        )
        with checked_base.open(target_device) as reader:
            clock.lap("check_files")
            with _vllm_compat.default_dtype(model_config.dtype):
                with target_device:
                    model = _vllm_compat.initialize_model(vllm_config, model_config, prefix)
                clock.lap("build_model")
                report = load_from_base(
                    model,
                    base,
                    reader,
                    model_config,
                    target_device,
                    verify_hashes=options.verify_hashes,
                    around_steps=observe if options.add_form else None,
                    not_this_ranks=_vllm_compat.other_ranks_experts(vllm_config, model),
                )
            clock.lap("read_and_post_load")
        summary = {**report, "seconds": clock.laps, "generation": generation.id, "encrypted": encrypted, "why": why}
        for capture in captured:  # this layout's form set, for the worker's add-form to write and commit
            capture.stem = rank_stem(vllm_config)
            setattr(model, LAYOUT_FORM_ATTR, capture)
        setattr(model, REPORT_ATTR, summary)
        setattr(model, GENERATION_ATTR, generation)
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
        return model.eval()

    def _restore_and_replay(
        self, vllm_config, model_config, prefix, manifest, fingerprint, readers, target_device, options, clock, base
    ):
        """Build the model, choose each layer's form and check the model against them, then read, restore and
        replay; returns the model and its report. ``readers``: the tensor files (``validate.CheckedFiles``);
        ``base``: the generation's base (``_CheckedBase``, None without one), where the layers the form set leaves
        to it are fed from, first (``from_base.feed_layers``)."""
        with _vllm_compat.default_dtype(model_config.dtype):
            with target_device:
                model = _vllm_compat.initialize_model(vllm_config, model_config, prefix)
            clock.lap("build_model")
            loaded = manifest
            forms = choose_forms(manifest, model, fingerprint, readers.usable)
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
                model_config,
                target_device,
                overlap_raw_steps=overlap["raw_steps"],
                overlap_restorers=overlap["restorers"],
            )
            on_layer = replayer.layer_ready
            recorder = None
            if options.add_form:
                fallen = {f.path for f in forms.fallbacks}
                recorder = FallbackRecorder(model, fallen, fingerprint.device_type)

                def on_layer(record, module, check_hashes):  # the layer as loaded, then vLLM's step (or not yet)
                    recorder.layer_ready(record.path, module)
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
                        not_this_ranks=_vllm_compat.other_ranks_experts(vllm_config, model),
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
            if recorder is not None:
                # with the manifest it was made from: add-form commits only over that one (write_added_form)
                setattr(model, ADDED_FORM_ATTR, (*recorder.finish(fingerprint, rank_stem(vllm_config)), loaded))
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


class _CheckedBase:
    """A generation's base, read only when a load needs it: its document checked against the generation
    (``checkpoint.load_base``), its tensor file checked and opened (``open``)."""

    def __init__(self, root, generation: Generation, encryption_key, options: LoadOptions):
        self._root, self._generation = root, generation
        self._encryption_key = encryption_key
        self._num_readers = options.num_readers
        self._source_dir = options.base_source_dir
        self._found: tuple | None = None

    @property
    def document(self) -> BaseDocument:
        if self._found is None:
            self._found = load_base(self._root, self._generation, self._source_dir)
        return self._found[0]

    def open(self, device: torch.device):
        document = self.document
        return open_checked_base(
            document,
            self._found[1],
            self._found[2],
            encryption_key=self._encryption_key,
            device=str(device),
            num_readers=self._num_readers,
        )


def _why_not_its_forms(root, generation, stem, fingerprint, undescribed, options, vllm_config) -> str | None:
    """Why this engine loads ``generation`` from its base rather than a form set (None: it takes its forms): no form
    set at its layout, a vLLM that cannot use forms, a form set another vLLM release made (the base is the one part
    of a checkpoint that no release's private names or parameter shapes decide), or one made with other engine
    settings."""
    if options.source == "base":
        return "the load options ask for the base (source='base')"
    form_set = form_set_of(generation, stem, None if fingerprint is None else fingerprint.vllm_version)
    if form_set is None:
        parallel = vllm_config.parallel_config
        layouts = ", ".join(f"tp={s.layout.tp} pp={s.layout.pp}" for s in generation.form_sets) or "none"
        return (
            f"generation {generation.id} has form sets at {layouts}, none at this engine's "
            f"tensor_parallel_size={parallel.tensor_parallel_size}, "
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}"
        )
    if fingerprint is None:
        return f"this vLLM cannot use generation {generation.id}'s forms ({undescribed})"
    if form_set.fingerprint.vllm_version != fingerprint.vllm_version:  # its fallbacks too are in that release's names
        made_by = sorted({s.fingerprint.vllm_version for s in generation.form_sets if s.layout == form_set.layout})
        return (
            f"its form sets at this layout were made by vLLM {', '.join(made_by)} (this engine: "
            f"{fingerprint.vllm_version}; `tensorizer-manifest add-form` on this release adds its own)"
        )
    manifest, manifest_path = load_manifest(root, stem, remote=options.remote(), generation=generation,
                                            follow_pointer=False, vllm_version=fingerprint.vllm_version)  # fmt: skip
    try:
        check_compatible(manifest.fingerprint, fingerprint, manifest, str(manifest_path))
        refuse_unrecorded_settings(vllm_config, manifest, str(manifest_path))
    except CompatibilityError as exc:
        return f"its form set at this layout was made with other engine settings ({exc})"
    return None


class CaptureModelLoader(_vllm_compat.DefaultModelLoader):
    """vLLM's default loader, with the post-load step observed so the engine can save itself."""

    def __init__(self, load_config):
        self.options = CaptureOptions.from_load_config(load_config)
        self.observer: SourceObserver | None = None
        # The default loader picks weight files by load format; read them as "auto" does.
        super().__init__(_vllm_compat.replace_config(load_config, load_format="auto", model_loader_extra_config={}))

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
