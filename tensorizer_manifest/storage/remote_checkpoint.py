"""A whole checkpoint to and from remote storage: ``upload_checkpoint`` (a checkpoint saved locally, to an S3
prefix) and ``fetch_model_files`` (a remote checkpoint's config and tokenizer files, for vLLM's ``model``).

Beside ``checkpoint`` (which finds and reads a checkpoint's files, local or remote); the objects themselves,
their credentials and failures are the ``remote`` package's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from ..errors import ConfigurationError, IntegrityError, RemoteNotFoundError
from ..format.generation import POINTER_NAME, decode_pointer, generation_named
from ..format.schema import MANIFEST_SUFFIX, TENSORS_SUFFIX, blake3_hex
from .remote import HTTP_MODEL_FILES, RemoteDir, RemoteOptions, is_model_file, probe_conditional_writes

#: A pointer, generation document or model file fetched whole is refused above this (they hold no weights).
_MAX_DOCUMENT_BYTES = 64 << 20


def upload_checkpoint(
    local_dir: Path, uri: str, options: RemoteOptions | None = None, allow_unconditional_writes: bool = False
) -> list[str]:
    """Upload a saved checkpoint: tensor files first, then config and tokenizer files, manifests last.

    So a reader that finds a manifest finds its tensor file beside it. Then the tensor files an earlier
    save to the same prefix left (same stem, another content digest, named by no manifest any more) are
    removed, as a local re-save removes them. Returns the names uploaded.
    """
    target = RemoteDir(uri, options or RemoteOptions())
    if target.scheme != "s3":
        raise ConfigurationError(f"{uri}: only s3:// checkpoints can be written; http(s) is read-only")
    if (Path(local_dir) / "tensorizer-manifest.json").is_file():
        raise ConfigurationError(
            f"{local_dir}: a checkpoint of format version 3; save it to {uri} directly "
            "(`tensorizer-manifest save SRC s3://... --format-version 3`), which commits its generation there"
        )
    probe_conditional_writes(target, allow_unconditional_writes)
    files = sorted(p for p in Path(local_dir).iterdir() if p.is_file() and not p.name.startswith("."))
    tensors = [p for p in files if p.name.endswith(TENSORS_SUFFIX)]
    manifests = [p for p in files if p.name.endswith(MANIFEST_SUFFIX)]
    others = [p for p in files if p not in tensors and p not in manifests]
    replaces = {p.name: (target / p.name).current_etag() for p in manifests}  # what this upload may replace
    for path in [*tensors, *others]:
        (target / path.name).upload(path)
    for path in manifests:  # each a compare-and-swap on the one found above
        (target / path.name).upload_if(path, replaces[path.name])
    uploaded = {p.name for p in tensors}
    for name in target.list_names():
        if name not in uploaded and any(_same_stem(name, new) for new in uploaded):
            (target / name).delete()
    return [p.name for p in [*tensors, *others, *manifests]]


def _same_stem(name: str, tensor_file: str) -> bool:
    """Whether ``name`` is a tensor file of the same rank as ``tensor_file`` (``{stem}.{16 hex}.tensors``, or
    ``{stem}.{16 hex}-{16 hex}.tensors`` when encrypted)."""
    pattern = r"(.+)\.[0-9a-f]{16}(?:-[0-9a-f]{16})?" + re.escape(TENSORS_SUFFIX)
    ours, theirs = re.fullmatch(pattern, tensor_file), re.fullmatch(pattern, name)
    return bool(ours and theirs and ours.group(1) == theirs.group(1))


def model_file_names(location: RemoteDir) -> Iterable[str]:
    """Config and tokenizer files to look for under a prefix: listed on S3, the usual names over HTTP."""
    if location.scheme == "s3":
        return [n for n in location.list_names() if is_model_file(n)]
    return HTTP_MODEL_FILES


def fetch_model_files(uri: str, cache_dir: str | os.PathLike, options: RemoteOptions | None = None) -> Path:
    """Download a remote checkpoint's config and tokenizer files (no weights, no manifest) into ``cache_dir``.

    vLLM's ``model`` must be a local directory or a Hugging Face id; start it with
    ``LLM(model=<this directory>, load_format="tensorizer_manifest",
    model_loader_extra_config={"checkpoint_dir": uri})``. Returns ``cache_dir``.
    """
    location = RemoteDir(uri, options or RemoteOptions())
    cache = Path(cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    if _fetch_generation_model_files(location, cache):
        return cache
    fetched = []
    for name in model_file_names(location):
        try:
            (location / name).download(cache / name)
        except RemoteNotFoundError:
            if location.scheme == "s3":
                raise
            continue  # over HTTP the names are guesses
        fetched.append(name)
    if "config.json" not in fetched:
        raise RemoteNotFoundError(f"{location}: no config.json there; is it a checkpoint saved with its config?")
    return cache


def _fetch_generation_model_files(location: RemoteDir, cache: Path) -> bool:
    """A checkpoint of format version 3: its current generation's own model files, each checked against the hash
    the generation records (the copies at the top are never trusted). False: no pointer there (versions 1, 2)."""
    pointer_file = location / POINTER_NAME
    try:
        pointer = decode_pointer(pointer_file.read_bytes(_MAX_DOCUMENT_BYTES), str(pointer_file))
    except RemoteNotFoundError:
        return False
    document = location / pointer.document
    generation = generation_named(pointer, document.read_bytes(_MAX_DOCUMENT_BYTES), str(document))
    for model_file in generation.model_files:
        source = location / model_file.file.path
        data = source.read_bytes(_MAX_DOCUMENT_BYTES)
        if blake3_hex(data) != model_file.file.hash:
            raise IntegrityError(
                f"{source}: not the bytes generation {generation.id} records for {model_file.name} (damaged, or "
                "replaced): save the checkpoint again"
            )
        tmp = cache / f".{model_file.name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, cache / model_file.name)
    return True
