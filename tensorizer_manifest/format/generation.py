"""Format version 3: the pointer and the generations behind it (``docs/design.md``, "Format version 3").

A checkpoint is immutable files and one mutable object, the pointer (``Pointer``): it names the current
``Generation``, a document that names every file a load may use with its size and content hash (the model
files vLLM reads, the form sets' rank manifests, the base, compile forms) and is sealed as a manifest is. A
writer writes a new generation's files, then swaps the pointer by compare-and-swap on the generation id; ids
never repeat (``new_generation_id``), so the swap has no ABA.

Encoding: these structs leave a field at its default out through msgspec itself (``omit_defaults``), wherever it
sits, so fields can be appended without touching the bytes of documents that do not use them. The version-2
``Manifest`` keeps its own frozen encoding (``schema._encode``). No torch, no vLLM.
"""

from __future__ import annotations

import os
import re
import time
from typing import Annotated, Literal

import msgspec

from ..errors import IntegrityError, ManifestError
from .schema import (
    ContentHash,
    EncryptionKey,
    Fingerprint,
    Seal,
    SealMode,
    SigningKey,
    Size,
    TensorFileRef,
    TensorRecord,
    blake3_hex,
    format_version_of,
    refuse_a_newer_format,
    seal_mode,
    sealed_hash_of,
)

GENERATIONS_FORMAT_VERSION = 3
"""The first format version with a pointer and generations."""
POINTER_NAME = "tensorizer-manifest.json"
"""The pointer's name at the checkpoint's top: the one file writers replace."""
GENERATIONS_DIR = "generations"
"""Each generation's own files are under ``generations/<id>/``."""
GENERATION_DOCUMENT = "generation.json"
COMMIT_MARK = "committed"
"""Written into a generation's folder by its writer just after the pointer swap that committed it (the pointer's
bytes, create-only): its timestamp, by the storage's clock, is when the generation's parent stopped being current
(``gc``'s grace runs from it). Named by no document; readers never need it."""
STUB = b'{"format_version": 3, "pointer": "' + POINTER_NAME.encode() + b'"}\n'
"""What a reader of format version 1 or 2 finds at a rank's old manifest name: "version 3, upgrade" (constant
bytes, so writing it again changes nothing), never the manifest of an older save."""

_GENERATION_ID = r"^[0-9]{8}T[0-9]{6}Z-[0-9a-f]{32}$"
GenerationId = Annotated[str, msgspec.Meta(pattern=_GENERATION_ID)]
"""``<UTC yyyymmddTHHMMSSZ>-<32 random hex digits>``: the time is for people; the random part makes it unique."""

#: A path inside the checkpoint: relative, ``/``-separated, no ``..``, no empty or hidden part. Checked by the
#: type, so that no decoded document names a file outside its checkpoint.
INSIDE_PATTERN = r"^(?!.*(^|/)\.)(?!.*//)[A-Za-z0-9_][A-Za-z0-9_.+=,@-]*(/[A-Za-z0-9_][A-Za-z0-9_.+=,@-]*)*$"
InsidePath = Annotated[str, msgspec.Meta(pattern=INSIDE_PATTERN, max_length=512)]

MadeBy = Literal["save", "add-form", "add-form-compile", "migrate"]
BaseMode = Literal["inside", "reference"]


class _GenerationStruct(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    """Base of the version-3 types: a field at its default is left out of the encoding by msgspec."""


class FileRef(_GenerationStruct, kw_only=True):
    """A file of the checkpoint, as a generation names it: where, how large, what bytes."""

    path: InsidePath
    size: Size
    hash: ContentHash


class ModelFile(_GenerationStruct, kw_only=True):
    """A file vLLM reads from its ``model`` directory (config, tokenizer, generation config): its name there, and
    the generation's own copy."""

    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.+=,@-]*$", max_length=255)]
    file: FileRef


class Layout(_GenerationStruct, kw_only=True):
    """A parallel layout: tensor-, pipeline- and expert-parallel sizes."""

    tp: Annotated[int, msgspec.Meta(ge=1)] = 1
    pp: Annotated[int, msgspec.Meta(ge=1)] = 1
    ep: Annotated[int, msgspec.Meta(ge=1)] = 1


class RankRef(_GenerationStruct, kw_only=True):
    """One rank's manifest in a form set (``model-tp0-of-2``...)."""

    stem: Annotated[str, msgspec.Meta(pattern=r"^model(-tp\d+-of-\d+)?(-pp\d+-of-\d+)?$")]
    manifest: FileRef
    tensor_files: list[InsidePath] = []
    """Where each tensor file the manifest names is (its own and its added forms'): the manifest names them by
    file name, and a generation that keeps an earlier one's files (an add-form) names them in that one's folder.
    Their content is bound by the manifest (digest, prefix and head hashes, content hashes)."""


class FormSet(_GenerationStruct, kw_only=True):
    """Every rank's manifest for one parallel layout, as one engine (machine kind, vLLM) made them."""

    layout: Layout
    fingerprint: Fingerprint
    ranks: list[RankRef]


class BaseRef(_GenerationStruct, kw_only=True):
    """The layout-free base: the source's tensors under the source's names, in the checkpoint (``inside``)
    or in the source's own files, named with their hashes (``reference``)."""

    mode: BaseMode
    document: FileRef
    tensor_files: list[InsidePath] = []
    """Where the base's tensor files are (the document names them by file name; a later generation that keeps
    the base names them in the folder of the generation that wrote them). Bound by the document's records."""


BASE_DOCUMENT = "base.manifest.json"
"""The base's document in its generation's folder."""

#: A file name in the source directory (safetensors files are flat there): no separator, no hidden name.
SourceFileName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.+=,@-]*$", max_length=255)]


class SourceFile(_GenerationStruct, kw_only=True):
    """One safetensors file of the source a base by reference reads: its size when saved, and the base tensors
    in it (each checked by its record's content hash as it is read)."""

    name: SourceFileName
    size: Size
    tensors: list[str]


class SourceFiles(_GenerationStruct, kw_only=True):
    """A base by reference (``BaseRef.mode == "reference"``): the source's own files, where the save found them."""

    root: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    """The source directory at the save (absolute); a load may name another (``base_source_dir``)."""
    files: list[SourceFile]


class BaseDocument(_GenerationStruct, kw_only=True):
    """The layout-free base: the source's tensors as vLLM's default loader reads them, under the names the
    model's ``load_weights`` takes, and which module each one was observed to fill.

    A loader whose layout, machine or vLLM fits no form set feeds a layer the tensors that ``consumers`` say it
    took, through the model's own ``load_weights`` (vLLM shards them for its rank), then runs vLLM's post-load
    step on it once. Nothing here depends on the parallel layout or on vLLM's internal names."""

    format_version: Annotated[int, msgspec.Meta(ge=GENERATIONS_FORMAT_VERSION)]
    observed: Layout
    """The layout of the engine whose weight loaders were watched (module paths do not depend on it)."""
    tensor_file: TensorFileRef | None = None
    """The base's tensor file, checked as a form's is (size, prefix, head hash, index, records' digest); None for a
    base by reference (``source``)."""
    tensors: list[TensorRecord]
    """One per source tensor, in the order vLLM's loader read them: ``key`` is the source's name."""
    consumers: dict[str, list[str]] = {}
    """Source name -> the module paths whose parameters vLLM's weight loaders filled from it; a name that is not
    here filled none (a rotary table the model recomputes, a tied head)."""
    loaded: dict[str, list[str]] = {}
    """Module path -> the parameters vLLM's weight loaders filled at the save: a load from the base must fill
    them all again, or it is refused."""
    source: SourceFiles | None = None
    """A base by reference: the tensors are read from the source's own safetensors files, not from a file of the
    checkpoint (no extra disk; the checkpoint is then not self-contained)."""

    def needed_by(self, modules: set[str]) -> list[TensorRecord]:
        """The records of the source tensors that fill any of ``modules``, in file order."""
        return [t for t in self.tensors if any(path in modules for path in self.consumers.get(t.name, ()))]


class CompileFile(_GenerationStruct, kw_only=True):
    """One artifact of a compile form, at ``offset`` in its archive."""

    path: InsidePath
    offset: Size
    size: Size
    hash: ContentHash


class CompileForm(_GenerationStruct, kw_only=True):
    """What a cold engine of one machine kind would compile: used only under a verified seal."""

    machine: list[str]
    vllm_version: str
    torch_version: str
    config_hash: str
    """vLLM's hash of the engine settings that shape the compiled graphs (the model's path set aside): decides."""
    settings: dict[str, str] = {}
    """The main ones of those settings in words (layout, dtype, context and batch sizes): what ``inspect`` shows,
    and what a load names when the hash differs."""
    aot: bool = False
    archive: FileRef
    files: list[CompileFile] = []


class Generation(_GenerationStruct, kw_only=True):
    """One immutable version of a checkpoint: every file a load may use, with its hash."""

    format_version: Annotated[int, msgspec.Meta(ge=GENERATIONS_FORMAT_VERSION)]
    id: GenerationId
    parent: GenerationId | None = None
    """The generation this one replaced: what ``gc`` walks."""
    producer: str
    made_by: MadeBy
    model_files: list[ModelFile] = []
    base: BaseRef | None = None
    """None: no base, the layout is pinned (as in version 2)."""
    form_sets: list[FormSet] = []
    compile_forms: list[CompileForm] = []
    seal: Seal | None = None
    """Over every other field (``generation_seal_hash``); every document is sealed when written."""

    def named_paths(self) -> list[str]:
        """Every file this generation names (its own document aside), in document order."""
        paths = [m.file.path for m in self.model_files]
        if self.base is not None:
            paths += [self.base.document.path, *self.base.tensor_files]
        paths += [path for s in self.form_sets for r in s.ranks for path in (r.manifest.path, *r.tensor_files)]
        paths += [c.archive.path for c in self.compile_forms]
        return paths


class Pointer(_GenerationStruct, kw_only=True):
    """The current generation of a checkpoint: its id, its document and the hash of the document's bytes."""

    format_version: Annotated[int, msgspec.Meta(ge=GENERATIONS_FORMAT_VERSION)]
    generation: GenerationId
    document: InsidePath
    hash: ContentHash


def new_generation_id(now: float | None = None) -> str:
    """A generation id that never repeats: the UTC time (for people and listings) and 128 random bits."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{os.urandom(16).hex()}"


def generation_document_path(generation_id: str) -> str:
    """``generations/<id>/generation.json``."""
    return f"{GENERATIONS_DIR}/{generation_id}/{GENERATION_DOCUMENT}"


def commit_mark_path(generation_id: str) -> str:
    """``generations/<id>/committed``."""
    return f"{GENERATIONS_DIR}/{generation_id}/{COMMIT_MARK}"


def generation_dir(generation_id: str) -> str:
    """``generations/<id>``: where a generation's own files are written."""
    return f"{GENERATIONS_DIR}/{generation_id}"


_encoder = msgspec.json.Encoder()
_pointer_decoder = msgspec.json.Decoder(Pointer)
_generation_decoder = msgspec.json.Decoder(Generation)
_base_decoder = msgspec.json.Decoder(BaseDocument)


#: The seal's header: what it covers is a version-3 document (a version-2 manifest's seal starts ``seal v1``).
_SEAL_HEAD = "tensorizer-manifest seal v3 {mode}\n"


def canonical_generation_bytes(generation: Generation, mode: SealMode) -> bytes:
    """What a generation's seal covers: the header with its mode, then its compact encoding without the seal."""
    return _SEAL_HEAD.format(mode=mode).encode() + _encoder.encode(msgspec.structs.replace(generation, seal=None))


def generation_seal_hash(
    generation: Generation,
    mode: SealMode,
    key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
) -> str:
    """The seal's hash in ``mode``, keyed as a manifest's is (``schema.sealed_hash_of``)."""
    return sealed_hash_of(canonical_generation_bytes(generation, mode), mode, key, encryption_key)


def seal_generation(
    generation: Generation, key: SigningKey | None = None, encryption_key: EncryptionKey | None = None
) -> Generation:
    """The generation with its seal (the mode from the keys given, as for a manifest)."""
    mode = seal_mode(key, encryption_key)
    seal = Seal(mode=mode, hash=generation_seal_hash(generation, mode, key, encryption_key))
    return msgspec.structs.replace(generation, seal=seal)


def encode_generation(generation: Generation) -> bytes:
    """Pretty JSON, as manifests are written: read by people as well as machines."""
    return msgspec.json.format(_encoder.encode(generation), indent=1) + b"\n"


def encode_base(base: BaseDocument) -> bytes:
    """Compact JSON: a base names every source tensor, and no person reads it whole (``inspect`` does)."""
    return _encoder.encode(base) + b"\n"


def decode_base(data: bytes, source: str = "base") -> BaseDocument:
    """Decode a base document; failures as ``decode_pointer``'s. It names its tensors' bytes one way: a tensor file
    of the checkpoint, or the source's files (a base by reference)."""
    base = _decode(_base_decoder, data, source, "base document")
    if (base.tensor_file is None) == (base.source is None):
        raise ManifestError(f"{source}: a base names either its tensor file or its source files, one of the two")
    return base


def encode_pointer(pointer: Pointer, compact: bool = False) -> bytes:
    """Pretty JSON, or ``compact`` (what the first rank broadcasts to the others)."""
    data = _encoder.encode(pointer)
    return data if compact else msgspec.json.format(data, indent=1) + b"\n"


def pointer_to(generation_id: str, document: bytes) -> Pointer:
    """The pointer to a generation whose document's bytes are ``document``."""
    return Pointer(
        format_version=GENERATIONS_FORMAT_VERSION,
        generation=generation_id,
        document=generation_document_path(generation_id),
        hash=blake3_hex(document),
    )


def decode_pointer(data: bytes, source: str = "pointer") -> Pointer:
    """Decode a pointer; a damaged one is a ``ManifestError`` naming its location, a newer format refused as such."""
    pointer = _decode(_pointer_decoder, data, source, "pointer")
    if pointer.document != generation_document_path(pointer.generation):
        raise ManifestError(
            f"{source}: the pointer names generation {pointer.generation} but the document {pointer.document}; "
            "it was edited by hand or damaged: restore it, or save the checkpoint again"
        )
    return pointer


def decode_generation(data: bytes, source: str = "generation") -> Generation:
    """Decode a generation document; failures as ``decode_pointer``'s."""
    return _decode(_generation_decoder, data, source, "generation document")


def generation_named(pointer: Pointer, document: bytes, source: str) -> Generation:
    """The generation ``pointer`` names, from its document's bytes: the bytes must be the ones the pointer's hash
    names, and the document the generation the pointer names (``IntegrityError`` otherwise)."""
    if blake3_hex(document) != pointer.hash:
        raise IntegrityError(
            f"{source}: its bytes are not the ones the pointer names (damaged, or replaced by hand): restore it, "
            "or save the checkpoint again"
        )
    generation = decode_generation(document, source)
    if generation.id != pointer.generation:
        raise IntegrityError(
            f"{source}: it says it is generation {generation.id}, the pointer names {pointer.generation}"
        )
    return generation


def _decode(decoder: msgspec.json.Decoder, data: bytes, source: str, what: str):
    if not data or data.isspace():
        raise ManifestError(f"{source}: the {what} is empty; save the checkpoint again")
    try:
        document = decoder.decode(data)
    except msgspec.ValidationError as exc:
        refuse_a_newer_format(format_version_of(data), source, GENERATIONS_FORMAT_VERSION, "format version")
        raise ManifestError(f"{source}: {exc}; the {what} is damaged or was edited by hand") from None
    except msgspec.DecodeError as exc:
        raise ManifestError(f"{source}: not valid JSON ({exc}); the {what} is damaged") from None
    except RecursionError:
        raise ManifestError(f"{source}: JSON nested too deeply to be a {what}") from None
    # A newer version whose fields this one knows.
    refuse_a_newer_format(document.format_version, source, GENERATIONS_FORMAT_VERSION, "format version")
    return document


def is_generation_id(text: str) -> bool:
    return re.fullmatch(_GENERATION_ID, text) is not None


def json_schema() -> dict:
    """The JSON Schema of the version-3 documents: the pointer, the generation and the base (``$defs`` hold them)."""
    (pointer, generation, base), components = msgspec.json.schema_components([Pointer, Generation, BaseDocument])
    return {"anyOf": [pointer, generation, base], "$defs": components}
