"""A rank's manifest (format versions 1 and 2, and each rank of version 3): msgspec types, constraints, encoding.

Everything that defines what a manifest *is* lives here: the structs, the rules
that bind records together (``full_name``, ``digest_records``), which values a
manifest may carry (``plain_value``), which dtypes and Parameter classes it may
name. No torch, no vLLM: ``inspect`` answers fast.

Schema evolution rules (after msgspec's): a new field must have a default;
a field's type never changes, except to accept more values; fields are only
appended; anything that old readers would misread bumps ``FORMAT_VERSION``.
A reader refuses a manifest whose ``format_version`` is newer than its own,
naming both versions. Constraints (hash pattern, non-negative sizes, known
dtypes) are msgspec ``Meta`` so that the published JSON Schema carries them.

The seal (``Manifest.seal``) covers every field: a blake3 of the manifest's
msgspec encoding with the seal itself null (``canonical_bytes``), keyed when a
signing key is given. A field added after the seal must be left out of the
canonical bytes while it holds its default, or every older seal breaks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Final, Literal, get_args

import blake3
import msgspec

from ..errors import ConfigurationError, ManifestError, ManifestVersionError

FORMAT_VERSION = 2
"""The newest format this version reads and writes. A manifest is written at the lowest version that holds
everything in it (``required_format_version``): one without fallbacks is version 1, which every earlier
reader reads."""
FALLBACKS_FORMAT_VERSION = 2
"""The first version with raw fallbacks (``ModuleRecord.fallback``)."""
MANIFEST_SUFFIX = ".manifest.json"
TENSORS_SUFFIX = ".tensors"

#: Replay values that are not restorer names.
REPLAY_POST_LOAD = "post_load"
"""A raw layer: vLLM's own post-load step runs on it, once."""
REPLAY_NONE = "none"
"""The post-load step changed nothing on this layer."""

#: Modules whose Parameter classes a manifest may name: the loader never builds anything else.
#: Where a recorded Parameter class may come from: torch, vLLM's parameters, and vLLM's KV-cache scales
#: (``KVCacheScaleParameter``: the raw q/k/v/prob scales of an FP8 model's attention layers).
ALLOWED_PARAM_MODULES = (
    "torch.nn.parameter",
    "vllm.model_executor.parameter",
    "vllm.model_executor.layers.quantization.kv_cache",
)

DType = Literal[
    "float64", "float32", "float16", "bfloat16",
    "int64", "int32", "int16", "int8",
    "uint64", "uint32", "uint16", "uint8",
    "bool", "complex64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
]  # fmt: skip
"""torch dtypes a tensor record may have, named without the ``torch.`` prefix."""

#: Bytes per element of every ``DType``.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1, "complex64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}  # fmt: skip
assert set(DTYPE_ITEMSIZE) == set(get_args(DType)), "DType and DTYPE_ITEMSIZE must name the same dtypes"

ContentHash = Annotated[str, msgspec.Meta(pattern=r"^blake3:[0-9a-f]{64}$")]
"""``blake3:`` and 64 lowercase hex digits."""
Size = Annotated[int, msgspec.Meta(ge=0)]

#: JSON-safe values a manifest may carry for runtime attributes and Parameter attributes.
PlainScalar = bool | int | float | str
PlainValue = None | bool | int | float | str | list[PlainScalar]

LayerState = Literal["raw", "processed"]
TensorKind = Literal["parameter", "buffer"]


def plain_value(value: object) -> tuple[bool, PlainValue]:
    """Whether ``value`` is one a manifest can carry, and its JSON form (tuples become lists).

    The one definition of "plain": capture copies exactly these Parameter
    attributes and the manifest records exactly these, so nothing copied at
    save time is dropped on the way to the file.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return True, value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return True, list(value)
    return False, None


def qualified_class(obj_or_cls: object) -> str:
    """``module.QualName`` of a class or of an object's class: how the manifest names classes."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return f"{cls.__module__}.{cls.__qualname__}"


def full_name(path: str, name: str) -> str:
    """A tensor's name in the whole model: ``module.path.name`` (``name`` at the root)."""
    return f"{path}.{name}" if path else name


class _Struct(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=False, gc=False):
    """Base of the manifest types. ``gc=False``: a manifest is a tree (no cycles), so the garbage
    collector need not track its records, which keeps decoding 100k of them linear."""


class TensorRecord(_Struct, kw_only=True):
    """One tensor of a module, exactly as the model held it."""

    name: str
    """Attribute name on the module (``weight``, ``_k_scale``...)."""
    kind: TensorKind
    persistent: bool = True
    dtype: DType
    """torch dtype without the ``torch.`` prefix (``bfloat16``, ``int8``)."""
    shape: list[Size]
    stride: list[Size]
    storage_offset: Size = 0
    requires_grad: bool = False
    param_class: str | None = None
    """Qualified class of a Parameter (vLLM subclasses included); None for buffers."""
    param_attrs: dict[str, PlainValue] = {}
    """Plain attributes vLLM sets on its Parameters (``input_dim``, ``output_dim``...)."""
    nbytes: Size
    hash: ContentHash
    """``blake3:<hex>`` of the tensor's bytes in row-major order."""
    key: str | None = None
    """Name of the tensor in the tensor file; None when nothing is stored (alias or empty)."""
    alias_of: str | None = None
    """Full name (``module.path.name``) of the tensor this one is the same object as."""


class KernelRecord(_Struct, kw_only=True):
    """An object (or callable) the layer's forward dispatches to."""

    owner: str
    """Where it hangs: ``quant_method``, ``scheme`` or ``layer``."""
    attr: str
    kernel_class: str


def kernel_map(kernels: Iterable[KernelRecord]) -> dict[tuple[str, str], str]:
    """``(owner, attr) -> kernel_class``: how kernels of a layer are compared."""
    return {(k.owner, k.attr): k.kernel_class for k in kernels}


class RuntimeAttr(_Struct, kw_only=True):
    """State the layer needs at forward time that no saved tensor carries."""

    owner: str
    name: str
    type: str
    rebuilt_by: str
    """``post_load`` for raw layers, the restorer's name for processed ones."""
    value: PlainValue = None
    """The value after the post-load step, when it is a plain value (checked after replay)."""


class ModuleRecord(_Struct, kw_only=True):
    path: str
    module_class: str
    quant_method: str | None = None
    kernels: list[KernelRecord] = []
    state: LayerState
    replay: str
    """``post_load`` (raw), ``none`` (nothing to rebuild) or a restorer name (processed)."""
    tensors: list[TensorRecord] = []
    runtime_state: list[RuntimeAttr] = []
    form: dict[str, PlainValue] = {}
    """For a processed layer, what decided the layout of its tensors on the saving machine (the kernel's
    ISA, its flags, the experts class): the loader refuses, before reading weights, a layer whose form
    this machine would not produce. Empty when the layout is the same everywhere."""
    verified: bool | None = None
    """For a layer a restorer replays: False when its restorer was not verified on the saving device
    kind and the user opted in (``--allow-unverified``); None for raw layers and older manifests."""
    fallback: list[TensorRecord] = []
    """Format version 2. For a processed layer whose form belongs to one machine kind or one kernel, its
    tensors as a raw layer holds them (before vLLM's step), stored after every layer's own tensors: a loader
    whose machine or vLLM would not produce the processed form reads these instead and runs vLLM's step once.
    Left out of the encoding while empty (``_encode``), so that version-1 manifests stay what they were."""


class Fingerprint(_Struct, kw_only=True):
    """What the saving engine was. ``fingerprint.py`` says what must match at load."""

    vllm_version: str
    torch_version: str
    tensorizer_version: str
    architectures: list[str]
    model_class: str
    dtype: str
    quantization: str | None
    quant_config_hash: str | None
    kv_cache_dtype: str
    tensor_parallel_size: int
    tensor_parallel_rank: int
    pipeline_parallel_size: int
    pipeline_parallel_rank: int
    data_parallel_size: int = 1
    device_type: str
    device_capability: str | None = None
    cpu_onednn: bool | None = None
    data_parallel_rank: int = 0
    expert_parallel: bool = False
    linear_backend: str | None = None
    moe_backend: str | None = None
    revision: str | None = None
    cpu_features: list[str] = []
    """The CPU's instruction-set features that steer vLLM's CPU kernels (``AVX512``, ``AMX``...)."""


#: tensorizer's own encryption (libsodium XSalsa20-Poly1305, authenticated per chunk) of every tensor's data,
#: under a 32-byte key derived from the user's key file with blake3 ``derive_key`` (``EncryptionKey``).
ENCRYPTION_TENSORIZER: Final = "tensorizer-xsalsa20poly1305-blake3-key"
Encryption = Literal["none", "tensorizer-xsalsa20poly1305-blake3-key"]
assert ENCRYPTION_TENSORIZER in get_args(Encryption)


class TensorFileRef(_Struct, kw_only=True):
    path: str
    """File name relative to the checkpoint directory."""
    size: Size
    tensor_count: Size
    digest: ContentHash
    """``blake3:<hex>`` over every record's name and form (``digest_records``): binds manifest and tensor file."""
    head_hash: ContentHash | None = None
    """``blake3:<hex>`` of every byte of the file that is not tensor data (``tensor_file.head_hash``)."""
    prefix_size: Size | None = None
    """Bytes before the first tensor's own header: tensorizer's file header and index, all that tensorizer
    parses when it opens the file. None in manifests written by 0.2.0 and older."""
    prefix_hash: ContentHash | None = None
    """``blake3:<hex>`` of those bytes, checked with plain reads before tensorizer sees the file."""
    encryption: Encryption = "none"
    """How the tensor data is encrypted (``ENCRYPTION_TENSORIZER``), or ``none``. Headers and index stay
    plain; content hashes are of the plaintext tensors. Added after the seal: ``canonical_bytes`` leaves it
    out while it is ``none``."""


SealMode = Literal["digest", "mac", "mac-encryption-key"]


class Seal(_Struct, kw_only=True):
    """Binds every field of the manifest, so that no edit goes unnoticed (``seal_manifest``)."""

    mode: SealMode
    """``digest``: plain blake3, catches edits and damage. ``mac``: keyed by a signing key, which is never recorded.
    ``mac-encryption-key``: keyed by a key derived from the encryption key (an encrypted checkpoint saved
    without a signing key)."""
    hash: ContentHash


# ``omit_defaults``: its one defaulted field, ``base``, is left out of the encoding while None, as forms were before
# it (their seals hold). (A comment, not the docstring: the docstring is the JSON Schema's description.)
class AddedForm(_Struct, kw_only=True, omit_defaults=True):
    """Format version 2. The processed form of some layers as another engine makes it (``add-form``: another
    machine kind, or another vLLM), from their raw fallbacks, in a tensor file of its own."""

    fingerprint: Fingerprint
    """The engine that made it: a loader takes these records only where its machine and vLLM fit them."""
    tensor_file: TensorFileRef
    modules: list[ModuleRecord]
    """One processed record per layer it covers (each a layer of the manifest with a raw fallback)."""
    base: ContentHash | None = None
    """``form_base`` of the layers it covers when it was made: the raw fallbacks it was made from. A loader uses
    the form only while the manifest's fallbacks for those layers are still these (a form without it is
    skipped)."""

    def module_map(self) -> dict[str, ModuleRecord]:
        return {m.path: m for m in self.modules}


class UnreadableForm:
    """An added form this version cannot decode: a field, or a value, that a newer tensorizer-manifest wrote.

    It is never used (a loader skips it, saying ``reason``), and it is kept as its compact JSON, so that the
    seal still matches and a writer that re-seals the manifest (``add-form``) carries it over unchanged: one
    writer never drops another's work. Decoding forms one by one is what lets a form gain a field without
    making every older reader refuse the whole checkpoint."""

    __slots__ = ("raw", "reason")

    def __init__(self, raw: bytes, reason: str):
        self.raw = msgspec.Raw(raw)
        self.reason = reason

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnreadableForm) and bytes(self.raw) == bytes(other.raw)

    def __repr__(self) -> str:
        return f"UnreadableForm({self.reason!r})"


class Manifest(_Struct, kw_only=True):
    format_version: Annotated[int, msgspec.Meta(ge=1)]
    producer: str
    fingerprint: Fingerprint
    tensor_file: TensorFileRef
    modules: list[ModuleRecord]
    seal: Seal | None = None
    """None in manifests written by 0.2.0 and older: loadable, reported as not sealed."""
    added_forms: list[AddedForm] = []
    """Format version 2. Processed forms that other engines added (``add-form``), oldest first. Left out of
    the encoding while empty (``_encode``). ``decode_manifest`` puts an ``UnreadableForm`` where a form cannot
    be decoded by this version (``readable_forms``)."""
    save_id: str | None = None
    """Format version 2. Shared by every rank's manifest of one sharded save (tensor or pipeline parallel):
    a loader refuses ranks of different saves (a save whose rank failed) before reading. None for one rank,
    and left out of the encoding while None."""

    def module_map(self) -> dict[str, ModuleRecord]:
        return {m.path: m for m in self.modules}

    def ordered_records(self) -> list[tuple[str, TensorRecord]]:
        """Every tensor record with its full name, in manifest order (what the digest covers): each layer's
        own, then the raw fallbacks (``fallback_records``)."""
        return [(full_name(m.path, t.name), t) for m in self.modules for t in m.tensors] + self.fallback_records()

    def fallback_records(self) -> list[tuple[str, TensorRecord]]:
        """The raw fallbacks' records, named ``fallback_name(full name)``, in manifest order."""
        return [(fallback_name(full_name(m.path, t.name)), t) for m in self.modules for t in m.fallback]

    def tensor_file_names(self) -> list[str]:
        """The tensor files it names: its own first, then its readable added forms'."""
        return [self.tensor_file.path, *(form.tensor_file.path for _, form in self.readable_forms())]

    def readable_forms(self) -> list[tuple[int, AddedForm]]:
        """The added forms this version can decode, with their index in ``added_forms``."""
        return [(index, form) for index, form in enumerate(self.added_forms) if isinstance(form, AddedForm)]


def held_by_base(record: TensorRecord) -> bool:
    """Whether this record's bytes are not in its tensor file but in the generation's base: a tensor with
    bytes, no key and no alias. A form set stores only what vLLM's step changed; a layer whose tensors are what
    vLLM's weight loaders make from the source (a raw layer, one the step left alone, a raw fallback) is fed
    from the base at load, and its records keep the names, forms and content hashes it must come back with."""
    return record.key is None and record.alias_of is None and record.nbytes > 0


def fed_from_base(records: Iterable[TensorRecord]) -> bool:
    """Whether a layer's tensors (its own, or its raw fallback) come from the base: any of them does (all of
    them must: ``checks.records``)."""
    return any(held_by_base(record) for record in records)


#: Prefix of a raw fallback tensor's full name (and key in the tensor file): it never names a module.
FALLBACK_PREFIX = "fallback:"


def fallback_name(name: str) -> str:
    """The full name of a layer tensor's raw fallback (``fallback:model.layers.0.mlp.experts.w13_weight``)."""
    return FALLBACK_PREFIX + name


def required_format_version(manifest: Manifest) -> int:
    """The lowest format version that holds everything in ``manifest``: what it is written as."""
    if manifest.added_forms or manifest.save_id is not None or any(m.fallback for m in manifest.modules):
        return FALLBACKS_FORMAT_VERSION
    return 1


def form_base(manifest: Manifest, paths: Iterable[str]) -> str:
    """What an added form of the layers ``paths`` is made from: the digest of those layers' raw fallback
    records in ``manifest`` (names, forms and content hashes), in manifest order."""
    covered = set(paths)
    return digest_records(
        (fallback_name(full_name(m.path, t.name)), t) for m in manifest.modules if m.path in covered for t in m.fallback
    )


def digest_records(ordered: Iterable[tuple[str, TensorRecord]]) -> str:
    """One hash over every record's full name and form (also of records that store nothing)."""
    return digest_of_lines([digest_line(name, r) for name, r in ordered])


def digest_line(name: str, r: TensorRecord) -> str:
    """One record's line of the digest (part of the format: old manifests' digests must keep matching)."""
    return repr((name, r.kind, r.dtype, r.shape, r.stride, r.storage_offset, r.nbytes, r.key, r.alias_of, r.hash))


def digest_of_lines(lines: list[str]) -> str:
    """The digest of records already turned into ``digest_line``s, in manifest order."""
    text = "\n".join(lines) + "\n" if lines else ""
    return blake3_hex(text.encode())


#: Inputs at least this large are hashed with blake3's own threads. Below it one thread is faster: the first
#: threaded hash of a process starts blake3's thread pool (0.5 ms, measured in a fresh process), which a
#: 70 KB manifest's seal would pay for nothing. Content hashes of large tensors use every core once the
#: readers are done (measured: reading and hashing 1.07 GB on 2 cores, 0.70 -> 0.53 s).
THREADED_HASH_BYTES = 8 << 20


def blake3_hex(data: bytes | memoryview, key: bytes | None = None) -> str:
    """``blake3:<hex>`` of ``data`` (keyed when ``key`` is given); the same digest on one thread or several."""
    threads = blake3.blake3.AUTO if memoryview(data).nbytes >= THREADED_HASH_BYTES else 1
    hasher = (
        blake3.blake3(data, max_threads=threads) if key is None else blake3.blake3(data, key=key, max_threads=threads)
    )
    return "blake3:" + hasher.hexdigest()


#: blake3 ``derive_key`` context: a user's key of any length becomes the 32-byte key of the seal's MAC.
_SEAL_KEY_CONTEXT = "tensorizer-manifest 2025 manifest seal MAC key v1"
#: The key tensorizer encrypts with, derived from an encryption key file (part of the format: never change it).
_ENCRYPTION_KEY_CONTEXT = "tensorizer-manifest 2025 tensorizer encryption key v1"
#: The key of a ``mac-encryption-key`` seal, derived from the same file: distinct from the one above.
_ENCRYPTION_SEAL_CONTEXT = "tensorizer-manifest 2025 manifest seal from encryption key v1"
#: Key files shorter than this are refused: a short key can be guessed.
MIN_SIGNING_KEY_BYTES = 16


def _check_key_length(material: bytes, what: str) -> None:
    if len(material) < MIN_SIGNING_KEY_BYTES:
        raise ConfigurationError(
            f"the {what} has {len(material)} bytes; use at least {MIN_SIGNING_KEY_BYTES} random bytes "
            "(e.g. `head -c 32 /dev/urandom > KEYFILE`)"
        )


class SigningKey:
    """A signing key for ``mac`` seals. Only the key derived from it is kept, and it is never shown or pickled."""

    __slots__ = ("_derived",)

    def __init__(self, material: bytes, *, context: str = _SEAL_KEY_CONTEXT):
        _check_key_length(material, "signing key")
        self._derived = blake3.blake3(material, derive_key_context=context).digest()

    def mac(self, data: bytes) -> str:
        return blake3_hex(data, key=self._derived)

    def __repr__(self) -> str:
        return "SigningKey(<hidden>)"

    def __reduce__(self):
        raise TypeError("a SigningKey is never pickled; pass the key file's path instead")


class EncryptionKey:
    """An encryption key: two keys derived from the user's (blake3 ``derive_key``, distinct contexts), never shown.

    ``tensorizer_key()`` is the 32-byte key tensorizer encrypts the tensor data
    with; ``seal_key`` seals the manifest when no signing key is given
    (``mac-encryption-key``), so that only the key's holders can make a seal an
    encrypted checkpoint's loader accepts. Neither reveals the other or the file.
    """

    __slots__ = ("_key", "seal_key")

    def __init__(self, material: bytes):
        _check_key_length(material, "encryption key")
        self._key = blake3.blake3(material, derive_key_context=_ENCRYPTION_KEY_CONTEXT).digest()
        self.seal_key = SigningKey(material, context=_ENCRYPTION_SEAL_CONTEXT)

    def tensorizer_key(self) -> bytes:
        """The 32 bytes given to tensorizer's ``EncryptionParams`` / ``DecryptionParams.from_key``."""
        return self._key

    def __repr__(self) -> str:
        return "EncryptionKey(<hidden>)"

    def __reduce__(self):
        raise TypeError("an EncryptionKey is never pickled; pass the key file's path instead")


def canonical_bytes(manifest: Manifest, mode: SealMode) -> bytes:
    """What a seal covers: its mode, then the compact msgspec encoding of the manifest with the seal null.

    msgspec writes struct fields in declaration order, so the bytes depend on the
    values alone; the mode is inside, so a ``mac`` seal cannot pass as a ``digest``.
    Fields added after the seal existed are left out while they hold their default
    (``tensor_file.encryption``), so that seals made before them still match.
    """
    head = f"tensorizer-manifest seal v1 {mode}\n".encode()
    replaced: dict[str, object] = {"seal": None}
    if manifest.tensor_file.encryption == "none":
        ref = msgspec.structs.asdict(manifest.tensor_file)
        del ref["encryption"]
        replaced["tensor_file"] = ref  # a dict in field order encodes as the struct did before the field
    return head + _encode(msgspec.structs.replace(manifest, **replaced))


def seal_hash(
    manifest: Manifest, mode: SealMode, key: SigningKey | None = None, encryption_key: EncryptionKey | None = None
) -> str:
    """The seal's hash in ``mode``: ``mac`` needs the signing key, ``mac-encryption-key`` the encryption key."""
    return sealed_hash_of(canonical_bytes(manifest, mode), mode, key, encryption_key)


def sealed_hash_of(
    data: bytes, mode: SealMode, key: SigningKey | None = None, encryption_key: EncryptionKey | None = None
) -> str:
    """A seal's hash of its canonical bytes in ``mode`` (a manifest's or a generation's): keyed by the signing key
    (``mac``), by the key derived from the encryption key (``mac-encryption-key``), else plain blake3."""
    if mode == "mac":
        if key is None:
            raise ConfigurationError("a mac seal needs a signing key")
        return key.mac(data)
    if mode == "mac-encryption-key":
        if encryption_key is None:
            raise ConfigurationError("a mac-encryption-key seal needs the encryption key")
        return encryption_key.seal_key.mac(data)
    return blake3_hex(data)


def seal_mode(key: SigningKey | None, encryption_key: EncryptionKey | None) -> SealMode:
    """``mac`` with a signing key, else ``mac-encryption-key`` with an encryption key, else ``digest``."""
    if key is not None:
        return "mac"
    return "mac-encryption-key" if encryption_key is not None else "digest"


def seal_manifest(
    manifest: Manifest, key: SigningKey | None = None, encryption_key: EncryptionKey | None = None
) -> Seal:
    """The seal for this manifest as it is now (``seal_mode`` picks the mode from the keys given)."""
    mode = seal_mode(key, encryption_key)
    return Seal(mode=mode, hash=seal_hash(manifest, mode, key, encryption_key))


class _Header(msgspec.Struct, gc=False):
    """The one field read before the rest: a newer format is refused before its fields are judged."""

    format_version: object = None


#: A manifest with its added forms left as JSON, each decoded on its own (``decode_manifest``). Made by
#: ``defstruct``, not a class statement: it gives a field of ``Manifest`` another type, so it is not a Manifest.
_FormsUndecoded = msgspec.defstruct(
    "_FormsUndecoded",
    [("added_forms", list[msgspec.Raw], [])],
    bases=(Manifest,),
    module=__name__,
    kw_only=True,
    forbid_unknown_fields=True,
    gc=False,
)


def _unreadable_as_json(obj: object) -> msgspec.Raw:
    if isinstance(obj, UnreadableForm):
        return obj.raw
    raise NotImplementedError(f"{type(obj).__name__} is not part of a manifest")


_encoder = msgspec.json.Encoder(enc_hook=_unreadable_as_json)
_decoder = msgspec.json.Decoder(Manifest)
_forms_undecoded_decoder = msgspec.json.Decoder(_FormsUndecoded)
_form_decoder = msgspec.json.Decoder(AddedForm)
_header_decoder = msgspec.json.Decoder(_Header)


def _encode(manifest: Manifest) -> bytes:
    """Compact JSON with every empty ``fallback``, an empty ``added_forms``, a None ``save_id`` and an added
    form's None ``base`` left out (``msgspec.UNSET`` omits a field whatever its annotation; ``AddedForm`` omits its
    one defaulted field): a manifest without them encodes, byte for byte, as it did before they existed (its seal
    still matches, and older readers, which refuse unknown fields, read it). Only those fields: the same names as
    keys of a record's own dicts are data."""
    replaced: dict[str, object] = {"modules": _without_empty_fallbacks(manifest.modules)}
    if manifest.added_forms:
        replaced["added_forms"] = [
            msgspec.structs.replace(form, modules=_without_empty_fallbacks(form.modules))
            if isinstance(form, AddedForm)
            else form
            for form in manifest.added_forms
        ]
    else:
        replaced["added_forms"] = msgspec.UNSET
    if manifest.save_id is None:
        replaced["save_id"] = msgspec.UNSET
    return _encoder.encode(msgspec.structs.replace(manifest, **replaced))


def _without_empty_fallbacks(modules: list[ModuleRecord]) -> list[ModuleRecord]:
    return [m if m.fallback else msgspec.structs.replace(m, fallback=msgspec.UNSET) for m in modules]


def encode_manifest(manifest: Manifest) -> bytes:
    """Pretty JSON: a manifest is read by people as well as machines."""
    return msgspec.json.format(_encode(manifest), indent=1) + b"\n"


def manifest_generation(manifest: Manifest | None) -> str | None:
    """Which version of a checkpoint's manifest this is (``blake3:<hex>`` of its encoding; None: no manifest):
    what a writer compares before it commits, so that it never replaces a manifest it did not read."""
    if manifest is None:
        return None
    return "blake3:" + blake3.blake3(_encode(manifest)).hexdigest()


def decode_manifest(data: bytes, source: str = "manifest") -> Manifest:
    """Decode and validate a manifest; every failure is a ``ManifestError`` naming its location.

    A manifest of a newer format is refused as such (``ManifestVersionError``),
    not judged by this version's fields: its ``format_version`` is read alone
    when the full decode fails, and checked when it succeeds (reading it first
    would parse the whole document twice: 2 us a module, a fifth of the decode).
    """
    if not data or data.isspace():
        raise ManifestError(f"{source}: the manifest is empty; re-save the checkpoint")
    try:
        manifest = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        refuse_a_newer_format(format_version_of(data), source)
        salvaged = _decode_forms_one_by_one(data)
        if salvaged is None:
            raise ManifestError(
                f"{source}: {exc}; the manifest is damaged or was edited by hand: re-save the checkpoint"
            ) from None
        manifest = salvaged
    except msgspec.DecodeError as exc:
        raise ManifestError(f"{source}: not valid JSON ({exc}); the file is damaged, re-save the checkpoint") from None
    except RecursionError:
        raise ManifestError(f"{source}: JSON nested too deeply to be a manifest") from None
    refuse_a_newer_format(manifest.format_version, source)
    return manifest


def _decode_forms_one_by_one(data: bytes) -> Manifest | None:
    """The manifest with each added form this version cannot decode as an ``UnreadableForm``; None where the
    problem is outside the added forms (or the document is not one)."""
    try:
        undecoded = _forms_undecoded_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    fields = msgspec.structs.asdict(undecoded)
    forms: list[AddedForm] = []
    for raw in fields["added_forms"]:
        compact = msgspec.json.format(bytes(raw), indent=-1)  # what the writer sealed: its compact encoding
        try:
            forms.append(_form_decoder.decode(compact))
        except msgspec.ValidationError as exc:
            reason = f"this version of tensorizer-manifest cannot read it ({exc}): a newer one wrote it, or damaged"
            forms.append(UnreadableForm(compact, reason))  # type: ignore[arg-type]
    return Manifest(**{**fields, "added_forms": forms})


def format_version_of(data: bytes) -> object:
    """The document's ``format_version`` alone, None where it has none or is not a JSON object (a manifest, a
    pointer or a generation alike: read before the rest, so that a newer format is refused as such)."""
    try:
        return _header_decoder.decode(data).format_version
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None


def refuse_a_newer_format(
    version: object, source: str, readable: int = FORMAT_VERSION, kind: str = "manifest format version"
) -> None:
    """``ManifestVersionError`` for a document that a newer tensorizer-manifest wrote: its ``format_version`` above
    the newest this one reads (``readable``: a manifest's by default, a pointer's and a generation's in
    ``generation``)."""
    if isinstance(version, int) and not isinstance(version, bool) and version > readable:
        raise ManifestVersionError(
            f"{source}: {kind} {version} is newer than the version {readable} this tensorizer-manifest reads; "
            "upgrade tensorizer-manifest"
        )


def json_schema() -> dict:
    """The JSON Schema of the manifest, generated from the types above."""
    return msgspec.json.schema(Manifest)
