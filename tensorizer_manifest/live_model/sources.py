"""Which source tensor fills which module of a live vLLM model, observed while vLLM's loader runs (for the base).

What a loader of the layout-free base must know is which source tensors a layer needs, so that it reads only
those: that is *observed* here, never guessed from names. Each parameter's ``weight_loader`` (and the
``default_weight_loader`` vLLM's model code calls where a parameter has none) is wrapped for the load; a call
while the loader's iterator holds source tensor ``N`` records that ``N`` filled the module owning the parameter.
vLLM's models consume that iterator one tensor at a time, as vLLM's own layer-wise reload relies on too; a model
that fills a parameter after the iterator is spent (one that buffers the whole source) cannot be attributed, and
a base of it is refused by name. The same observer, at a load from the base, checks every tensor's content hash
as it is fed and which parameters were filled.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch

from .. import _vllm_compat
from ..errors import UnsupportedModelError
from ..format.generation import Layout
from ..format.schema import TensorRecord
from .tensors import dtype_name, hash_tensor

#: A record's hash where the reader asked for no content hashes (``verify_hashes=False``).
_NOT_HASHED = "blake3:not-hashed"


def source_record(name: str, tensor: torch.Tensor, content_hash: str | None = None) -> TensorRecord:
    """A source tensor's record, as the base stores it: contiguous, under its own name."""
    stride: list[int] = []
    step = 1
    for size in reversed(tensor.shape):
        stride.insert(0, step)
        step *= max(size, 1)
    return TensorRecord(
        name=name,
        kind="parameter",
        dtype=dtype_name(tensor.dtype),  # type: ignore[arg-type]
        shape=list(tensor.shape),
        stride=stride,
        nbytes=tensor.numel() * tensor.element_size(),
        hash=content_hash or hash_tensor(tensor.contiguous()),
        key=name if tensor.numel() else None,
    )


@dataclass
class ObservedSource:
    """What one engine's load read and where it went (``SourceObserver``)."""

    layout: Layout
    records: list[TensorRecord] = field(default_factory=list)
    consumers: dict[str, list[str]] = field(default_factory=dict)
    loaded: dict[str, list[str]] = field(default_factory=dict)
    unattributed: list[str] = field(default_factory=list)
    """Parameters a weight loader filled while no source tensor was being read: their source is unknown."""

    def refuse_unattributed(self) -> None:
        if self.unattributed:
            shown = ", ".join(self.unattributed[:5]) + (" ..." if len(self.unattributed) > 5 else "")
            raise UnsupportedModelError(
                f"this model's load_weights filled {len(self.unattributed)} parameter(s) after vLLM's loader had "
                f"handed out every source tensor ({shown}), so which source tensor fills them cannot be observed; "
                "save it without a base (--base none): its checkpoint then loads at the saved layout only"
            )


class WeightLoaded(Protocol):
    """A tensor as vLLM's loader sees it: its ``weight_loader`` is an attribute vLLM sets on the tensor (a tensor
    takes any attribute), or a property of vLLM's own parameter classes."""

    weight_loader: Callable[..., Any]


class _ModelCode(Protocol):
    """A module of vLLM's model code that calls ``default_weight_loader`` by its module-global name."""

    default_weight_loader: Callable[..., Any]


class SourceObserver:
    """Watches vLLM's default loader: every source tensor it reads (name, form, content hash) and, through the
    weight loaders it calls, the modules each one filled. ``source`` wraps the loader's iterator; ``watching``
    wraps the model's weight loaders for the load and puts them back after it."""

    def __init__(self, layout: Layout, content_hashes: bool = True):
        self.observed = ObservedSource(layout)
        self._content_hash = None if content_hashes else _NOT_HASHED
        self._current: str | None = None
        self._owners: dict[int, tuple[str, str]] = {}
        self._consumers: dict[str, dict[str, None]] = {}
        self._loaded: dict[str, dict[str, None]] = {}

    def source(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            self.observed.records.append(source_record(name, tensor, self._content_hash))
            self._current = name
            yield name, tensor
        self._current = None

    def _note(self, param: Any) -> None:
        owner = self._owners.get(id(param))
        if owner is None:
            return  # not a parameter of this model (a temporary a model builds and loads into)
        path, name = owner
        if self._current is None:
            self.observed.unattributed.append(f"{path}.{name}" if path else name)
            return
        self._consumers.setdefault(self._current, {})[path] = None
        self._loaded.setdefault(path, {})[name] = None

    @contextmanager
    def watching(self, model: torch.nn.Module) -> Iterator[None]:
        original_default = _vllm_compat.default_weight_loader()
        restore: list[tuple[WeightLoaded, Any]] = []
        patched_modules: list[_ModelCode] = []

        def wrap(loader: Any) -> Any:
            def observed_loader(param, *args, **kwargs):
                self._note(param)
                return loader(param, *args, **kwargs)

            return observed_loader

        try:
            for path, module in model.named_modules():
                for name, param in module._parameters.items():
                    if param is None or id(param) in self._owners:
                        continue
                    self._owners[id(param)] = (path, name)
                    loaded = cast(WeightLoaded, param)
                    original = getattr(loaded, "weight_loader", None)
                    restore.append((loaded, original))
                    loaded.weight_loader = wrap(original or original_default)
            # Model code that calls default_weight_loader by its module-global name reaches it through this.
            observed_default = wrap(original_default)
            for imported in list(sys.modules.values()):
                in_model_code = getattr(imported, "__name__", "").startswith("vllm.model_executor.models")
                if in_model_code and getattr(imported, "default_weight_loader", None) is original_default:
                    model_code = cast(_ModelCode, imported)  # it has the global: checked just above
                    model_code.default_weight_loader = observed_default
                    patched_modules.append(model_code)
            yield
        finally:
            for model_code in patched_modules:
                model_code.default_weight_loader = original_default
            for param, original in restore:
                if original is None:
                    try:
                        del param.weight_loader
                    except AttributeError:
                        pass
                else:
                    param.weight_loader = original
            self.observed.consumers = {name: list(paths) for name, paths in self._consumers.items()}
            self.observed.loaded = {path: list(names) for path, names in self._loaded.items()}
            self._owners.clear()
