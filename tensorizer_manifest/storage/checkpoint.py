"""Where a checkpoint's files are: per-rank names, the manifest, the tensor file it names, the key files.

A checkpoint is a local directory or a remote prefix (``s3://bucket/prefix``,
``https://host/path``, read through ``remote``); a manifest or tensor file is
then a ``Path`` or a ``remote.RemoteFile``. No torch, no vLLM: ``inspect`` uses
it too. Reading goes through ``schema.decode_manifest``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .._constants import ENCRYPTION_KEY_ENV, SIGNING_KEY_ENV
from ..errors import (
    CheckpointNotFoundError,
    CompatibilityError,
    ConfigurationError,
    IntegrityError,
    ManifestError,
    NoManifestError,
    RemoteNotFoundError,
    TensorizerManifestError,
)
from ..format.generation import (
    GENERATION_DOCUMENT,
    GENERATIONS_DIR,
    POINTER_NAME,
    BaseDocument,
    FormSet,
    Generation,
    Pointer,
    RankRef,
    decode_base,
    decode_generation,
    decode_pointer,
    generation_dir,
    generation_named,
    is_generation_id,
)
from ..format.schema import (
    MANIFEST_SUFFIX,
    TENSORS_SUFFIX,
    EncryptionKey,
    Manifest,
    SigningKey,
    TensorFileRef,
    blake3_hex,
    decode_manifest,
)
from .remote import RemoteDir, RemoteFile, RemoteOptions, locate

_Key = TypeVar("_Key", SigningKey, EncryptionKey)

#: A manifest or tensor file: on disk, or an object in remote storage.
FileLocation = Path | RemoteFile

#: Manifests larger than this are refused before parsing.
MAX_MANIFEST_BYTES = 256 << 20
#: Key files (signing or encryption) larger than this are refused (a key is a few dozen bytes).
MAX_SIGNING_KEY_BYTES = 64 << 10


def checkpoint_stem(tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> str:
    """``model`` for one rank, ``model-tp{r}-of-{n}`` (and ``-pp{r}-of-{n}``) when sharded."""
    stem = "model"
    if tp_size > 1:
        stem += f"-tp{tp_rank}-of-{tp_size}"
    if pp_size > 1:
        stem += f"-pp{pp_rank}-of-{pp_size}"
    return stem


_STEM = re.compile(r"^model(?:-tp(\d+)-of-(\d+))?(?:-pp(\d+)-of-(\d+))?$")


def parallel_layout(stem: str) -> tuple[int, int] | None:
    """``(tensor_parallel_size, pipeline_parallel_size)`` a checkpoint stem was saved with; None if not ours."""
    match = _STEM.match(stem)
    if match is None:
        return None
    return int(match.group(2) or 1), int(match.group(4) or 1)


def layout_mismatch(where: object, wanted_stem: str, manifest_names: list[str]) -> CompatibilityError | None:
    """Why a rank's manifest is missing when the checkpoint holds other ranks': the saved layout, named."""
    saved = sorted(
        {
            layout
            for name in manifest_names
            if name.endswith(MANIFEST_SUFFIX)
            and (layout := parallel_layout(name.removesuffix(MANIFEST_SUFFIX))) is not None
        }
    )
    wanted = parallel_layout(wanted_stem)
    if not saved or wanted is None or wanted in saved:
        return None
    layouts = " or ".join(f"tensor_parallel_size={tp}, pipeline_parallel_size={pp}" for tp, pp in saved)
    return CompatibilityError(
        f"{where}: this checkpoint was saved with {layouts}; this engine runs tensor_parallel_size={wanted[0]}, "
        f"pipeline_parallel_size={wanted[1]} and would need {wanted_stem}{MANIFEST_SUFFIX}. Start vLLM with the "
        "saved sizes, or re-save the checkpoint with this engine's.",
        [("parallel_layout", saved[0], wanted)],
    )


#: ``model.tensors`` (stock vLLM's name) or ``model.<16 hex digits of its digest>.tensors`` (ours).
_TENSOR_FILE_NAME = re.compile(r"^(?P<stem>.+?)(?P<digest>\.[0-9a-f]{16})?" + re.escape(TENSORS_SUFFIX) + "$")
#: tensorizer's magic, the first bytes of every file it writes.
TENSORIZER_MAGIC = b"|TZR|"


def manifest_name_beside(tensor_file_name: str) -> str:
    """The manifest a tensor file belongs to (``model.1a2b….tensors`` → ``model.manifest.json``)."""
    match = _TENSOR_FILE_NAME.match(tensor_file_name)
    stem = match.group("stem") if match else tensor_file_name
    return stem + MANIFEST_SUFFIX


def no_manifest_error(tensor_file: FileLocation, source: str = "SOURCE_MODEL", save_flags: str = "") -> NoManifestError:
    """What a tensorizer file without a manifest is, and the command that re-saves it (one line)."""
    out = tensor_file.parent
    flags = f" {save_flags}" if save_flags else ""
    what = (
        " (SOURCE_MODEL: the Hugging Face model or safetensors directory it was made from)"
        if source == "SOURCE_MODEL"
        else ""
    )
    error = NoManifestError(
        f"{tensor_file}: a tensorizer file without a manifest beside it ({manifest_name_beside(tensor_file.name)} "
        "is missing), as vLLM's save_tensorized_model and tensorize_vllm_model write; nothing says how its layers "
        f"were saved, so it is not read. Re-save it from its source model: `tensorizer-manifest save {source} "
        f"{out}{flags}`{what}"
    )
    error.tensor_file = tensor_file
    return error


def checkpoint_location(
    tensorizer_uri: str | None, checkpoint_dir: str | None, model_path: str
) -> tuple[str, str | None]:
    """Where a loader's checkpoint is, and the tensor file vLLM's ``tensorizer_uri`` names there (None if none,
    or a per-rank ``%`` template): the uri's directory, else ``checkpoint_dir``, else the model path.

    What a ``tensorizer_uri`` means is decided here and in ``check_named_tensor_file`` alone; ``options`` only
    turns vLLM's option names into this package's.
    """
    if tensorizer_uri is None:
        return checkpoint_dir or model_path, None
    directory, _, name = tensorizer_uri.rstrip("/").rpartition("/")
    if not name.endswith(TENSORS_SUFFIX):
        raise ConfigurationError(
            f"tensorizer_uri must name a {TENSORS_SUFFIX} file (got one ending {name[-40:]!r}); "
            "give a checkpoint directory as tensorizer_dir"
        )
    directory = directory or "."
    if checkpoint_dir is not None and checkpoint_dir.rstrip("/") != directory:
        raise ConfigurationError(
            "tensorizer_uri and tensorizer_dir (checkpoint_dir) name two directories; give one of them"
        )
    return directory, None if "%" in name else name


def check_named_tensor_file(manifest: Manifest, manifest_path: FileLocation, name: str) -> None:
    """A tensor file named by the user (vLLM's ``tensorizer_uri``) must be one the manifest beside it names."""
    names = manifest.tensor_file_names()
    if name not in names:
        raise ConfigurationError(
            f"tensorizer_uri names {name}, but the manifest beside it ({manifest_path}) names its tensor file "
            f"{names[0]}: give that file's URI, or the directory as tensorizer_dir"
        )


def _is_tensorizer_file(path: FileLocation) -> bool:
    """Whether a file starts with tensorizer's magic (a bounded read of a few bytes)."""
    try:
        if isinstance(path, RemoteFile):
            head = b"".join(path.read_range(0, len(TENSORIZER_MAGIC)))
        else:
            with open(path, "rb") as f:
                head = f.read(len(TENSORIZER_MAGIC))
    except (OSError, TensorizerManifestError):
        return False
    return head == TENSORIZER_MAGIC


_Location = TypeVar("_Location", Path, RemoteFile)


def _manifest_beside(tensor_file: _Location) -> _Location:
    """The manifest of a tensor file given by its path or URI (vLLM's ``tensorizer_uri``)."""
    manifest = tensor_file.parent / manifest_name_beside(tensor_file.name)
    exists = manifest.exists() if isinstance(manifest, RemoteFile) else manifest.is_file()
    if exists:
        return manifest
    if _is_ours(tensor_file.name):
        kind = RemoteNotFoundError if isinstance(tensor_file, RemoteFile) else CheckpointNotFoundError
        raise kind(f"{tensor_file}: its manifest {manifest.name} is missing beside it; copy the whole checkpoint")
    if _is_tensorizer_file(tensor_file):
        raise no_manifest_error(tensor_file)
    kind = RemoteNotFoundError if isinstance(tensor_file, RemoteFile) else CheckpointNotFoundError
    raise kind(f"{tensor_file}: no such tensor file, and no {manifest.name} beside it")


def _is_ours(name: str) -> bool:
    """Whether a tensor file's name is one this package writes (``<stem>.<digest>.tensors``)."""
    match = _TENSOR_FILE_NAME.match(name)
    return match is not None and match.group("digest") is not None


def _stock_tensor_files(names: list[str]) -> list[str]:
    """Tensor files not named as this package names them, in a directory that holds no manifest at all:
    a stock vLLM checkpoint."""
    if any(name.endswith(MANIFEST_SUFFIX) for name in names):
        return []
    return sorted(name for name in names if name.endswith(TENSORS_SUFFIX) and not _is_ours(name))


def find_manifest(
    path: str | Path | RemoteFile | RemoteDir, stem: str | None = None, remote: RemoteOptions | None = None
) -> FileLocation:
    """A manifest file, given it, a tensor file of its checkpoint, or its checkpoint directory or URI
    (``stem`` picks a rank's).

    ``remote`` holds the credentials and endpoint for an ``s3://`` URI. A directory or a tensor file with
    tensorizer's data and no manifest (stock vLLM's ``model.tensors``) raises ``NoManifestError``.
    """
    located = locate(path, remote)
    if not isinstance(located, Path):
        return _find_remote_manifest(located, stem)
    path = located
    if path.is_file():
        return _manifest_beside(path) if path.name.endswith(TENSORS_SUFFIX) else path
    if path.name.endswith(TENSORS_SUFFIX) and not path.exists():
        return _manifest_beside(path)  # its manifest may be there even if the file is not: say which is missing
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: no such checkpoint directory or manifest file")
    if stem is not None and (path / (stem + MANIFEST_SUFFIX)).is_file():
        return path / (stem + MANIFEST_SUFFIX)  # the usual case: no listing
    names = [p.name for p in path.iterdir()]
    stock = [name for name in _stock_tensor_files(names) if _is_tensorizer_file(path / name)]
    if stock:
        raise no_manifest_error(path / stock[0])
    if stem is not None:
        candidate = path / (stem + MANIFEST_SUFFIX)
        mismatch = layout_mismatch(path, stem, names)
        if mismatch is not None:
            raise mismatch
        raise CheckpointNotFoundError(
            f"{path}: no {candidate.name}; save this checkpoint with `tensorizer-manifest save` "
            "using the same tensor- and pipeline-parallel sizes as this engine"
        )
    found = sorted(name for name in names if name.endswith(MANIFEST_SUFFIX))
    if not found:
        raise CheckpointNotFoundError(
            f"{path}: no *{MANIFEST_SUFFIX} here; this is not a tensorizer-manifest checkpoint "
            "(create one with `tensorizer-manifest save SRC OUT`)"
        )
    return path / found[0]


def _find_remote_manifest(location: RemoteFile | RemoteDir, stem: str | None) -> RemoteFile:
    if isinstance(location, RemoteFile):
        return _manifest_beside(location) if location.name.endswith(TENSORS_SUFFIX) else location
    if stem is not None and (location / (stem + MANIFEST_SUFFIX)).exists():
        return location / (stem + MANIFEST_SUFFIX)  # the usual case: one HEAD, no listing
    names = location.list_names() if location.scheme == "s3" else None
    stock = [name for name in _stock_tensor_files(names or []) if _is_tensorizer_file(location / name)]
    if stock:
        raise no_manifest_error(location / stock[0])
    if stem is None and names is not None:
        found = [n for n in names if n.endswith(MANIFEST_SUFFIX)]
        if not found:
            raise RemoteNotFoundError(
                f"{location}: no *{MANIFEST_SUFFIX} there; this is not a tensorizer-manifest checkpoint "
                "(create one with `tensorizer-manifest save SRC s3://bucket/prefix`)"
            )
        return location / found[0]
    candidate = location / ((stem or "model") + MANIFEST_SUFFIX)
    if not candidate.exists():
        if names is not None:
            mismatch = layout_mismatch(location, stem, names) if stem is not None else None
            if mismatch is not None:
                raise mismatch
        elif _is_tensorizer_file(location / f"{stem or 'model'}{TENSORS_SUFFIX}"):
            raise no_manifest_error(location / f"{stem or 'model'}{TENSORS_SUFFIX}")  # over http(s): vLLM's name
        hint = (
            "save this checkpoint with `tensorizer-manifest save` using the same tensor- and pipeline-parallel "
            "sizes as this engine"
            if stem is not None
            else f"over http(s) name a rank's manifest file itself (…/model-tp0-of-2{MANIFEST_SUFFIX})"
        )
        raise RemoteNotFoundError(f"{location}: no {candidate.name} there; {hint}")
    return candidate


def file_size(path: FileLocation) -> int:
    """The size of a local file or a remote object."""
    return path.size() if isinstance(path, RemoteFile) else path.stat().st_size


def load_manifest(
    path: str | Path | RemoteFile | RemoteDir,
    stem: str | None = None,
    remote: RemoteOptions | None = None,
    generation: Generation | None = None,
    follow_pointer: bool = True,
    vllm_version: str | None = None,
) -> tuple[Manifest, FileLocation]:
    """The manifest of a checkpoint directory, URI or manifest file, and the file it was read from.

    A checkpoint of format version 3 gives the rank's manifest of ``generation`` (by default the current one,
    through the pointer), its bytes checked against the generation's record of them; of the form set ``vllm_version``
    made, where its layout has one per release (``form_set_of``). ``follow_pointer=False``: the caller found no
    pointer already (a loader's ranks agreed on that) and it is not looked for again."""
    root = checkpoint_root(path, remote)
    if root is None and str(path).endswith(MANIFEST_SUFFIX):  # a rank's name at the top of a format-3 checkpoint
        named = locate(path, remote)
        assert not isinstance(named, RemoteDir)  # a name ending in .manifest.json is a file's
        beside = named.parent / POINTER_NAME
        if beside.exists() if isinstance(beside, RemoteFile) else beside.is_file():  # a stub: the current one's
            root, stem = named.parent, named.name.removesuffix(MANIFEST_SUFFIX)
    if generation is None and root is not None and follow_pointer:
        found = load_generation(root)
        generation = found[0] if found is not None else None
    if generation is not None:
        if root is None:
            raise ConfigurationError(f"{path}: give the checkpoint's directory, not one of its files")
        return _load_rank_manifest(root, generation, stem, vllm_version)
    manifest_path = find_manifest(path, stem, remote)
    if isinstance(manifest_path, RemoteFile):
        size = manifest_path.size()
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{manifest_path}: manifest is {size} bytes, over the {MAX_MANIFEST_BYTES} byte limit")
        data = manifest_path.read_bytes(MAX_MANIFEST_BYTES)
        return decode_manifest(data, source=str(manifest_path)), manifest_path
    size = manifest_path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{manifest_path}: manifest is {size} bytes, over the {MAX_MANIFEST_BYTES} byte limit")
    return decode_manifest(manifest_path.read_bytes(), source=str(manifest_path)), manifest_path


# --- format version 3: the pointer, the generation, a rank's manifest in it -------------------------------

#: Pointers and generation documents larger than this are refused before parsing (they name files, not tensors).
MAX_GENERATION_BYTES = 64 << 20


def checkpoint_root(path: str | Path | RemoteFile | RemoteDir, remote: RemoteOptions | None) -> Path | RemoteDir | None:
    """The checkpoint directory or prefix ``path`` names; None where it names a file."""
    location = locate(path, remote)
    if isinstance(location, Path):
        return location if location.is_dir() else None
    return location if isinstance(location, RemoteDir) else None


def _read_bounded(location: FileLocation, what: str) -> bytes | None:
    """A small file's bytes (None: there is none), refused when over ``MAX_GENERATION_BYTES``."""
    if isinstance(location, RemoteFile):
        if not location.exists():
            return None
        return location.read_bytes(MAX_GENERATION_BYTES)
    try:
        size = location.stat().st_size
    except FileNotFoundError:
        return None
    if size > MAX_GENERATION_BYTES:
        raise ManifestError(f"{location}: the {what} is {size} bytes, over the {MAX_GENERATION_BYTES} byte limit")
    return location.read_bytes()


def read_pointer(root: Path | RemoteDir) -> Pointer | None:
    """The pointer of a checkpoint of format version 3; None where there is none (versions 1 and 2)."""
    location = root / POINTER_NAME
    data = _read_bounded(location, "pointer")
    return None if data is None else decode_pointer(data, str(location))


def load_generation(root: Path | RemoteDir, pointer: Pointer | None = None) -> tuple[Generation, Pointer] | None:
    """The generation ``pointer`` names (by default the current one), its document's bytes checked against the
    pointer's hash; None for a checkpoint without a pointer. One that is gone is a ``CheckpointNotFoundError``
    naming it (a newer save was committed and this one removed after its grace period)."""
    pointer = pointer or read_pointer(root)
    if pointer is None:
        return None
    location = root / pointer.document
    data = _read_bounded(location, "generation document")
    if data is None:
        kind = RemoteNotFoundError if isinstance(location, RemoteFile) else CheckpointNotFoundError
        raise kind(
            f"{root}: generation {pointer.generation} is gone (a newer save was committed and this one removed "
            "after its grace period); start again to read the current one"
        )
    generation = generation_named(pointer, data, str(location))
    return generation, pointer


def current_generation_folder(model: str | os.PathLike) -> tuple[Path, Generation] | None:
    """The current generation's own folder of the local checkpoint ``model`` (format version 3: its pointer read,
    the document checked against it), and that generation: what to give vLLM as its ``model`` so that every file
    vLLM reads itself (config, tokenizer, generation config, at whatever moment) is that generation's, immutable.
    None where ``model`` is no such checkpoint, or its generation keeps a model file outside its own folder."""
    root = Path(model)
    if not (root / POINTER_NAME).is_file():
        return None
    found = load_generation(root.resolve())
    if found is None:
        return None
    generation = found[0]
    own = generation_dir(generation.id)
    if not generation.model_files or any(m.file.path != f"{own}/{m.name}" for m in generation.model_files):
        return None
    return root.resolve() / own, generation


def pinned_generation(location: Path | RemoteDir) -> tuple[Path | RemoteDir, Generation] | None:
    """A generation's own folder given as the checkpoint (``CKPT/generations/<id>``: vLLM's ``model`` can be it, so
    that everything vLLM reads is that generation's, immutable): the checkpoint and that generation, its document
    read from the folder (its seal is checked at load); None for any other location. A relative local path is
    taken from the working directory."""
    if isinstance(location, Path):
        location = location.resolve()
    *head, generations, folder = str(location).rstrip("/").split("/")
    if generations != GENERATIONS_DIR or not is_generation_id(folder) or not head:
        return None
    root = RemoteDir("/".join(head), location.options) if isinstance(location, RemoteDir) else Path("/".join(head))
    document = location / GENERATION_DOCUMENT
    data = _read_bounded(document, "generation document")
    if data is None:
        return None
    generation = decode_generation(data, str(document))
    if generation.id != folder:
        raise IntegrityError(f"{document}: it says it is generation {generation.id}; its folder is {folder}")
    return root, generation


def rank_of(generation: Generation, stem: str | None, where: object, vllm_version: str | None = None) -> RankRef:
    """A rank's entry in the generation's form sets (``stem`` None: the first rank of the first set), in the form set
    ``form_set_of`` picks for ``vllm_version``. A rank the generation has no manifest for is a
    ``CompatibilityError`` naming the layouts it holds."""
    ranks = [rank for form_set in generation.form_sets for rank in form_set.ranks]
    chosen = None if stem is None else form_set_of(generation, stem, vllm_version)
    for rank in ranks if chosen is None else chosen.ranks:
        if stem is None or rank.stem == stem:
            return rank
    mismatch = layout_mismatch(where, stem or "model", [rank.stem + MANIFEST_SUFFIX for rank in ranks])
    if mismatch is not None:
        raise mismatch
    raise CheckpointNotFoundError(f"{where}: generation {generation.id} has no manifest for {stem}")


def _load_rank_manifest(
    root: Path | RemoteDir, generation: Generation, stem: str | None, vllm_version: str | None = None
) -> tuple[Manifest, FileLocation]:
    rank = rank_of(generation, stem, root, vllm_version)
    location = root / rank.manifest.path
    data = _read_bounded(location, "manifest")
    if data is None:
        kind = RemoteNotFoundError if isinstance(location, RemoteFile) else CheckpointNotFoundError
        raise kind(f"{location}: the manifest generation {generation.id} names is missing; save the checkpoint again")
    if blake3_hex(data) != rank.manifest.hash:
        raise IntegrityError(
            f"{location}: its bytes are not the ones generation {generation.id} names (damaged, or replaced by "
            "hand); save the checkpoint again"
        )
    return decode_manifest(data, source=str(location)), location


def form_set_of(generation: Generation, stem: str, vllm_version: str | None = None) -> FormSet | None:
    """The form set that has a manifest for this rank's layout and place, or None. A layout has one form set per
    vLLM release (``add-form`` on a new release adds its own beside the old, so that both releases load processed):
    the one ``vllm_version`` made where there is one, else the newest."""
    at_layout = [s for s in generation.form_sets if any(rank.stem == stem for rank in s.ranks)]
    same_release = [s for s in at_layout if s.fingerprint.vllm_version == vllm_version]
    chosen = same_release or at_layout
    return chosen[-1] if chosen else None


def has_rank(generation: Generation, stem: str, vllm_version: str | None = None) -> bool:
    """Whether one of the generation's form sets has a manifest for this rank's layout and place (made by
    ``vllm_version``, where given)."""
    found = form_set_of(generation, stem, vllm_version)
    return found is not None and vllm_version in (None, found.fingerprint.vllm_version)


def load_base(
    root: Path | RemoteDir, generation: Generation, source_dir: str | os.PathLike | None = None
) -> tuple[BaseDocument, FileLocation, FileLocation]:
    """The generation's base document, its bytes checked against the generation's record of them, where it is and
    where its tensor file is (``ManifestError`` when the generation has no base). A base by reference has no tensor
    file: its source directory is returned (``source_dir``, else the one recorded at the save)."""
    if generation.base is None:
        raise ManifestError(f"{root}: generation {generation.id} has no base")
    ref = generation.base.document
    location = root / ref.path
    data = _read_bounded(location, "base document")
    if data is None:
        kind = RemoteNotFoundError if isinstance(location, RemoteFile) else CheckpointNotFoundError
        raise kind(f"{location}: the base generation {generation.id} names is missing; save the checkpoint again")
    if len(data) != ref.size or blake3_hex(data) != ref.hash:
        raise IntegrityError(
            f"{location}: its bytes are not the ones generation {generation.id} names (damaged, or replaced by "
            "hand); save the checkpoint again"
        )
    base = decode_base(data, source=str(location))
    if (base.source is not None) != (generation.base.mode == "reference"):
        raise ManifestError(f"{location}: generation {generation.id} records a base {generation.base.mode}, not this")
    if base.source is not None:
        return base, location, Path(source_dir if source_dir is not None else base.source.root)
    if base.tensor_file is None:
        raise ManifestError(f"{location}: a base inside the checkpoint names no tensor file; save the checkpoint again")
    name = base.tensor_file.path
    placed = [path for path in generation.base.tensor_files if path.rpartition("/")[2] == name]
    if len(placed) != 1 or "/" in name:
        raise ManifestError(
            f"{location}: its tensor file {name!r} is not one generation {generation.id} names; save the checkpoint "
            "again"
        )
    return base, location, root / placed[0]


def _placed_in_generation(manifest_path: FileLocation, name: str) -> FileLocation | None:
    """Where a generation keeps a tensor file its rank manifest names that is not beside it (an add-form's
    manifest names the save's tensor files, in the save's folder): read from the generation's document."""
    *root_parts, generations, folder, _ = str(manifest_path).split("/")
    if generations != GENERATIONS_DIR or not is_generation_id(folder) or not root_parts:
        return None
    root_text = "/".join(root_parts)
    root = RemoteDir(root_text, manifest_path.options) if isinstance(manifest_path, RemoteFile) else Path(root_text)
    document = root / f"{GENERATIONS_DIR}/{folder}/{GENERATION_DOCUMENT}"
    data = _read_bounded(document, "generation document")
    if data is None:
        return None
    generation = decode_generation(data, str(document))
    for rank in (rank for form_set in generation.form_sets for rank in form_set.ranks):
        if str(root / rank.manifest.path) == str(manifest_path):
            for path in rank.tensor_files:
                if path.rpartition("/")[2] == name:
                    return root / path
    return None


def check_one_save(
    manifest: Manifest, stem: str, checkpoint: str | Path | RemoteDir, remote: RemoteOptions | None = None
) -> None:
    """A sharded checkpoint's ranks come from one save (``Manifest.save_id``): the other ranks' manifests are
    read (only they) and a mix is an ``IntegrityError`` naming the ranks of each save, before any tensor is
    read. Each rank of a save commits its own manifest, so a save that failed on some ranks after others
    committed leaves such a mix. Ranks that all predate save ids (None) pass."""
    layout = parallel_layout(stem)
    if layout is None or layout == (1, 1):
        return
    tp_size, pp_size = layout
    by_save: dict[str | None, list[str]] = {}
    for pp_rank in range(pp_size):
        for tp_rank in range(tp_size):
            other = checkpoint_stem(tp_rank, tp_size, pp_rank, pp_size)
            save_id = manifest.save_id if other == stem else load_manifest(checkpoint, other, remote)[0].save_id
            by_save.setdefault(save_id, []).append(other)
    if len(by_save) > 1:
        saves = "; ".join(
            f"{', '.join(stems)} by {'save ' + save_id if save_id else 'a save without an id (an older version)'}"
            for save_id, stems in by_save.items()
        )
        raise IntegrityError(
            f"{checkpoint}: its ranks were written by different saves ({saves}): a sharded save failed on some "
            "ranks after the others had committed. Nothing was loaded; save the checkpoint again"
        )


def read_manifest(
    path: str | Path | RemoteFile | RemoteDir, stem: str | None = None, remote: RemoteOptions | None = None
) -> Manifest:
    """The manifest of a checkpoint directory, URI or manifest file (no torch, no vLLM)."""
    return load_manifest(path, stem, remote)[0]


def resolve_tensor_file(
    manifest: Manifest, manifest_path: FileLocation, ref: TensorFileRef | None = None
) -> FileLocation:
    """The tensor file (``ref``'s, an added form's; by default the manifest's own): a plain name inside the
    checkpoint directory (or beside a remote manifest), no link out."""
    name = (ref or manifest.tensor_file).path
    if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith("~") or "\0" in name:
        raise ManifestError(
            f"{manifest_path}: tensor file {name!r} must be a plain file name inside the checkpoint directory"
        )
    if isinstance(manifest_path, RemoteFile):
        if any(c in name for c in "?#%") or any(ord(c) < 32 for c in name):
            raise ManifestError(f"{manifest_path}: tensor file {name[:80]!r} is not a plain object name")
        remote_path = manifest_path.parent / name
        try:
            remote_path.size()
        except RemoteNotFoundError:
            placed = _placed_in_generation(manifest_path, name)
            if placed is None:
                raise RemoteNotFoundError(f"{remote_path}: the tensor file named by the manifest is missing") from None
            return placed
        return remote_path
    try:
        directory = manifest_path.parent.resolve()
        path = manifest_path.parent / name
        if path.is_symlink() and path.resolve().parent != directory:
            raise ManifestError(f"{manifest_path}: tensor file {name!r} is a link out of the checkpoint directory")
        if not path.is_file():
            placed = _placed_in_generation(manifest_path, name)
            if not isinstance(placed, Path) or not placed.is_file():  # a local manifest's is a local path, or None
                raise CheckpointNotFoundError(f"{path}: the tensor file named by the manifest is missing")
            return placed
    except TensorizerManifestError:
        raise
    except OSError as exc:  # e.g. a name longer than the file system allows
        raise ManifestError(
            f"{manifest_path}: tensor file {name[:80]!r} cannot be used ({exc.strerror or exc})"
        ) from None
    return path


def _read_key_file(path: str | os.PathLike, source: str, what: str) -> bytes:
    """A key file's bytes exactly (a trailing newline included); messages never show its name or content:
    a key pasted where its path belongs must not end up in a log."""
    try:
        with open(path, "rb") as f:
            material = f.read(MAX_SIGNING_KEY_BYTES + 1)
    except OSError as exc:
        raise ConfigurationError(
            f"the {what} file given by {source} cannot be read ({exc.strerror or type(exc).__name__}); "
            "it must be the path of a file holding the key, not the key itself"
        ) from None
    if len(material) > MAX_SIGNING_KEY_BYTES:
        raise ConfigurationError(
            f"the {what} file given by {source} is over {MAX_SIGNING_KEY_BYTES} bytes: not a key file"
        )
    return material


def read_signing_key(path: str | os.PathLike, source: str = "signing_key_file") -> SigningKey:
    """The key in a file: its bytes exactly (a trailing newline included), at least 16 of them."""
    return _read_key(SigningKey, "signing key", path, source)


def read_encryption_key(path: str | os.PathLike, source: str = "encryption_key_file") -> EncryptionKey:
    """The encryption key in a file, under the signing key's rules (its bytes exactly, 16 bytes to 64 KiB)."""
    return _read_key(EncryptionKey, "encryption key", path, source)


def _read_key(key_class: type[_Key], what: str, path: str | os.PathLike, source: str) -> _Key:
    material = _read_key_file(path, source, what)
    try:
        return key_class(material)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{source}: {exc}") from None


def signing_key_from(path: str | os.PathLike | None) -> SigningKey | None:
    """The signing key of an entry point: the file its option names, else the file ``$TENSORIZER_MANIFEST_SIGNING_KEY``
    names, else None (manifests are then sealed, and checked, with a plain digest)."""
    return _key_from(path, SIGNING_KEY_ENV, read_signing_key)


def encryption_key_from(path: str | os.PathLike | None) -> EncryptionKey | None:
    """The encryption key of an entry point: the file its option names, else the file
    ``$TENSORIZER_MANIFEST_ENCRYPTION_KEY`` names, else None (tensor files are then written, and read, in plain)."""
    return _key_from(path, ENCRYPTION_KEY_ENV, read_encryption_key)


def _key_from(path: str | os.PathLike | None, env: str, read: Callable[..., _Key]) -> _Key | None:
    """The key in the file ``path`` names, else in the file the variable ``env`` names, else None."""
    if path is not None:
        return read(path)
    from_env = os.environ.get(env)
    if from_env:
        return read(from_env, f"${env}")
    return None
