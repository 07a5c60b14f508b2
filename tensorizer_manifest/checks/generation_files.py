"""A generation (format version 3) against what a load uses besides its manifest: its seal, and the files vLLM read
from its ``model`` directory (config, tokenizer, generation config), which must be the generation's own.

Weights of one save with another save's tokenizer answer wrong without an error: here that is an
``IntegrityError`` naming the file, before a byte of weights is read. No torch, no vLLM.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import IntegrityError
from ..format.generation import Generation
from ..format.schema import EncryptionKey, Manifest, SigningKey, blake3_hex
from .seal import check_generation_seal


def check_generation(
    generation: Generation,
    manifest: Manifest,
    signing_key: SigningKey | None,
    encryption_key: EncryptionKey | None,
    model_dir: str | Path,
) -> None:
    """The generation's seal with the keys given (its rank ``manifest`` says whether the checkpoint is encrypted),
    then every model file of the generation that ``model_dir`` holds, by content hash. A ``model_dir`` that is not a
    local directory (a Hugging Face id) is not compared: vLLM read those files from elsewhere."""
    sealed = check_generation_seal(generation, manifest.tensor_file.encryption != "none", signing_key, encryption_key)
    if sealed is not None:
        kind, message = sealed
        raise kind(f"generation {generation.id}: {message}")
    directory = Path(model_dir)
    if not directory.is_dir():
        return
    for model_file in generation.model_files:
        path = directory / model_file.name
        if path.is_file() and blake3_hex(path.read_bytes()) != model_file.file.hash:
            raise IntegrityError(
                f"{path}: not the {model_file.name} of the checkpoint's generation {generation.id} (another save's, "
                "or edited): vLLM read it, and the weights would run with it. Start vLLM with the checkpoint itself "
                "as its model, or copy the checkpoint's model files again (`tensorizer-manifest fetch`)"
            )
