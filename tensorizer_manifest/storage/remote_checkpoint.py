"""A whole checkpoint to and from remote storage: ``publish`` (a local generation of format version 3 committed
to another store, through its backend; ``publish_to_s3``: to an S3 prefix, what every writer to S3 does),
``upload_checkpoint`` (a checkpoint saved locally, of any version, to an S3 prefix) and ``fetch_model_files`` (a
remote checkpoint's config and tokenizer files, for vLLM's ``model``).

Beside ``checkpoint`` (which finds and reads a checkpoint's files, local or remote); the objects themselves,
their credentials and failures are the ``remote`` package's.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

import msgspec

from ..errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    IntegrityError,
    RemoteNotFoundError,
    TensorizerManifestError,
)
from ..format.generation import (
    POINTER_NAME,
    Generation,
    decode_pointer,
    generation_dir,
    generation_named,
    seal_generation,
)
from ..format.schema import MANIFEST_SUFFIX, TENSORS_SUFFIX, EncryptionKey, SigningKey, blake3_hex, seal_mode
from .checkpoint import encryption_key_from, signing_key_from
from .generations import CheckpointStore, LocalCheckpoint, S3Checkpoint, stale_model_files
from .remote import HTTP_MODEL_FILES, RemoteDir, RemoteOptions, is_model_file, probe_conditional_writes

#: A pointer, generation document or model file fetched whole is refused above this (they hold no weights).
logger = logging.getLogger(__name__)

_MAX_DOCUMENT_BYTES = 64 << 20


def upload_checkpoint(
    local_dir: Path,
    uri: str,
    options: RemoteOptions | None = None,
    allow_unconditional_writes: bool = False,
    *,
    signing_key_file: str | os.PathLike | None = None,
    encryption_key_file: str | os.PathLike | None = None,
) -> list[str]:
    """Upload a checkpoint saved locally; returns the paths uploaded.

    Format version 3: its current generation is committed to ``uri`` as a writer there would
    (``publish_to_s3``): new keys, then one conditional PUT of the pointer. A generation sealed with a key, going
    over another generation than its parent there, is sealed again: give its key's file (else
    ``$TENSORIZER_MANIFEST_SIGNING_KEY`` / ``$TENSORIZER_MANIFEST_ENCRYPTION_KEY`` name it, as for ``save``).
    Versions 1 and 2: tensor files first, then config and tokenizer files, manifests last, each manifest only
    over the version found (so a reader that finds a manifest finds its tensor file beside it); then the tensor
    files an earlier save to the same prefix left (same stem, another digest, named by no manifest) are removed.
    """
    target = RemoteDir(uri, options or RemoteOptions())
    if target.scheme != "s3":
        raise ConfigurationError(f"{uri}: only s3:// checkpoints can be written; http(s) is read-only")
    probe_conditional_writes(target, allow_unconditional_writes)
    if (Path(local_dir) / POINTER_NAME).is_file():
        generation = publish_to_s3(
            Path(local_dir),
            uri,
            options or RemoteOptions(),
            signing_key=signing_key_from(signing_key_file),
            encryption_key=encryption_key_from(encryption_key_file),
            allow_unconditional_writes=allow_unconditional_writes,
        )
        return generation.named_paths()
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


#: Files of a staged generation smaller than this go up in one conditional request (create-only); larger ones
#: (tensor files) through tensorizer's upload, under keys that carry the generation's id.
SMALL_FILE_BYTES = 16 << 20


def publish_to_s3(
    staging: Path,
    uri: str,
    options: RemoteOptions,
    *,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
    allow_unconditional_writes: bool = False,
    only_over_its_parent: bool = False,
) -> Generation:
    """The current generation of the local checkpoint ``staging``, committed to the ``s3://`` prefix ``uri``
    (``publish`` to its ``S3Checkpoint``)."""
    store = S3Checkpoint(RemoteDir(uri, options), allow_unconditional_writes)
    return publish(
        staging,
        store,
        signing_key=signing_key,
        encryption_key=encryption_key,
        only_over_its_parent=only_over_its_parent,
    )


def publish(
    staging: Path,
    store: CheckpointStore,
    *,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
    only_over_its_parent: bool = False,
) -> Generation:
    """The current generation of the local checkpoint ``staging``, committed to ``store`` (any backend) over the
    generation current there: every file it names written as a new key (its own folder's; an earlier generation's
    only where ``store`` lacks it; nothing a committed generation names is touched), its document sealed again when
    its parent there differs, then one compare-and-swap of the pointer (``ConcurrentWriteError`` when another writer
    committed since this one read it). A failure before that swap commits nothing: what was written is an orphan
    that ``gc`` removes. Then the top level is refreshed and old generations collected.

    ``only_over_its_parent``: a write made from one generation (an add-form keeps its tensor files and adds to
    its manifests) is committed over that one only, never over a newer save (``ConcurrentWriteError``)."""
    where = store.where
    staged = LocalCheckpoint(staging).current()
    if staged is None:
        raise CheckpointNotFoundError(f"{staging}: no generation to publish")
    if staged.base is not None and staged.base.mode == "reference":
        raise ConfigurationError(
            f"{staging}: its base names the source's files on this machine (saved with base='reference'), which an "
            f"{where} checkpoint cannot read: save it with base='inside' to publish it"
        )
    parent = staged.parent if only_over_its_parent else store.current_generation_id()
    generation = staged
    if parent != staged.parent:  # checked before anything is uploaded
        if staged.seal is not None and staged.seal.mode != seal_mode(signing_key, encryption_key):
            raise ConfigurationError(
                f"{staging}: generation {staged.id} is sealed with a key ({staged.seal.mode}), and committing it over "
                f"generation {parent or 'none'} at {where} seals it again: give the same key"
            )
        generation = seal_generation(
            msgspec.structs.replace(staged, parent=parent, seal=None), signing_key, encryption_key
        )
    own = generation_dir(staged.id) + "/"
    for relative in staged.named_paths():
        if not relative.startswith(own) and store.backend.exists(relative):
            continue  # an earlier generation's file, there already
        path = staging / relative
        if not path.is_file():
            raise CheckpointNotFoundError(
                f"{path}: generation {staged.id} names it, and it is neither here nor at {where}; save the checkpoint "
                "again"
            )
        if path.stat().st_size >= SMALL_FILE_BYTES:
            store.upload(relative, path)  # under this generation's id: no other writer uses the key
            continue
        store.create_again(relative, path.read_bytes(), staged.id)  # there already: an earlier try's, the same
    store.commit(generation)
    try:
        store.refresh_top_level()
        store.gc(store.plan_gc())
    except (OSError, TensorizerManifestError) as exc:  # the commit stands; the next writer or `gc` does it
        logger.warning("%s: committed; tidying up after it failed (%s)", where, exc)
    return generation


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
    for name in stale_model_files((p.name for p in cache.iterdir() if p.is_file()), generation):
        (cache / name).unlink(missing_ok=True)  # an earlier fetch's, of a generation that had it
    return True
