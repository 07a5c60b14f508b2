"""What a load decides before a byte of weights is read (``LoadPlan``, made by ``plan_load``): the engine's
fingerprint, where the checkpoint is and which generation every rank reads, the keys, this rank's stem and device,
the compile form, and whether the load takes a form set or the base. Every later step (``load_model``) takes the
plan; nothing in it is decided twice.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from .. import _failpoints, _vllm_compat
from ..checks.fingerprint import check_compatible, engine_fingerprint, refuse_unrecorded_settings
from ..checks.seal import check_generation_seal
from ..errors import (
    CompatibilityError,
    ConcurrentWriteError,
    ConfigurationError,
    TensorizerManifestError,
    UnsupportedVLLMError,
)
from ..format.generation import Generation, decode_pointer, encode_pointer
from ..format.schema import EncryptionKey, Fingerprint, SigningKey
from ..storage.checkpoint import (
    checkpoint_root,
    checkpoint_stem,
    encryption_key_from,
    form_set_of,
    load_generation,
    load_manifest,
    pinned_generation,
    read_pointer,
    signing_key_from,
)
from ..storage.remote import RemoteDir
from . import compile_placement
from .options import LoadOptions


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """What one rank's load decided before reading weights. ``root``: the checkpoint's directory (or prefix),
    or where it names a file (format versions 1 and 2) the location as given; ``generation``: the one every rank
    reads (None: no pointer); ``fingerprint``: this engine, or None where this vLLM cannot be described
    (``undescribed`` says why: a base may still serve it); ``compile_form``: the compile form this engine uses
    (None: none), ``compile_identity``: what ``add-form --compile``'s form is for; ``why_base``: why this load
    takes the generation's base rather than a form set (None: its forms)."""

    vllm_config: Any
    model_config: Any
    prefix: str
    options: LoadOptions
    checkpoint: str
    named_file: str | None
    root: Path | RemoteDir | str
    generation: Generation | None
    signing_key: SigningKey | None
    encryption_key: EncryptionKey | None
    fingerprint: Fingerprint | None
    undescribed: UnsupportedVLLMError | None
    stem: str
    device: torch.device
    clock: Clock
    compile_form: compile_placement.PlacedForm | None = None
    compile_identity: dict | None = None
    why_base: str | None = None

    @property
    def engine(self) -> Fingerprint:
        """This engine's fingerprint, for what needs it; where this vLLM cannot be described, why (raised)."""
        if self.fingerprint is None:
            assert self.undescribed is not None  # set together (plan_load)
            raise self.undescribed
        return self.fingerprint


def plan_load(vllm_config: Any, model_config: Any, prefix: str, options: LoadOptions, device: torch.device) -> LoadPlan:
    """Every rank's decisions, in the order they may fail: a vLLM it cannot describe is set aside (refused later,
    unless a base serves it), the ranks agree on a generation before anything can fail on one alone, the compile
    form is placed before the model is built (vLLM reads its compile settings then), and a base is chosen only
    where the generation has one."""
    clock = Clock()
    try:
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
    compile_form, identity = _compile_form(vllm_config, options, root, generation, signing_key, encryption_key)
    if options.source == "base" and (generation is None or generation.base is None):
        raise ConfigurationError(
            f"{checkpoint}: the load options ask for the base (source='base'), and this checkpoint has none (save "
            "it with --base inside, or load it with source='auto')"
        )
    why = None
    if generation is not None and generation.base is not None:
        why = why_not_its_forms(root, generation, stem, fingerprint, undescribed, options, vllm_config)
    return LoadPlan(
        vllm_config=vllm_config,
        model_config=model_config,
        prefix=prefix,
        options=options,
        checkpoint=checkpoint,
        named_file=named_file,
        root=root,
        generation=generation,
        signing_key=signing_key,
        encryption_key=encryption_key,
        fingerprint=fingerprint,
        undescribed=undescribed,
        stem=stem,
        device=device,
        clock=clock,
        compile_form=compile_form,
        compile_identity=identity,
        why_base=why,
    )


def first_rank() -> bool:
    """Rank 0 of every parallel group: the one that draws progress bars."""
    return _vllm_compat.parallel_ranks() == (0, 0)


def rank_stem(vllm_config: Any) -> str:
    """This process's checkpoint stem (``model``, ``model-tp1-of-2``...)."""
    parallel = vllm_config.parallel_config
    tp_rank, pp_rank = _vllm_compat.parallel_ranks()
    return checkpoint_stem(tp_rank, parallel.tensor_parallel_size, pp_rank, parallel.pipeline_parallel_size)


class Clock:
    """Named laps, for the load report: what validation costs next to the load itself."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._last, 6)
        self._last = now


def _compile_form(
    vllm_config: Any,
    options: LoadOptions,
    root: Path | RemoteDir | str,
    generation: Generation | None,
    signing_key: SigningKey | None,
    encryption_key: EncryptionKey | None,
) -> tuple[compile_placement.PlacedForm | None, dict | None]:
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


def why_not_its_forms(root, generation, stem, fingerprint, undescribed, options, vllm_config) -> str | None:
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
