"""A generation (format version 3) against what a load uses besides its manifest: its seal, and the files vLLM read
from its ``model`` directory (config, tokenizer, generation config), which must be the generation's own.

Weights of one save with another save's tokenizer answer wrong without an error: here that is an
``IntegrityError`` naming the file, before a byte of weights is read. No torch, no vLLM.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointNotFoundError, ConfigurationError, IntegrityError, TensorizerManifestError
from ..format.generation import Generation
from ..format.schema import EncryptionKey, Manifest, SigningKey, blake3_hex
from ..storage.compile_archive import check_archive, read_archive
from ..storage.generations import stale_model_files
from ..storage.remote import RemoteDir
from .seal import check_generation_seal

#: A model file read whole by ``validate`` is refused above this (config and tokenizer files are small).
MAX_MODEL_FILE_BYTES = 64 << 20


def check_generation(
    generation: Generation,
    encrypted: bool,
    signing_key: SigningKey | None,
    encryption_key: EncryptionKey | None,
    model_dir: str | Path,
) -> None:
    """The generation's seal with the keys given (``encrypted``: whether the tensor files it reads are),
    then every model file of the generation that ``model_dir`` holds, by content hash. A ``model_dir`` that is not a
    local directory (a Hugging Face id) is not compared: vLLM read those files from elsewhere."""
    sealed = check_generation_seal(generation, encrypted, signing_key, encryption_key)
    if sealed is not None:
        kind, message = sealed
        raise kind(f"generation {generation.id}: {message}")
    directory = Path(model_dir)
    if not directory.is_dir():
        return
    stale = stale_model_files((p.name for p in directory.iterdir() if p.is_file()), generation)
    if stale:
        raise IntegrityError(
            f"{directory / stale[0]}: the checkpoint's generation {generation.id} has no {stale[0]} (another save's, "
            "left behind, or added): vLLM reads it by that name, and the weights would run with it. Remove it, start "
            "vLLM with the checkpoint itself as its model, or copy the checkpoint's model files again "
            "(`tensorizer-manifest fetch`)"
        )
    for model_file in generation.model_files:
        path = directory / model_file.name
        if path.is_file() and blake3_hex(path.read_bytes()) != model_file.file.hash:
            raise IntegrityError(
                f"{path}: not the {model_file.name} of the checkpoint's generation {generation.id} (another save's, "
                "or edited): vLLM read it, and the weights would run with it. Start vLLM with the checkpoint itself "
                "as its model, or copy the checkpoint's model files again (`tensorizer-manifest fetch`)"
            )


def generation_problems(
    root: Path | RemoteDir,
    generation: Generation,
    manifest: Manifest,
    signing_key: SigningKey | None,
    encryption_key: EncryptionKey | None,
) -> tuple[list[tuple[type[TensorizerManifestError], str, str]], list[str]]:
    """What ``validate`` finds in a generation besides its rank manifest, as (problems, warnings): its seal, each
    model file of its own against its hash, each compile form's archive and every file in it against theirs, and (a
    warning: loads from there would be refused) a copy at the top of a local checkpoint that is not the generation's.
    ``root``: the checkpoint."""
    problems: list[tuple[type[TensorizerManifestError], str, str]] = []
    warnings: list[str] = []
    where = f"{root}: generation {generation.id}"
    sealed = check_generation_seal(generation, manifest.tensor_file.encryption != "none", signing_key, encryption_key)
    if sealed is not None:
        if sealed[0] is ConfigurationError:
            warnings.append(f"{where}: the seal was not checked: {sealed[1]}")
        else:
            problems.append((sealed[0], where, sealed[1]))
    for model_file in generation.model_files:
        location = root / model_file.file.path
        try:
            data = (
                location.read_bytes(MAX_MODEL_FILE_BYTES) if not isinstance(location, Path) else location.read_bytes()
            )
        except (OSError, TensorizerManifestError) as exc:
            problems.append((CheckpointNotFoundError, str(location), f"the model file the generation names: {exc}"))
            continue
        if blake3_hex(data) != model_file.file.hash:
            problems.append((IntegrityError, str(location), f"not the bytes generation {generation.id} records"))
        top = root / model_file.name
        if isinstance(top, Path) and top.is_file() and top.read_bytes() != data:
            warnings.append(
                f"{top}: not the current generation's {model_file.name}; a load with this directory as vLLM's model "
                "is refused until the next save refreshes it (or copy it from the generation)"
            )
    for form in generation.compile_forms:
        location = root / form.archive.path
        try:
            check_archive(read_archive(root, form.archive), form.archive, form.files, str(location))
        except IntegrityError as exc:
            problems.append((IntegrityError, str(location), f"the compile form's archive: {exc}"))
        except (OSError, TensorizerManifestError) as exc:
            problems.append((CheckpointNotFoundError, str(location), f"the compile form's archive the generation "
                             f"names: {exc}"))  # fmt: skip
    return problems, warnings
