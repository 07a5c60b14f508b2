"""``ManifestWorkerExtension``: the worker methods of a running engine (``llm.collective_rpc``): its save, the
add-form of the layers it loaded through their fallback, its load report and its state hashes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _vllm_compat
from .._constants import LOAD_FORMAT, SPILL_DIR_ENV
from .._error_relay import relaying
from ..checks.fingerprint import engine_fingerprint, refuse_unrecorded_settings
from ..errors import ConfigurationError, TensorizerManifestError
from ..format.generation import FormSet, Layout
from ..format.schema import MANIFEST_SUFFIX, REPLAY_NONE, REPLAY_POST_LOAD
from ..progress import terminal_progress
from ..save import publish
from ..save.capture import Capture, CapturePolicy
from ..save.write import copy_model_files, prepare_checkpoint, write_added_form, write_checkpoint
from ..save.write_base import source_weights, write_base
from ..storage.checkpoint import encryption_key_from, signing_key_from
from .loaders import (
    ADDED_FORM_ATTR,
    CAPTURE_ATTR,
    COMPILE_IDENTITY_ATTR,
    GENERATION_ATTR,
    LAYOUT_FORM_SET_ATTR,
    REPORT_ATTR,
    first_rank,
    rank_stem,
)


@dataclass
class _Part:
    """This rank's part of a write every rank makes (``_every_rank_writes``), and what undoes it when another rank
    failed to write its own (``undo``: a part already in place under its final name)."""

    undo: Callable[[], None] = lambda: None


@contextmanager
def _every_rank_writes(failed_elsewhere: str) -> Iterator[_Part]:
    """Every rank writes its part (the ``with`` block), then votes, a failed one too (its own error goes on up):
    none goes on unless every rank wrote its part; elsewhere, its part undone, ``failed_elsewhere``."""
    part, written = _Part(), False
    try:
        yield part
        written = True
    finally:
        all_written = _vllm_compat.every_rank_succeeded(written)
    if not all_written:
        part.undo()
        raise TensorizerManifestError(failed_elsewhere)


def _first_rank_commits(commit: Callable[[], object], failed_elsewhere: str) -> None:
    """The first rank runs ``commit`` (a generation's one pointer swap); then every rank votes, so that the others
    learn whether it happened: there, its own error goes on up; elsewhere, ``failed_elsewhere``."""
    committed = False
    try:
        if first_rank():
            commit()
            committed = True
    finally:
        first_committed = _vllm_compat.every_rank_succeeded(committed or not first_rank())
    if not first_committed and not first_rank():
        raise TensorizerManifestError(failed_elsewhere)


def _generation_save_id(generation_id: str) -> str | None:
    """The save id (``Manifest.save_id``) the manifests of a generation's ranks carry: the random part of its id,
    when the engine has more than one rank."""
    return generation_id.rpartition("-")[2] if _vllm_compat.shared_save_id_needed() else None


def _release(model: torch.nn.Module, capture: Capture) -> None:
    """A save's capture, done with: off the model, and its pre-step copies' disk space given back."""
    if getattr(model, CAPTURE_ATTR, None) is capture:
        delattr(model, CAPTURE_ATTR)
    capture.close()


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
    """Worker methods, reached with ``llm.collective_rpc(name, args=...)``. Those that write hand their typed errors
    to the process that called them (``relaying``): vLLM passes only their text.

    Every write is the same three steps on every rank: the ids it needs drawn first, by the first rank for all
    (while every rank is there and none has failed); each rank's part written, then a vote (``_every_rank_writes``);
    then the commit: each rank its own manifest (format version 2), or the first rank the generation's pointer once
    for all, and a second vote telling the others whether it did (``_first_rank_commits``)."""

    #: vLLM's worker, which this class extends (``worker_extension_cls``), sets it.
    vllm_config: Any

    def _tm_model(self) -> torch.nn.Module:
        return _vllm_compat.worker_model(self)

    @relaying
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
        format_version: int = 3,
        base_reference: bool = False,
    ) -> dict:
        """Write this rank's tensor file and manifest into ``output_dir``.

        ``format_version=3`` (the default): as a new generation of the checkpoint (``save.publish``): every rank
        writes into the generation's folder, and the first rank commits the pointer once for all
        (``docs/design.md``). ``format_version=2``: one manifest per rank, for readers older than 0.5.
        ``base_reference``: an engine that observed its source for a base (``model_loader_extra_config``'s
        ``base``) names the source's safetensors files in it instead of copying them (``save --base reference``).

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
            return self._tm_save_generation(
                output_dir, keep_capture, signing_key_file, encryption_key_file, progress, portable, allow_unverified,
                fallbacks, base_reference,
            )  # fmt: skip
        save_id = _vllm_compat.shared_save_id()  # first: every rank is here, none has failed yet
        model = self._tm_model()
        capture = getattr(model, CAPTURE_ATTR, None)
        try:
            stem = rank_stem(self.vllm_config)  # the capture's, loaded or rebuilt
            with _every_rank_writes(
                f"{output_dir}: another rank of this engine failed to write its part of the save (its error is "
                f"raised beside this one); {stem} committed nothing either, and the checkpoint is as it was"
            ) as part:
                signing_key = signing_key_from(signing_key_file)
                encryption_key = encryption_key_from(encryption_key_file)
                if capture is None:  # loaded by vLLM's default loader: its pre-step state is rebuilt from its source
                    capture = self._tm_rebuilt_capture(model, portable, allow_unverified, fallbacks, output_dir)
                    keep_capture = False
                with terminal_progress("saving", enabled=progress and first_rank()) as on_progress:
                    prepared = prepare_checkpoint(
                        capture,
                        Path(output_dir),
                        capture.stem,
                        signing_key=signing_key,
                        release=not keep_capture,
                        encryption_key=encryption_key,
                        progress=on_progress,
                        save_id=save_id,
                    )
                part.undo = prepared.abandon
            manifest = prepared.commit()
            source = Path(str(self.vllm_config.model_config.model))
            if first_rank() and source.is_dir():  # so that vLLM's `model` can be the checkpoint itself
                copy_model_files(source, Path(output_dir))
        finally:
            if capture is not None and not keep_capture:
                _release(model, capture)
        assert capture is not None  # found or rebuilt above, or the save raised
        return _save_summary(manifest, output_dir, capture.stem)

    def _tm_save_generation(
        self, output_dir, keep_capture, signing_key_file, encryption_key_file, progress, portable, allow_unverified,
        fallbacks, base_reference=False,
    ) -> dict:  # fmt: skip
        """``save_tensorizer_manifest`` as a generation: each rank writes its files into the new generation's folder,
        all vote, and only if every rank succeeded does the first rank commit the pointer (all ranks or none); a
        second vote tells every rank whether that commit happened."""
        generation_id = _vllm_compat.shared_generation_id()  # first: every rank is here, none has failed yet
        model = self._tm_model()
        capture = getattr(model, CAPTURE_ATTR, None)
        base = None
        try:
            with _every_rank_writes(
                f"{output_dir}: another rank of this engine failed to write its part of the save (its error is "
                "raised beside this one); nothing was committed, and the checkpoint is as it was"
            ):
                signing_key = signing_key_from(signing_key_file)
                encryption_key = encryption_key_from(encryption_key_file)
                publication = publish.begin(Path(output_dir), generation_id)
                if capture is None:  # loaded by vLLM's default loader: its pre-step state is rebuilt from its source
                    capture = self._tm_rebuilt_capture(model, portable, allow_unverified, fallbacks, output_dir)
                    keep_capture = False
                with terminal_progress("saving", enabled=progress and first_rank()) as on_progress:
                    written = write_checkpoint(
                        capture,
                        publication.folder,
                        capture.stem,
                        signing_key=signing_key,
                        release=not keep_capture,
                        encryption_key=encryption_key,
                        progress=on_progress,
                        save_id=_generation_save_id(generation_id),
                        beside_a_base=capture.base_fills is not None,  # every rank observed its fills for the base
                    )
                if capture.source is not None and first_rank():  # the base: the source, read again and checked
                    with terminal_progress("saving the base", enabled=progress) as on_progress:
                        base = write_base(
                            capture.source,
                            source_weights(self.vllm_config, model),
                            publication.folder,
                            encryption_key=encryption_key,
                            progress=on_progress,
                            source_dir=Path(str(self.vllm_config.model_config.model)) if base_reference else None,
                        )
            _first_rank_commits(
                lambda: publish.commit(
                    publication,
                    made_by="save",
                    form_sets=[self._tm_layout_form_set(publication, capture)],
                    model_files=publish.copy_model_files(publication, Path(str(self.vllm_config.model_config.model))),
                    base=None if base is None else publish.base_entry(publication, *base),
                    signing_key=signing_key,
                    encryption_key=encryption_key,
                ),
                f"{output_dir}: the first rank of this engine could not commit the save (its error is raised there); "
                "nothing was committed, and the checkpoint is as it was",
            )
        finally:
            if capture is not None and not keep_capture:
                _release(model, capture)
        return {
            **_save_summary(written, output_dir, capture.stem),
            "generation": generation_id,
            "manifest": str(publication.folder / (capture.stem + MANIFEST_SUFFIX)),
            "base": None if base is None else _base_summary(base[1]),
        }

    def _tm_layout_form_set(self, publication: publish.Publication, capture: Capture) -> FormSet:
        """This engine's layout as a form set: every rank's manifest in the publication's folder, by its bytes."""
        parallel = self.vllm_config.parallel_config
        layout = Layout(tp=parallel.tensor_parallel_size, pp=parallel.pipeline_parallel_size)
        return publish.layout_form_set(publication, layout, capture.fingerprint)

    def _tm_add_layout_form_set(self, checkpoint_dir, model, capture, signing_key, encryption_key) -> dict:
        """``add_tensorizer_manifest_form`` by an engine that loaded from the base (no form set at its layout): what
        vLLM's steps made here becomes this layout's form set, in a new generation over the one it loaded, which
        keeps that one's form sets, model files and base; every rank writes its manifest, all vote, the first rank
        commits once, only while the loaded generation is still the current one (``ConcurrentWriteError``)."""
        generation = getattr(model, GENERATION_ATTR)
        generation_id = _vllm_compat.shared_generation_id()
        try:
            with _every_rank_writes(
                f"{checkpoint_dir}: another rank failed to write its part of this layout's form set (its error is "
                "raised beside this one); nothing was committed"
            ):
                publication = publish.begin(Path(checkpoint_dir), generation_id, parent=generation.id,
                                            read_parent=False)  # fmt: skip
                written = write_checkpoint(
                    capture,
                    publication.folder,
                    capture.stem,
                    signing_key=signing_key,
                    encryption_key=encryption_key,
                    save_id=_generation_save_id(generation_id),
                    beside_a_base=True,  # loaded from the generation's base, which the new generation keeps
                )
            _first_rank_commits(
                lambda: publish.commit_over(
                    publication,
                    generation,
                    made_by="add-form",
                    form_sets=[*generation.form_sets, self._tm_layout_form_set(publication, capture)],
                    signing_key=signing_key,
                    encryption_key=encryption_key,
                ),
                f"{checkpoint_dir}: the first rank could not commit this layout's form set (its error is raised "
                "there); nothing was committed",
            )
        finally:
            capture.close()
            delattr(model, LAYOUT_FORM_SET_ATTR)
        fingerprint = capture.fingerprint
        return {
            "added": [layer.path for layer in capture.layers if layer.replay not in (REPLAY_NONE, REPLAY_POST_LOAD)],
            "not_added": {layer.path: layer.reason for layer in capture.layers if layer.state == "raw"},
            "tensor_file": written.tensor_file.path,
            "bytes": written.tensor_file.size,
            "generation": generation_id,
            "layout": {"tp": fingerprint.tensor_parallel_size, "pp": fingerprint.pipeline_parallel_size},
        }

    def _tm_rebuilt_capture(
        self, model, portable: bool, allow_unverified: bool, fallbacks: bool, output_dir: str
    ) -> Capture:
        from ..save.rebuild import capture_running_engine

        vllm_config = self.vllm_config
        fingerprint = engine_fingerprint(vllm_config)
        refuse_unrecorded_settings(vllm_config, None, output_dir)
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

    @relaying
    def add_tensorizer_manifest_form(
        self, checkpoint_dir: str, signing_key_file: str | None = None, encryption_key_file: str | None = None
    ) -> dict:
        """Add this engine's processed form of the layers it loaded through their raw fallback to this rank's
        manifest in ``checkpoint_dir`` (the engine must have loaded it with ``add_form`` in
        ``model_loader_extra_config``). An engine that loaded the checkpoint from its base (a layout no form set
        has) adds this layout's whole form set instead (``_tm_add_layout_form_set``). Nothing is written when no
        layer fell back, or none a verified restorer covers here."""
        signing_key = signing_key_from(signing_key_file)
        encryption_key = encryption_key_from(encryption_key_file)
        model = self._tm_model()
        layout_form = getattr(model, LAYOUT_FORM_SET_ATTR, None)
        if layout_form is not None:  # loaded from the base: this whole layout's form set
            return self._tm_add_layout_form_set(checkpoint_dir, model, layout_form, signing_key, encryption_key)
        observed = getattr(model, ADDED_FORM_ATTR, None)
        if observed is None:
            raise TensorizerManifestError(
                f"this engine did not load with load_format={LOAD_FORMAT!r} and add_form in "
                "model_loader_extra_config, so vLLM's step on the fallback layers was not observed"
            )
        capture, not_added, loaded = observed
        result = {"added": [layer.path for layer in capture.layers], "not_added": not_added, "tensor_file": None}
        generation = getattr(model, GENERATION_ATTR, None)
        if generation is not None:
            result.update(
                self._tm_add_form_to_generations(checkpoint_dir, generation, capture, loaded, signing_key,
                                                 encryption_key)
            )  # fmt: skip
        elif capture.layers:
            manifest = write_added_form(
                capture,
                Path(checkpoint_dir),
                capture.stem,
                loaded,
                signing_key=signing_key,
                encryption_key=encryption_key,
            )
            result["tensor_file"] = manifest.added_forms[-1].tensor_file.path
            result["bytes"] = manifest.added_forms[-1].tensor_file.size
        delattr(model, ADDED_FORM_ATTR)
        return result

    def _tm_add_form_to_generations(
        self, checkpoint_dir, generation, capture, loaded, signing_key, encryption_key
    ) -> dict:
        """``add_tensorizer_manifest_form`` on a checkpoint of format version 3: a new generation over the one this
        engine loaded, in which the ranks that added a form have a new manifest (naming the save's tensor files
        where the save keeps them) and the others keep theirs; committed once by the first rank, only if the
        generation loaded is still the current one (``ConcurrentWriteError`` otherwise), and only if some rank
        added a form."""
        generation_id = _vllm_compat.shared_generation_id()
        written = None
        with _every_rank_writes(
            f"{checkpoint_dir}: another rank failed to write its part of the form (its error is raised beside this "
            "one); nothing was committed"
        ):
            publication = publish.begin(Path(checkpoint_dir), generation_id, parent=generation.id, read_parent=False)
            if capture.layers:
                written = write_added_form(
                    capture, Path(checkpoint_dir), capture.stem, loaded,
                    signing_key=signing_key, encryption_key=encryption_key, into=publication.folder,
                )  # fmt: skip
        nothing_added = _vllm_compat.every_rank_succeeded(not capture.layers)
        result: dict = {"generation": None}
        if written is not None:
            form_file = written.added_forms[-1].tensor_file
            result.update(tensor_file=form_file.path, bytes=form_file.size)
        if nothing_added:
            return result
        _first_rank_commits(
            lambda: publish.commit_over(
                publication,
                generation,
                made_by="add-form",
                form_sets=publish.with_new_manifests(publication, generation, capture.fingerprint.vllm_version),
                signing_key=signing_key,
                encryption_key=encryption_key,
            ),
            f"{checkpoint_dir}: the first rank of this engine could not commit the form (its error is raised there); "
            "nothing was committed",
        )
        result["generation"] = generation_id
        return result

    def tensorizer_manifest_compile_identity(self) -> dict | None:
        """What the compile form ``add-form --compile`` makes of this engine is for (machine kind, vLLM, torch, the
        settings hash: ``load.compile_placement.EngineCompile``), as the loader computed it; None unless asked."""
        return getattr(self._tm_model(), COMPILE_IDENTITY_ATTR, None)

    def _tm_aot_artifacts(self) -> dict:
        """Where vLLM saved this rank's AOT artifact of each module it compiled (None: none), and the rank: what
        ``add-form --compile`` arranges into a form (``load.compile_placement.arrange_aot_artifacts``)."""
        model = self._tm_model()
        return {
            "rank": self.vllm_config.parallel_config.rank,
            "modules": {
                name: _vllm_compat.saved_aot_artifact(module)
                for name, module in _vllm_compat.compiled_modules(model).items()
            },  # fmt: skip
        }

    def tensorizer_manifest_report(self) -> dict | None:
        """What the manifest loader did in this worker (None when it was not used)."""
        return getattr(self._tm_model(), REPORT_ATTR, None)

    def tensorizer_manifest_state_hashes(self) -> dict[str, str]:
        """blake3 of every parameter and persistent buffer of this worker's model, by full name.

        Two engines that loaded the same model the same way give equal maps,
        whichever loader each used: how a rank's state is compared when the
        engine's workers are other processes (pipeline parallel).
        """
        from ..live_model.tensors import hash_tensor

        hashes = {}
        for path, module in self._tm_model().named_modules():
            for name, tensor in module._parameters.items():
                if tensor is not None:
                    hashes[f"{path}.{name}" if path else name] = hash_tensor(tensor.detach().cpu())
            for name, tensor in module._buffers.items():
                if tensor is not None and name not in module._non_persistent_buffers_set:
                    hashes[f"{path}.{name}" if path else name] = hash_tensor(tensor.detach().cpu())
        return hashes


def _base_summary(base) -> dict:
    """What the save's summary says of the base it wrote: inside (its tensor file's bytes) or by reference."""
    if base.source is not None:
        return {"tensors": len(base.tensors), "bytes": 0, "reference": base.source.root,
                "files": [f.name for f in base.source.files]}  # fmt: skip
    return {"tensors": len(base.tensors), "bytes": base.tensor_file.size}
