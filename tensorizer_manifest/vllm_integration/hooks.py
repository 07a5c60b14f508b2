"""What vLLM calls into: ``ManifestModelLoader`` and ``CaptureModelLoader`` (the two load formats), their option
models, ``ManifestWorkerExtension`` (the save of a running engine) and ``register`` (the plugin hook). The
folder's ``__init__`` says what each is for and re-exports them under the names vLLM is given.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from .. import _failpoints, _vllm_compat
from .._constants import CAPTURE_LOAD_FORMAT, CPU_GEMM_ENV, LOAD_FORMAT, SPILL_DIR_ENV
from ..checks.fingerprint import check_compatible, engine_fingerprint
from ..checks.generation_files import check_generation
from ..checks.seal import unsealed_warning
from ..checks.validate import open_checked_forms
from ..errors import ConfigurationError, NoManifestError, TensorizerManifestError, UnsupportedModelError
from ..format.generation import Generation, Layout, decode_pointer, encode_pointer
from ..format.schema import MANIFEST_SUFFIX
from ..load import replay
from ..load.forms import choose_forms
from ..load.restore import check_model, restore_tensors
from ..progress import terminal_progress
from ..save import publish
from ..save.capture import Capture, CapturePolicy, FallbackRecorder, Recorder
from ..save.write import copy_model_files, prepare_checkpoint, write_added_form, write_checkpoint
from ..storage.checkpoint import (
    check_named_tensor_file,
    check_one_save,
    checkpoint_location,
    checkpoint_root,
    checkpoint_stem,
    encryption_key_from,
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
from ..storage.remote import CREDENTIAL_OPTIONS, RemoteDir

_CAPTURE_ATTR = "_tensorizer_manifest_capture"
_REPORT_ATTR = "_tensorizer_manifest_report"
_ADDED_FORM_ATTR = "_tensorizer_manifest_added_form"
_GENERATION_ATTR = "_tensorizer_manifest_generation"

#: Under vLLM's own logger, so that its handler and level apply: `vllm serve` shows the load line.
logger = logging.getLogger("vllm.tensorizer_manifest")


def _log_load(manifest_path: Path, summary: dict) -> None:
    laps = summary["seconds"]
    raw = len({step.rpartition(":")[0] for step in summary["post_load"]})
    logger.info(
        "Loading weights with tensorizer_manifest took %.2f s (%s): %.1f MB read by %d readers, content hashes %s; "
        "%d raw layer(s) got vLLM's post-load step (%.2f s of it while reading), %d processed layer(s) restored; "
        "checks %.3f s, model built %.2f s, read %.2f s, rest of replay and audit %.2f s",
        sum(laps.values()),
        manifest_path,
        summary["bytes_read"] / 1e6,
        summary["num_readers"],
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
    add_form: bool = Field(
        False,
        description="Observe vLLM's step on the layers loaded through their raw fallback, so that the worker "
        "method add_tensorizer_manifest_form can add this engine's processed form of them (`add-form`).",
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

    @classmethod
    def from_load_config(cls, load_config: Any) -> CaptureOptions:
        raw = dict(getattr(load_config, "model_loader_extra_config", None) or {})
        try:
            return cls(**raw)
        except ValidationError as exc:
            raise ConfigurationError(
                f"invalid model_loader_extra_config for {CAPTURE_LOAD_FORMAT}: {describe_validation_error(exc)}"
            ) from None


def _first_rank() -> bool:
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
_NO_POINTER, _NO_READ = b"-", b"!"


def agreed_generation(checkpoint: str, options: LoadOptions) -> tuple[Path | RemoteDir, Generation] | None:
    """The checkpoint and the generation every rank of this engine reads: the first rank reads the pointer and
    broadcasts it (``_vllm_compat.first_rank_bytes``), so a save committed while the ranks start is read by all or
    by none; a generation's own folder given as the checkpoint is that generation, for every rank alike. None: the
    checkpoint has no pointer (format version 1 or 2). Every rank must call it."""
    root = checkpoint_root(checkpoint, options.remote())
    pinned = None if root is None else pinned_generation(root)
    if pinned is not None:
        return pinned
    payload, failure = _NO_POINTER, None
    if _first_rank() and root is not None:
        try:
            pointer = read_pointer(root)
            payload = _NO_POINTER if pointer is None else encode_pointer(pointer, compact=True)
        except TensorizerManifestError as exc:
            payload, failure = _NO_READ, exc
    agreed = _vllm_compat.first_rank_bytes(payload, _POINTER_BYTES).rstrip(b"\0")
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


class ManifestModelLoader(BaseModelLoader):
    """Loads a tensorizer-manifest checkpoint: validate, restore, replay."""

    def download_model(self, model_config) -> None:  # tensors are streamed from checkpoint_dir at load
        return None

    def load_weights(self, model, model_config) -> None:
        raise UnsupportedModelError(f"{LOAD_FORMAT} loads whole models; in-place weight reloading is not supported")

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        clock = _Clock()
        options = LoadOptions.from_load_config(self.load_config)
        fingerprint = engine_fingerprint(vllm_config)  # first: a vLLM it cannot describe is refused before any read
        checkpoint, named_file = options.checkpoint_location(model_config.model)
        signing_key = signing_key_from(options.signing_key_file)
        encryption_key = encryption_key_from(options.encryption_key_file)
        stem = rank_stem(vllm_config)
        agreed = agreed_generation(checkpoint, options)  # every rank, before anything can fail on one alone
        root, generation = agreed if agreed is not None else (checkpoint, None)
        _failpoints.pause("after-agreement", stem)
        try:
            manifest, manifest_path = load_manifest(
                root, stem, remote=options.remote(), generation=generation, follow_pointer=False
            )
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
            check_generation(generation, manifest, signing_key, encryption_key, model_config.model)
        device_config = vllm_config.device_config
        load_device = device_config.device if self.load_config.device is None else self.load_config.device
        target_device = torch.device(load_device)
        with open_checked_forms(
            manifest,
            manifest_path,
            signing_key,
            encryption_key,
            device=str(target_device),
            num_readers=options.num_readers,
        ) as readers:
            unsealed = unsealed_warning(manifest) if signing_key is None and encryption_key is None else None
            if unsealed:
                logger.warning("%s: %s", manifest_path, unsealed)
            check_compatible(manifest.fingerprint, fingerprint, manifest, str(manifest_path))
            clock.lap("check_files")
            model, summary = self._restore_and_replay(
                vllm_config, model_config, prefix, manifest, fingerprint, readers, target_device, options, clock
            )
        summary["encrypted"] = encryption_key is not None
        summary["generation"] = None if generation is None else generation.id
        setattr(model, _REPORT_ATTR, summary)
        setattr(model, _GENERATION_ATTR, generation)
        _log_load(manifest_path, summary)
        return model.eval()

    def _restore_and_replay(
        self, vllm_config, model_config, prefix, manifest, fingerprint, readers, target_device, options, clock
    ):
        """Build the model, choose each layer's form and check the model against them, then read, restore and
        replay; returns the model and its report. ``readers``: the tensor files (``validate.CheckedFiles``)."""
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
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

            sources = {path: readers.form(index) for path, index in forms.added.items()}
            with terminal_progress("loading", enabled=options.progress and _first_rank()) as progress:
                nbytes = restore_tensors(
                    model,
                    manifest,
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
                setattr(model, _ADDED_FORM_ATTR, (*recorder.finish(fingerprint, rank_stem(vllm_config)), loaded))
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
        }


class CaptureModelLoader(DefaultModelLoader):
    """vLLM's default loader, with the post-load step observed so the engine can save itself."""

    def __init__(self, load_config):
        from vllm.config import replace

        self.options = CaptureOptions.from_load_config(load_config)
        # The default loader picks weight files by load format; read them as "auto" does.
        super().__init__(replace(load_config, load_format="auto", model_loader_extra_config={}))

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        fingerprint = engine_fingerprint(vllm_config)
        captured: list[Capture] = []

        def observe(model: torch.nn.Module, run_step) -> None:
            policy = CapturePolicy(
                portable=self.options.portable,
                allow_unverified=self.options.allow_unverified,
                device_type=fingerprint.device_type,
                fallbacks=self.options.fallbacks,
            )
            # pre-step copies go to a nameless file in $TENSORIZER_MANIFEST_SPILL_DIR
            recorder = Recorder(model, policy=policy)
            try:
                run_step()
            except BaseException:
                recorder.close()
                raise
            captured.append(recorder.finish(fingerprint))

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
        setattr(model, _CAPTURE_ATTR, capture)
        return model


def apply_cpu_gemm_from_env() -> None:
    """``TENSORIZER_MANIFEST_CPU_GEMM=fallback``: vLLM's torch CPU GEMM in this process (workers too)."""
    if os.environ.get(CPU_GEMM_ENV, "").lower() == "fallback":
        _vllm_compat.disable_onednn()


def register() -> None:
    """``vllm.general_plugins`` entry point: register both load formats in this process.

    It also keeps every log record of the process from showing S3 credentials given in
    ``model_loader_extra_config`` (vLLM logs its engine arguments, that dict included, after loading plugins;
    the redaction is in the log record factory, so no logger or handler escapes it), and records each layer's
    attributes before vLLM's post-load step in any engine (a few dicts), so that one the default loader loaded
    can save itself.
    """
    _vllm_compat.redact_logged_options(CREDENTIAL_OPTIONS)
    apply_cpu_gemm_from_env()
    _vllm_compat.register_model_loader_once(LOAD_FORMAT, ManifestModelLoader)
    _vllm_compat.register_model_loader_once(CAPTURE_LOAD_FORMAT, CaptureModelLoader)
    from ..save.rebuild import remember_pre_step_attributes

    _vllm_compat.before_every_post_load_step(remember_pre_step_attributes)  # so any engine can save itself


def _save_summary(manifest: Any, output_dir: str, stem: str) -> dict:
    """What ``save_tensorizer_manifest`` returns for a rank."""
    return {
        "manifest": str(Path(output_dir) / (stem + MANIFEST_SUFFIX)),
        "tensor_file": manifest.tensor_file.path,
        "bytes": manifest.tensor_file.size,
        "layers": len(manifest.modules),
        "raw_layers": sum(1 for m in manifest.modules if m.state == "raw"),
        "fallback_layers": sum(1 for m in manifest.modules if m.fallback),
        "fallback_bytes": sum(t.nbytes for m in manifest.modules for t in m.fallback),
        "seal": manifest.seal.mode if manifest.seal is not None else None,
        "encryption": manifest.tensor_file.encryption,
    }


class ManifestWorkerExtension:
    """Worker methods, reached with ``llm.collective_rpc(name, args=...)``."""

    def _tm_model(self) -> torch.nn.Module:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def save_tensorizer_manifest(
        self,
        output_dir: str,
        keep_capture: bool = False,
        signing_key_file: str | None = None,
        encryption_key_file: str | None = None,
        progress: bool = False,
        portable: bool = False,
        allow_unverified: bool = False,
        fallbacks: bool = True,
        format_version: int = 2,
    ) -> dict:
        """Write this rank's tensor file and manifest into ``output_dir``.

        ``format_version=3``: as a new generation of the checkpoint (``save.publish``): every rank writes into
        the generation's folder, and the first rank commits the pointer once for all (``docs/design.md``).

        An engine vLLM's default loader loaded (no ``tensorizer_manifest_capture``) is saved too: each
        layer's state before vLLM's post-load step is rebuilt from the engine's source weights, one layer at a
        time (``rebuild``), and must give back the engine's live tensors bit for bit, else nothing is written
        (``rebuild.NotReproducibleError``). ``portable``, ``allow_unverified`` and ``fallbacks`` are then the
        save options (a capture-loaded engine took them in ``model_loader_extra_config``).

        The capture holds a copy of every raw layer's pre-processing tensors (in a
        nameless temporary file, not in memory); it is released after the save (so
        an engine that goes on serving gets that disk space back) unless
        ``keep_capture`` asks to save again later.
        The manifest is sealed with the key in ``signing_key_file`` (else
        ``$TENSORIZER_MANIFEST_SIGNING_KEY``; a path travels to the workers, never the key).
        The tensor data is encrypted with the key in ``encryption_key_file`` (else
        ``$TENSORIZER_MANIFEST_ENCRYPTION_KEY``). ``progress`` draws a bar of the
        write on stderr (rank 0, on a terminal).

        A sharded engine's ranks commit together or not at all: they agree on one save id first
        (``Manifest.save_id``), each writes its tensor file and seals its manifest, and all vote before any
        commits; a rank that failed votes no, and every rank's checkpoint stays as it was. A rank that fails in
        its own commit, after the vote, leaves ranks of two saves, which every loader refuses (the save id).
        """
        if format_version not in (2, 3):
            raise ConfigurationError(f"format_version must be 2 or 3, not {format_version!r}")
        if format_version == 3:
            return self._tm_publish(
                output_dir, keep_capture, signing_key_file, encryption_key_file, progress, portable, allow_unverified,
                fallbacks,
            )  # fmt: skip
        save_id = _vllm_compat.shared_save_id()  # first: every rank is here, none has failed yet
        model = self._tm_model()
        capture = getattr(model, _CAPTURE_ATTR, None)
        prepared = None
        try:
            try:
                signing_key = signing_key_from(signing_key_file)
                encryption_key = encryption_key_from(encryption_key_file)
                if capture is None:  # loaded by vLLM's default loader: its pre-step state is rebuilt from its source
                    capture = self._tm_rebuilt_capture(model, portable, allow_unverified, fallbacks, output_dir)
                    keep_capture = False
                with terminal_progress("saving", enabled=progress and _first_rank()) as on_progress:
                    prepared = prepare_checkpoint(
                        capture,
                        Path(output_dir),
                        capture.stem,
                        signing_key,
                        release=not keep_capture,
                        encryption_key=encryption_key,
                        progress=on_progress,
                        save_id=save_id,
                    )
            finally:
                # Every rank votes, a failed one too (its error goes on up): none commits unless all wrote their part.
                if save_id is not None and not _vllm_compat.every_rank_succeeded(prepared is not None):
                    if prepared is not None:
                        prepared.abandon()
                        raise TensorizerManifestError(
                            f"{output_dir}: another rank of this engine failed to write its part of the save (its "
                            f"error is raised beside this one); {capture.stem} committed nothing either, and the "
                            "checkpoint is as it was"
                        )
            manifest = prepared.commit()
            source = Path(str(self.vllm_config.model_config.model))
            if _first_rank() and source.is_dir():  # so that vLLM's `model` can be the checkpoint itself
                copy_model_files(source, Path(output_dir))
        finally:
            if capture is not None and not keep_capture:
                if getattr(model, _CAPTURE_ATTR, None) is capture:
                    delattr(model, _CAPTURE_ATTR)
                capture.close()
        return _save_summary(manifest, output_dir, capture.stem)

    def _tm_publish(
        self, output_dir, keep_capture, signing_key_file, encryption_key_file, progress, portable, allow_unverified,
        fallbacks,
    ) -> dict:  # fmt: skip
        """``save_tensorizer_manifest`` as a generation: each rank writes its files into the new generation's folder,
        all vote, and only if every rank succeeded does the first rank commit the pointer (all ranks or none); a
        second vote tells every rank whether that commit happened."""
        generation_id = _vllm_compat.shared_generation_id()  # first: every rank is here, none has failed yet
        model = self._tm_model()
        capture = getattr(model, _CAPTURE_ATTR, None)
        written = None
        committed = None
        try:
            try:
                signing_key = signing_key_from(signing_key_file)
                encryption_key = encryption_key_from(encryption_key_file)
                publication = publish.begin(Path(output_dir), generation_id)
                if capture is None:  # loaded by vLLM's default loader: its pre-step state is rebuilt from its source
                    capture = self._tm_rebuilt_capture(model, portable, allow_unverified, fallbacks, output_dir)
                    keep_capture = False
                with terminal_progress("saving", enabled=progress and _first_rank()) as on_progress:
                    written = write_checkpoint(
                        capture,
                        publication.folder,
                        capture.stem,
                        signing_key,
                        release=not keep_capture,
                        encryption_key=encryption_key,
                        progress=on_progress,
                        save_id=generation_id.rpartition("-")[2] if _vllm_compat.shared_save_id_needed() else None,
                    )
            finally:
                all_written = _vllm_compat.every_rank_succeeded(written is not None)  # every rank votes
            if not all_written:
                raise TensorizerManifestError(
                    f"{output_dir}: another rank of this engine failed to write its part of the save (its error is "
                    "raised beside this one); nothing was committed, and the checkpoint is as it was"
                )
            try:
                if _first_rank():
                    parallel = self.vllm_config.parallel_config
                    layout = Layout(tp=parallel.tensor_parallel_size, pp=parallel.pipeline_parallel_size)
                    ranks = [publish.rank_entry(publication, stem) for stem in publish.layout_stems(layout)]
                    source = Path(str(self.vllm_config.model_config.model))
                    committed = publish.commit(
                        publication,
                        made_by="save",
                        form_sets=[publish.form_set(layout, capture.fingerprint, ranks)],
                        model_files=publish.copy_model_files(publication, source),
                        signing_key=signing_key,
                        encryption_key=encryption_key,
                    )
            finally:
                first_committed = _vllm_compat.every_rank_succeeded(committed is not None or not _first_rank())
            if not first_committed and not _first_rank():
                raise TensorizerManifestError(
                    f"{output_dir}: the first rank of this engine could not commit the save (its error is raised "
                    "there); nothing was committed, and the checkpoint is as it was"
                )
        finally:
            if capture is not None and not keep_capture:
                if getattr(model, _CAPTURE_ATTR, None) is capture:
                    delattr(model, _CAPTURE_ATTR)
                capture.close()
        return {
            **_save_summary(written, output_dir, capture.stem),
            "generation": generation_id,
            "manifest": str(publication.folder / (capture.stem + MANIFEST_SUFFIX)),
        }

    def _tm_rebuilt_capture(
        self, model, portable: bool, allow_unverified: bool, fallbacks: bool, output_dir: str
    ) -> Capture:
        from ..save.rebuild import capture_running_engine

        vllm_config = self.vllm_config
        fingerprint = engine_fingerprint(vllm_config)
        policy = CapturePolicy(
            portable=portable,
            allow_unverified=allow_unverified,
            device_type=fingerprint.device_type,
            fallbacks=fallbacks,
        )
        Path(output_dir).mkdir(parents=True, exist_ok=True)  # its pre-step copies go there (SPILL_DIR_ENV wins)
        spill = os.environ.get(SPILL_DIR_ENV) or output_dir
        capture = capture_running_engine(model, vllm_config, policy, fingerprint, spill)
        capture.stem = rank_stem(vllm_config)
        return capture

    def add_tensorizer_manifest_form(
        self, checkpoint_dir: str, signing_key_file: str | None = None, encryption_key_file: str | None = None
    ) -> dict:
        """Add this engine's processed form of the layers it loaded through their raw fallback to this rank's
        manifest in ``checkpoint_dir`` (the engine must have loaded it with ``add_form`` in
        ``model_loader_extra_config``). Nothing is written when no layer fell back, or none a verified
        restorer covers here."""
        signing_key = signing_key_from(signing_key_file)
        encryption_key = encryption_key_from(encryption_key_file)
        model = self._tm_model()
        observed = getattr(model, _ADDED_FORM_ATTR, None)
        if observed is None:
            raise TensorizerManifestError(
                f"this engine did not load with load_format={LOAD_FORMAT!r} and add_form in "
                "model_loader_extra_config, so vLLM's step on the fallback layers was not observed"
            )
        capture, not_added, loaded = observed
        result = {"added": [layer.path for layer in capture.layers], "not_added": not_added, "tensor_file": None}
        generation = getattr(model, _GENERATION_ATTR, None)
        if generation is not None:
            published = self._tm_publish_form(checkpoint_dir, generation, capture, loaded, signing_key, encryption_key)
            result.update(published)
        elif capture.layers:
            manifest = write_added_form(
                capture, Path(checkpoint_dir), capture.stem, loaded, signing_key, encryption_key
            )
            result["tensor_file"] = manifest.added_forms[-1].tensor_file.path
            result["bytes"] = manifest.added_forms[-1].tensor_file.size
        delattr(model, _ADDED_FORM_ATTR)
        return result

    def _tm_publish_form(self, checkpoint_dir, generation, capture, loaded, signing_key, encryption_key) -> dict:
        """``add_tensorizer_manifest_form`` on a checkpoint of format version 3: a new generation over the one this
        engine loaded, in which the ranks that added a form have a new manifest (naming the save's tensor files
        where the save keeps them) and the others keep theirs; committed once by the first rank, only if the
        generation loaded is still the current one (``ConcurrentWriteError`` otherwise)."""
        generation_id = _vllm_compat.shared_generation_id()
        publication = publish.begin(Path(checkpoint_dir), generation_id, parent=generation.id, read_parent=False)
        written = None
        try:
            if capture.layers:
                written = write_added_form(
                    capture, Path(checkpoint_dir), capture.stem, loaded, signing_key, encryption_key,
                    into=publication.folder,
                )  # fmt: skip
        finally:
            all_written = _vllm_compat.every_rank_succeeded(written is not None or not capture.layers)
        if not all_written:
            raise TensorizerManifestError(
                f"{checkpoint_dir}: another rank failed to write its part of the form (its error is raised beside "
                "this one); nothing was committed"
            )
        nothing_added = _vllm_compat.every_rank_succeeded(not capture.layers)
        result: dict = {"generation": None}
        if written is not None:
            form_file = written.added_forms[-1].tensor_file
            result.update(tensor_file=form_file.path, bytes=form_file.size)
        if nothing_added:
            return result
        committed = None
        try:
            if _first_rank():
                committed = publish.commit(
                    publication,
                    made_by="add-form",
                    form_sets=publish.with_new_manifests(publication, generation),
                    model_files=publish.carry_model_files(publication, generation),
                    signing_key=signing_key,
                    encryption_key=encryption_key,
                )
        finally:
            first_committed = _vllm_compat.every_rank_succeeded(committed is not None or not _first_rank())
        if not first_committed and not _first_rank():
            raise TensorizerManifestError(
                f"{checkpoint_dir}: the first rank of this engine could not commit the form (its error is raised "
                "there); nothing was committed"
            )
        result["generation"] = generation_id
        return result

    def tensorizer_manifest_report(self) -> dict | None:
        """What the manifest loader did in this worker (None when it was not used)."""
        return getattr(self._tm_model(), _REPORT_ATTR, None)

    def tensorizer_manifest_state_hashes(self) -> dict[str, str]:
        """blake3 of every parameter and persistent buffer of this worker's model, by full name.

        Two engines that loaded the same model the same way give equal maps,
        whichever loader each used: how a rank's state is compared when the
        engine's workers are other processes (pipeline parallel).
        """
        from ..model.tensors import hash_tensor

        hashes = {}
        for path, module in self._tm_model().named_modules():
            for name, tensor in module._parameters.items():
                if tensor is not None:
                    hashes[f"{path}.{name}" if path else name] = hash_tensor(tensor.detach().cpu())
            for name, tensor in module._buffers.items():
                if tensor is not None and name not in module._non_persistent_buffers_set:
                    hashes[f"{path}.{name}" if path else name] = hash_tensor(tensor.detach().cpu())
        return hashes
