"""Live torch tensors to manifest records and back, exactly.

Fidelity rules (what vLLM's native tensorizer round trip loses, and we keep):
no dtype cast; shape, stride and storage offset recorded and restored; tied
tensors stored once and re-tied; parameters keep their (vLLM) class and plain
attributes; buffers stay buffers. Zero-element tensors are not written at all
(tensorizer cannot read back a zero-length bfloat16 tensor); they are rebuilt
from the record.
"""

from __future__ import annotations

import torch

from .. import _vllm_compat
from ..errors import IntegrityError, ManifestError
from ..format.schema import (
    ALLOWED_PARAM_MODULES,
    DTYPE_ITEMSIZE,
    PlainValue,
    TensorRecord,
    blake3_hex,
    plain_value,
    qualified_class,
)

#: Every dtype the format names that this torch has.
_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_ITEMSIZE if hasattr(torch, name)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ManifestError(f"dtype {name!r} in the manifest does not exist in torch {torch.__version__}") from None


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements in row-major order as bytes (no copy when contiguous)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy().data


def hash_tensor(tensor: torch.Tensor) -> str:
    """blake3 of the tensor's bytes: fast (multi-GB/s), and already a vLLM dependency. The same digest
    whether blake3 uses one thread or several."""
    return blake3_hex(tensor_bytes(tensor))


def param_plain_attrs(tensor: torch.Tensor) -> dict[str, PlainValue]:
    """vLLM keeps layout facts (``input_dim``, ``packed_factor``...) as plain attributes."""
    attrs: dict[str, PlainValue] = {}
    for name, value in getattr(tensor, "__dict__", {}).items():
        ok, plain = plain_value(value)
        if ok:
            attrs[name] = plain
    return attrs


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
        dtype=dtype_name(tensor.dtype),  # type: ignore[arg-type]
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
    span = (
        record.storage_offset + 1 + sum((d - 1) * s for d, s in zip(record.shape, record.stride, strict=True) if d > 0)
    )
    storage = torch.empty(span, dtype=dtype)
    out = storage.as_strided(record.shape, record.stride, record.storage_offset)
    out.copy_(data)
    return out


def param_class_from_name(name: str) -> type[torch.nn.Parameter]:
    """The Parameter class a record names, only from ``ALLOWED_PARAM_MODULES``: never an arbitrary class."""
    module_name = name.rpartition(".")[0]
    if module_name not in ALLOWED_PARAM_MODULES:
        raise ManifestError(
            f"parameter class {name!r} is not one the loader may build "
            f"(allowed modules: {', '.join(ALLOWED_PARAM_MODULES)})"
        )
    cls = _vllm_compat.class_named(name)
    if not (cls is not None and issubclass(cls, torch.nn.Parameter)):
        raise ManifestError(f"parameter class {name!r} does not exist in this vLLM")
    return cls


def make_parameter(record: TensorRecord, data: torch.Tensor) -> torch.nn.Parameter:
    """A Parameter of the recorded class around ``data`` (no copy), with its plain attributes."""
    cls = param_class_from_name(record.param_class or "torch.nn.parameter.Parameter")
    param = torch.Tensor._make_subclass(cls, data, record.requires_grad)
    for attr, value in record.param_attrs.items():
        setattr(param, attr, value)
    return param
