"""Observe a live vLLM model around its post-load step and decide, per layer, what to save.

Nothing here guesses from class names what ``process_weights_after_loading``
does: the model is snapshotted before and after the step, and the difference
is what the step created. A layer is saved ``processed`` only when a restorer
(see ``replay``) covers every part of that difference; otherwise its
pre-processing tensors are kept and it is saved ``raw``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch

from .schema import KernelRecord, LayerState, RuntimeAttr
from .tensors import plain_value

# nn.Module bookkeeping that is not state of the layer.
_MODULE_INTERNALS = frozenset(
    {
        "training",
        "_parameters",
        "_buffers",
        "_non_persistent_buffers_set",
        "_modules",
        "_backward_pre_hooks",
        "_backward_hooks",
        "_is_full_backward_hook",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_compiled_call_impl",
    }
)

_MISSING = object()


def is_plain(value: object) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, (bool, int, float, str)) for v in value)
    return False


def describe(value: object) -> str:
    """A stable, readable type for a runtime attribute or kernel.

    Python functions are named with their closure variables, which is what
    tells vLLM's CPU GEMM closures apart (``[handler]`` is oneDNN, none is the
    torch fallback); builtins such as ``F.linear`` by their own name.
    """
    if hasattr(value, "__code__"):
        free = ",".join(value.__code__.co_freevars)
        return f"{value.__module__}.{value.__qualname__}" + (f"[{free}]" if free else "")
    if isinstance(value, types.BuiltinFunctionType):
        return f"{value.__module__}.{value.__qualname__}"
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_kernel(value: object) -> bool:
    cls = type(value)
    return cls.__name__.endswith("Kernel") or ".kernels." in (cls.__module__ or "")


def find_kernels(module: torch.nn.Module) -> list[KernelRecord]:
    """The objects a layer's forward dispatches to: kernels, scheme, attention impl, cpu_linear."""
    kernels: list[KernelRecord] = []
    for owner_name, owner in owners_of(module).items():
        if owner_name not in ("quant_method", "scheme"):
            continue
        for attr, value in vars(owner).items():
            if _is_kernel(value):
                kernels.append(KernelRecord(owner=owner_name, attr=attr, kernel_class=describe(value)))
    layer_dict = module.__dict__
    for attr in ("scheme", "impl", "cpu_linear"):
        if attr in layer_dict and layer_dict[attr] is not None:
            kernels.append(KernelRecord(owner="layer", attr=attr, kernel_class=describe(layer_dict[attr])))
    return kernels


def owners_of(module: torch.nn.Module) -> dict[str, Any]:
    """Objects whose attributes make up a layer's runtime state."""
    owners: dict[str, Any] = {"layer": module}
    quant_method = getattr(module, "quant_method", None)
    if quant_method is not None and hasattr(quant_method, "__dict__"):
        owners["quant_method"] = quant_method
    scheme = module.__dict__.get("scheme")
    if scheme is not None and hasattr(scheme, "__dict__"):
        owners["scheme"] = scheme
    impl = module.__dict__.get("impl")
    if impl is not None and hasattr(impl, "__dict__"):
        owners["impl"] = impl
    for owner_name in list(owners):
        if owner_name == "layer":
            continue
        for attr, value in vars(owners[owner_name]).items():
            if _is_kernel(value) and hasattr(value, "__dict__"):
                owners[f"{owner_name}.{attr}"] = value
    return owners


def owner_attrs(owner_name: str, owner: Any) -> dict[str, Any]:
    attrs = dict(vars(owner))
    if owner_name == "layer":
        for key in _MODULE_INTERNALS:
            attrs.pop(key, None)
    return attrs


@dataclass
class TensorSlot:
    tensor: torch.Tensor
    kind: str  # "parameter" | "buffer"
    persistent: bool
    identity: tuple[int, int, int]  # (id, data_ptr, _version) of the live tensor when snapshotted


def module_tensors(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, str, bool]]:
    out: dict[str, tuple[torch.Tensor, str, bool]] = {}
    for name, param in module._parameters.items():
        if param is not None:
            out[name] = (param, "parameter", True)
    for name, buf in module._buffers.items():
        if buf is not None:
            out[name] = (buf, "buffer", name not in module._non_persistent_buffers_set)
    return out


def _identity(t: torch.Tensor) -> tuple[int, int, int]:
    return (id(t), t.data_ptr() if t.numel() else 0, t._version)


@dataclass
class ModuleSnapshot:
    tensors: dict[str, TensorSlot]
    attrs: dict[str, dict[str, Any]]  # owner -> attribute -> value (tensors by reference)
    kernels: list[KernelRecord]


def snapshot_module(module: torch.nn.Module, clones: dict[int, torch.Tensor] | None) -> ModuleSnapshot:
    """Snapshot a module. With ``clones``, tensors are copied (shared through the memo, so ties survive)."""
    tensors: dict[str, TensorSlot] = {}
    for name, (tensor, kind, persistent) in module_tensors(module).items():
        identity = _identity(tensor)
        kept = tensor
        if clones is not None:
            kept = clones.get(id(tensor))
            if kept is None:
                kept = _clone_like(tensor)
                clones[id(tensor)] = kept
        tensors[name] = TensorSlot(kept, kind, persistent, identity)
    attrs = {owner_name: owner_attrs(owner_name, owner) for owner_name, owner in owners_of(module).items()}
    return ModuleSnapshot(tensors, attrs, find_kernels(module))


def _clone_like(tensor: torch.Tensor) -> torch.Tensor:
    """Copy data, keeping the Parameter class, its plain attributes, stride and requires_grad."""
    data = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    data.copy_(tensor.detach())
    if isinstance(tensor, torch.nn.Parameter):
        clone = torch.Tensor._make_subclass(type(tensor), data, tensor.requires_grad)
        for key, value in tensor.__dict__.items():
            if is_plain(value):
                setattr(clone, key, value)
        return clone
    return data


@dataclass
class LayerDiff:
    """What the post-load step did to one layer."""

    added_tensors: set[str] = field(default_factory=set)
    removed_tensors: set[str] = field(default_factory=set)
    changed_tensors: set[str] = field(default_factory=set)
    #: (owner, attribute) -> value after the step, for attributes added or changed
    changed_attrs: dict[tuple[str, str], Any] = field(default_factory=dict)
    removed_attrs: set[tuple[str, str]] = field(default_factory=set)

    @property
    def empty(self) -> bool:
        return not (
            self.added_tensors
            or self.removed_tensors
            or self.changed_tensors
            or self.changed_attrs
            or self.removed_attrs
        )

    @property
    def tensors_untouched(self) -> bool:
        return not (self.added_tensors or self.removed_tensors or self.changed_tensors)


def _same_value(a: object, b: object) -> bool:
    if a is b:
        return True
    if is_plain(a) and is_plain(b):
        return type(a) is type(b) and a == b
    return False


def diff_snapshots(before: ModuleSnapshot, after: ModuleSnapshot) -> LayerDiff:
    diff = LayerDiff()
    diff.added_tensors = set(after.tensors) - set(before.tensors)
    diff.removed_tensors = set(before.tensors) - set(after.tensors)
    for name in set(before.tensors) & set(after.tensors):
        if before.tensors[name].identity != after.tensors[name].identity:
            diff.changed_tensors.add(name)
    for owner in set(before.attrs) | set(after.attrs):
        b = before.attrs.get(owner, {})
        a = after.attrs.get(owner, {})
        for attr, value in a.items():
            if not _same_value(b.get(attr, _MISSING), value):
                diff.changed_attrs[(owner, attr)] = value
        for attr in set(b) - set(a):
            diff.removed_attrs.add((owner, attr))
    return diff


@dataclass
class CapturedLayer:
    path: str
    module: torch.nn.Module
    state: LayerState
    replay: str
    tensors: dict[str, TensorSlot]
    kernels: list[KernelRecord]
    runtime_state: list[RuntimeAttr]
    reason: str


def runtime_attrs(diff: LayerDiff, rebuilt_by: str) -> list[RuntimeAttr]:
    out = []
    for (owner, name), value in sorted(diff.changed_attrs.items(), key=lambda kv: kv[0]):
        _, plain = plain_value(value)
        out.append(RuntimeAttr(owner=owner, name=name, type=describe(value), rebuilt_by=rebuilt_by, value=plain))
    return out


def classify(path: str, module: torch.nn.Module, before: ModuleSnapshot, after: ModuleSnapshot) -> CapturedLayer:
    """Decide raw or processed for one layer; never guess."""
    from .replay import find_restorer

    diff = diff_snapshots(before, after)
    if diff.empty:
        return CapturedLayer(
            path, module, "processed", "none", after.tensors, after.kernels, [], "post-load changed nothing"
        )
    restorer, why_not = find_restorer(module, diff)
    if restorer is not None:
        return CapturedLayer(
            path,
            module,
            "processed",
            restorer.name,
            after.tensors,
            after.kernels,
            runtime_attrs(diff, restorer.name),
            f"restorer {restorer.name} rebuilds all the step created",
        )
    # Tensors the step creates (e.g. int8's ``azp_adj``) are runtime state of a raw layer too.
    created = [
        RuntimeAttr(owner="layer", name=name, type=describe(after.tensors[name].tensor), rebuilt_by="post_load")
        for name in sorted(diff.added_tensors)
    ]
    return CapturedLayer(
        path,
        module,
        "raw",
        "post_load",
        before.tensors,
        after.kernels,
        created + runtime_attrs(diff, "post_load"),
        why_not,
    )


def has_post_load(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return isinstance(getattr(module, "quant_method", None), QuantizeMethodBase) or is_deferred_attention_layer(module)


@dataclass
class Capture:
    """Everything the save step needs, recorded by the capture loader."""

    fingerprint: Any
    layers: list[CapturedLayer]
    stem: str = "model"


class Recorder:
    """Snapshots the whole model before the post-load step and classifies it after."""

    def __init__(self, model: torch.nn.Module):
        from .errors import UnsupportedModelError

        if hasattr(model, "process_weights_after_loading"):
            raise UnsupportedModelError(
                f"{type(model).__name__} has a model-level post-load hook, whose effects no restorer "
                "describes; tensorizer-manifest cannot save this model yet"
            )
        self.model = model
        self._clones: dict[int, torch.Tensor] = {}
        self.before = {
            path: snapshot_module(module, self._clones if has_post_load(module) else None)
            for path, module in model.named_modules()
        }

    def finish(self, fingerprint: Any) -> Capture:
        from .errors import UnsupportedModelError

        layers = []
        for path, module in self.model.named_modules():
            after = snapshot_module(module, None)
            before = self.before.get(path)
            if before is None:
                raise UnsupportedModelError(
                    f"module {path!r} appeared during the post-load step; tensorizer-manifest "
                    "cannot describe modules the step creates"
                )
            layer = classify(path, module, before, after)
            if layer.state == "raw" and not has_post_load(module):
                raise UnsupportedModelError(
                    f"module {path!r} ({type(module).__name__}) was changed by the post-load step "
                    "although it has no post-load step of its own (a model-level hook?); "
                    "tensorizer-manifest cannot replay that"
                )
            if layer.tensors or layer.runtime_state or layer.kernels:
                layers.append(layer)
        self._clones.clear()
        return Capture(fingerprint=fingerprint, layers=layers)
