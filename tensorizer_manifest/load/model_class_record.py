"""vLLM's record of the model's class, carried by the checkpoint, so that a fresh process need not inspect the class.

vLLM learns what a model class supports (generation, pipeline parallelism, inner state, its attention) by importing
it in a fresh interpreter, about 10 s of a core on 2 cores, unless its cache (``_vllm_compat.model_class_records``)
holds a record for the class's current source: a process on a machine that started the engine before finds one, a
new replica does not. The record is a pure function of vLLM's model module (vLLM keys it by the hash of the
module's source and checks that hash itself), so a save keeps the record its engine used as a model file of the
generation (``RECORD_PREFIX``), and before vLLM makes its config the plugin writes it where vLLM looks, unless a
record of the class is there already (``place_records``).

A record decides how vLLM serves every model of that class on the machine, not only this checkpoint's, so it is
placed only under the trust a compile form needs: the generation's seal checked with the user's signing key, or
``trust_compile_forms``; and only with the bytes the generation records.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .. import _vllm_compat
from ..checks.seal import check_generation_seal
from ..format.generation import Generation
from ..format.schema import EncryptionKey, SigningKey, blake3_hex

logger = logging.getLogger("vllm.tensorizer_manifest")

RECORD_PREFIX = "vllm-model-class."
"""A model file that is vLLM's record of a class: the prefix, then vLLM's own file name for it."""


def record_of(source: Path) -> tuple[str, bytes] | None:
    """vLLM's record of the class of the model in ``source`` (its ``config.json``'s one architecture), as the model
    file a save keeps: its name and bytes; None where vLLM holds none (or more than one that could be it)."""
    try:
        architectures = json.loads((source / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    if len(architectures) != 1:
        return None
    (architecture,) = architectures
    folder = _vllm_compat.model_class_records()
    found = []
    for path in sorted(folder.glob(f"*-{architecture}.json")) if folder is not None else []:
        try:
            data = path.read_bytes()
            record = json.loads(data)
        except (OSError, ValueError):
            continue
        info = record.get("modelinfo") if isinstance(record, dict) else None
        if "hash" in record and isinstance(info, dict) and info.get("architecture") == architecture:
            found.append((RECORD_PREFIX + path.name, data))
    return found[0] if len(found) == 1 else None


def place_records(
    folder: Path,
    generation: Generation,
    signing_key: SigningKey | None,
    encryption_key: EncryptionKey | None,
    trust_compile_forms: bool,
) -> list[str]:
    """Write each record ``generation`` carries (in its own ``folder``) where vLLM looks for it, unless a record of
    that class is there; the classes' file names written. Only where the generation's seal checks with the user's
    signing key, or the user trusts the checkpoint's writer (``trust_compile_forms``) and its digest checks; a
    record whose bytes are not the generation's, or a cache that cannot be written, is skipped (vLLM then inspects
    the class, as it would have)."""
    records = [m for m in generation.model_files if m.name.startswith(RECORD_PREFIX)]
    if not records:
        return []
    target = _vllm_compat.model_class_records()
    if target is None or all((target / m.name.removeprefix(RECORD_PREFIX)).exists() for m in records):
        return []  # nothing to place: vLLM keeps no records, or has this one

    def not_placed(why: str) -> list[str]:
        logger.info("%s: vLLM's record of the model's class not placed (%s); vLLM inspects the class", folder, why)
        return []

    if signing_key is None and not trust_compile_forms:
        return not_placed(
            "the checkpoint's seal is not checked with your signing key: give signing_key_file, or "
            "trust_compile_forms=true to trust whoever can write the checkpoint"
        )
    if check_generation_seal(generation, False, signing_key, encryption_key) is not None:
        return not_placed("the generation's seal does not check; the load says why")
    placed = []
    for record in records:
        name = record.name.removeprefix(RECORD_PREFIX)
        destination = target / name
        try:
            if destination.exists():
                continue
            data = (folder / record.name).read_bytes()
            if blake3_hex(data) != record.file.hash:
                not_placed(f"{record.name} is not the bytes the generation records; the load says so")
                continue
            target.mkdir(parents=True, exist_ok=True)
            temporary = target / f".{name}.{os.getpid()}.tmp"
            temporary.write_bytes(data)
            os.replace(temporary, destination)
        except OSError as exc:
            logger.debug("%s: vLLM's record of the model's class not placed in %s: %s", folder, target, exc)
            continue
        placed.append(name)
    if placed:
        logger.info(
            "%s: placed vLLM's record of the model's class that the checkpoint carries (%s): vLLM need not inspect "
            "the class in a fresh interpreter",
            folder,
            ", ".join(placed),
        )
    return placed
