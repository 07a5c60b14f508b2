"""The tensor file: exact records, hashing, writing with tensorizer, reading back.

Fidelity rules (what vLLM's native tensorizer round trip loses, and we keep):
no dtype cast; shape, stride and storage offset recorded and restored; tied
tensors stored once and re-tied; parameters keep their (vLLM) class and plain
attributes; buffers stay buffers. Zero-element tensors are not written at all
(tensorizer cannot read back a zero-length bfloat16 tensor); they are rebuilt
from the record.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch

from .errors import IntegrityError, ManifestError
from .schema import PlainValue, TensorRecord

#: Parameter classes the loader may instantiate. Anything else is refused, so a
#: manifest can never make the loader import or build an arbitrary class.
from .validate import _PARAM_MODULES as _ALLOWED_PARAM_MODULES  # noqa: E402  (one list for both)

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "uint16",
        "uint32",
        "uint64",
        "complex64",
    )
    if hasattr(torch, name)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ManifestError(f"unknown dtype {name!r} in manifest") from None


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements in row-major order as bytes (no copy when contiguous)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.view(torch.uint8).numpy())


def hash_tensor(tensor: torch.Tensor) -> str:
    """blake3 of the tensor's bytes: fast (multi-GB/s), and already a vLLM dependency."""
    return "blake3:" + blake3.blake3(tensor_bytes(tensor)).hexdigest()


def plain_value(value: object) -> tuple[bool, PlainValue]:
    """Whether a value is one a manifest can carry, and its JSON form."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True, value  # type: ignore[return-value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return True, list(value)
    return False, None


def param_plain_attrs(tensor: torch.Tensor) -> dict[str, PlainValue]:
    """vLLM keeps layout facts (``input_dim``, ``packed_factor``...) as plain attributes."""
    attrs: dict[str, PlainValue] = {}
    for name, value in getattr(tensor, "__dict__", {}).items():
        ok, plain = plain_value(value)
        if ok:
            attrs[name] = plain
    return attrs


def qualified_class(obj_or_cls: object) -> str:
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return f"{cls.__module__}.{cls.__qualname__}"


def make_record(
    name: str,
    tensor: torch.Tensor,
    *,
    kind: str,
    persistent: bool,
    key: str | None,
    alias_of: str | None = None,
    content_hash: str | None = None,
) -> TensorRecord:
    is_param = isinstance(tensor, torch.nn.Parameter)
    return TensorRecord(
        name=name,
        kind=kind,  # type: ignore[arg-type]
        persistent=persistent,
        dtype=dtype_name(tensor.dtype),
        shape=list(tensor.shape),
        stride=list(tensor.stride()),
        storage_offset=int(tensor.storage_offset()),
        requires_grad=bool(tensor.requires_grad),
        param_class=qualified_class(tensor) if is_param else None,
        param_attrs=param_plain_attrs(tensor) if is_param else {},
        nbytes=tensor.numel() * tensor.element_size(),
        hash=content_hash or hash_tensor(tensor),
        key=None if alias_of is not None or tensor.numel() == 0 else key,
        alias_of=alias_of,
    )


def write_tensor_file(path: Path, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write ``(key, tensor)`` pairs with tensorizer, contiguous, dtype untouched."""
    from tensorizer import TensorSerializer, TensorType

    serializer = TensorSerializer(str(path))
    try:
        for key, tensor in tensors:
            data = tensor.detach()
            if data.device.type != "cpu":
                data = data.cpu()
            serializer.write_tensor(0, key, TensorType.STATE_DICT, data.contiguous())
    finally:
        serializer.close()


@dataclass
class TensorFileReader:
    """Reads stored tensors by key, lazily, one at a time."""

    path: Path
    device: str = "cpu"

    def __post_init__(self) -> None:
        from tensorizer import TensorDeserializer

        try:
            self._deserializer = TensorDeserializer(
                str(self.path), device=self.device, lazy_load=True, verify_hash=False
            )
        except Exception as exc:
            raise IntegrityError(
                f"{self.path.name}: tensorizer cannot open the file ({type(exc).__name__}: {exc})"
            ) from None
        self.keys = set(self._deserializer.keys())

    def read(self, key: str) -> torch.Tensor:
        if key not in self.keys:
            raise IntegrityError(f"{self.path.name}: tensor {key!r} named in the manifest is not in the file")
        try:
            tensor = self._deserializer[key]
        except Exception as exc:  # tensorizer raises many kinds on a damaged file
            raise IntegrityError(
                f"{self.path.name}: tensor {key!r} cannot be read ({type(exc).__name__}: {exc}); the file is damaged"
            ) from None
        return tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor

    def close(self) -> None:
        self._deserializer.close()


def materialize(record: TensorRecord, data: torch.Tensor | None, where: str) -> torch.Tensor:
    """Turn stored bytes into a tensor of the recorded dtype, shape and stride."""
    dtype = dtype_from_name(record.dtype)
    if data is None:
        if record.nbytes != 0:
            raise IntegrityError(f"{where}: no data stored for a non-empty tensor")
        return torch.empty_strided(record.shape, record.stride, dtype=dtype)
    if data.dtype != dtype or list(data.shape) != record.shape:
        raise IntegrityError(
            f"{where}: file holds {dtype_name(data.dtype)}{list(data.shape)}, "
            f"manifest says {record.dtype}{record.shape}"
        )
    if list(data.stride()) == record.stride and record.storage_offset == 0:
        return data
    # Rebuild the exact layout: a view into a storage big enough for the recorded strides.
    span = record.storage_offset + 1 + sum((d - 1) * s for d, s in zip(record.shape, record.stride) if d > 0)
    storage = torch.empty(span, dtype=dtype)
    out = storage.as_strided(record.shape, record.stride, record.storage_offset)
    out.copy_(data)
    return out


def param_class_from_name(name: str) -> type[torch.nn.Parameter]:
    module_name, _, cls_name = name.rpartition(".")
    if module_name not in _ALLOWED_PARAM_MODULES:
        raise ManifestError(
            f"parameter class {name!r} is not one the loader may build "
            f"(allowed modules: {', '.join(_ALLOWED_PARAM_MODULES)})"
        )
    cls = getattr(importlib.import_module(module_name), cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Parameter)):
        raise ManifestError(f"parameter class {name!r} does not exist in this vLLM")
    return cls


def make_parameter(record: TensorRecord, data: torch.Tensor) -> torch.nn.Parameter:
    """A Parameter of the recorded class around ``data`` (no copy), with its plain attributes."""
    cls = param_class_from_name(record.param_class or "torch.nn.parameter.Parameter")
    param = torch.Tensor._make_subclass(cls, data, record.requires_grad)
    for attr, value in record.param_attrs.items():
        setattr(param, attr, value)
    return param
