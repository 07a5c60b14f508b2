"""The manifest format, version 1: msgspec types, encoding and strict decoding.

This module imports neither torch nor vLLM, so that ``inspect`` answers fast.

Schema evolution rules (after msgspec's): a new field must have a default;
a field's type never changes; fields are only appended; anything that old
readers would misread bumps ``FORMAT_VERSION``. A reader refuses a manifest
whose ``format_version`` is newer than its own, naming both versions.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from .errors import ManifestError, ManifestVersionError

FORMAT_VERSION = 1
MANIFEST_SUFFIX = ".manifest.json"
TENSORS_SUFFIX = ".tensors"

#: JSON-safe values a manifest may carry for runtime attributes and Parameter attributes.
PlainValue = Union[None, bool, int, float, str, list[int | float]]

LayerState = Literal["raw", "processed"]
TensorKind = Literal["parameter", "buffer"]


class _Struct(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=False):
    pass


class TensorRecord(_Struct, kw_only=True):
    """One tensor of a module, exactly as the model held it."""

    name: str
    """Attribute name on the module (``weight``, ``_k_scale``...)."""
    kind: TensorKind
    persistent: bool = True
    dtype: str
    """torch dtype without the ``torch.`` prefix (``bfloat16``, ``int8``)."""
    shape: list[int]
    stride: list[int]
    storage_offset: int = 0
    requires_grad: bool = False
    param_class: str | None = None
    """Qualified class of a Parameter (vLLM subclasses included); None for buffers."""
    param_attrs: dict[str, PlainValue] = {}
    """Plain attributes vLLM sets on its Parameters (``input_dim``, ``output_dim``...)."""
    nbytes: int
    hash: str
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


class TensorFileRef(_Struct, kw_only=True):
    path: str
    """File name relative to the checkpoint directory."""
    size: int
    tensor_count: int
    digest: str
    """``blake3:<hex>`` over every record's name and hash: binds manifest and tensor file."""
    head_hash: str | None = None
    """``blake3:<hex>`` of the file's first MiB (tensorizer's header and index)."""


class Manifest(_Struct, kw_only=True):
    format_version: int
    producer: str
    fingerprint: Fingerprint
    tensor_file: TensorFileRef
    modules: list[ModuleRecord]

    def module_map(self) -> dict[str, ModuleRecord]:
        return {m.path: m for m in self.modules}


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Manifest)


def encode_manifest(manifest: Manifest) -> bytes:
    """Pretty JSON: a manifest is read by people as well as machines."""
    return msgspec.json.format(_encoder.encode(manifest), indent=1) + b"\n"


def decode_manifest(data: bytes, source: str = "manifest") -> Manifest:
    """Decode and validate a manifest; every failure is a ``ManifestError`` naming its location."""
    if not data.strip():
        raise ManifestError(f"{source}: the manifest is empty; re-save the checkpoint")
    try:
        header = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ManifestError(f"{source}: not valid JSON ({exc}); the file is damaged, re-save the checkpoint") from None
    except RecursionError:
        raise ManifestError(f"{source}: JSON nested too deeply to be a manifest") from None
    if isinstance(header, dict):
        version = header.get("format_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise ManifestVersionError(
                f"{source}: manifest format version {version} is newer than the version "
                f"{FORMAT_VERSION} this tensorizer-manifest reads; upgrade tensorizer-manifest"
            )
    try:
        manifest = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ManifestError(f"{source}: {exc}") from None
    if manifest.format_version < 1:
        raise ManifestError(f"{source}: format_version must be >= 1, got {manifest.format_version}")
    return manifest


def json_schema() -> dict:
    """The JSON Schema of the manifest, generated from the types above."""
    return msgspec.json.schema(Manifest)
