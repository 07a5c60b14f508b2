"""Observing a live vLLM layer: its tensors, kernels and runtime state, snapshots and their diff.

Both directions use this: capture snapshots every layer before and after vLLM's
post-load step and diffs them; load and replay compare a freshly built model
with the manifest and check what replay rebuilt. Also here: which layers have
a post-load step, and in which order vLLM runs them.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _vllm_compat
from ..errors import UnsupportedModelError
from ..format.schema import KernelRecord, plain_value
from ..storage.spill import SpillFile, StoredTensor, same_bytes
from .tensors import hash_tensor

# nn.Module bookkeeping that is not state of the layer.
_MODULE_INTERNALS = frozenset(
    {
        "training", "_parameters", "_buffers", "_non_persistent_buffers_set", "_modules",
        "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook", "_forward_hooks",
        "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_compiled_call_impl",
    }
)  # fmt: skip

_MISSING = object()

#: What ``post_load_steps`` yields as a step's kind.
QUANT_METHOD_STEP = "quant_method"
ATTENTION_STEP = "attention"


def describe(value: object) -> str:
    """A stable, readable type for a runtime attribute or kernel.

    Python functions are named with their closure variables, which is what
    tells vLLM's CPU GEMM closures apart (``[handler]`` is oneDNN, none is the
    torch fallback); builtins such as ``F.linear`` by their own name.
    """
    if hasattr(value, "__code__") and hasattr(value, "__qualname__"):  # a function, or a callable that acts as one
        free = ",".join(value.__code__.co_freevars)
        return f"{value.__module__}.{value.__qualname__}" + (f"[{free}]" if free else "")
    if isinstance(value, types.BuiltinFunctionType):
        return f"{value.__module__}.{value.__qualname__}"
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_kernel(value: object) -> bool:
    cls = type(value)
    return cls.__name__.endswith("Kernel") or ".kernels." in (cls.__module__ or "")


def owners_of(module: torch.nn.Module) -> dict[str, Any]:
    """Objects whose attributes make up a layer's runtime state, by owner name."""
    owners: dict[str, Any] = {"layer": module}
    quant_method = getattr(module, "quant_method", None)
    if quant_method is not None and hasattr(quant_method, "__dict__"):
        owners["quant_method"] = quant_method
    for attr in ("scheme", "impl"):
        value = module.__dict__.get(attr)
        if value is not None and hasattr(value, "__dict__"):
            owners[attr] = value
    for owner_name in list(owners):
        if owner_name == "layer":
            continue
        for attr, value in vars(owners[owner_name]).items():
            if _is_kernel(value) and hasattr(value, "__dict__"):
                owners[f"{owner_name}.{attr}"] = value
    return owners


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


def owner_attrs(owner: Any) -> dict[str, Any]:
    """An owner's attributes, less ``nn.Module`` bookkeeping (vLLM's MoE quant method is a module too)."""
    attrs = dict(vars(owner))
    if isinstance(owner, torch.nn.Module):
        for key in _MODULE_INTERNALS:
            attrs.pop(key, None)
    return attrs


def owned_quant_methods(model: torch.nn.Module) -> set[int]:
    """``id`` of every quant method that is itself an ``nn.Module`` without tensors of its own.

    vLLM's fused-MoE quant methods are ``CustomOp`` modules registered under
    their layer (``experts.quant_method``); their state belongs to that layer
    (``owners_of``), not to a layer of their own.
    """
    owned = set()
    for module in model.modules():
        quant_method = module.__dict__.get("_modules", {}).get("quant_method")
        if isinstance(quant_method, torch.nn.Module) and not module_tensors(quant_method):
            owned.add(id(quant_method))
    return owned


def module_tensors(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, str, bool]]:
    """A module's own tensors: name -> (tensor, ``parameter`` or ``buffer``, persistent)."""
    out: dict[str, tuple[torch.Tensor, str, bool]] = {}
    for name, param in module._parameters.items():
        if param is not None:
            out[name] = (param, "parameter", True)
    for name, buf in module._buffers.items():
        if buf is not None:
            out[name] = (buf, "buffer", name not in module._non_persistent_buffers_set)
    return out


# --- which layers have a post-load step, in vLLM's order -----------------------------------------


def has_quant_method_step(module: torch.nn.Module) -> bool:
    return _vllm_compat.has_quant_method(module)


def has_attention_step(module: torch.nn.Module) -> bool:
    return _vllm_compat.is_deferred_attention_layer(module)


def has_post_load(module: torch.nn.Module) -> bool:
    return has_quant_method_step(module) or has_attention_step(module)


def post_load_steps(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """``(path, module, kind)`` in the order vLLM's ``process_weights_after_loading`` runs them.

    Every module with a quant method, in module order, then every deferred
    attention layer (a layer can appear twice, once per kind).
    """
    modules = list(model.named_modules())
    steps = [(path, module, QUANT_METHOD_STEP) for path, module in modules if has_quant_method_step(module)]
    steps += [(path, module, ATTENTION_STEP) for path, module in modules if has_attention_step(module)]
    return steps


def refuse_model_level_hook(model: torch.nn.Module) -> None:
    """A post-load hook of the model's own (or, from vLLM 0.34, of any module that is not an attention layer:
    ``_vllm_compat.own_post_load_hooks``) does things no restorer describes: refuse it, never guess."""
    hooks = _vllm_compat.own_post_load_hooks(model)
    if hooks == [""]:
        raise UnsupportedModelError(
            f"{type(model).__name__} has a model-level post-load hook, whose effects no restorer "
            "describes; tensorizer-manifest cannot save or replay this model yet"
        )
    if hooks:
        named = ", ".join(path or "the model itself" for path in hooks[:5]) + (", ..." if len(hooks) > 5 else "")
        raise UnsupportedModelError(
            f"{type(model).__name__} has module-level post-load hooks ({named}) that vLLM "
            f"{_vllm_compat.vllm_version()} runs, whose effects no restorer describes; tensorizer-manifest cannot save "
            "or replay this model yet"
        )


# --- snapshots and their diff --------------------------------------------------------------------


@dataclass
class TensorSlot:
    tensor: torch.Tensor
    """The live tensor; for a pre-step copy, a stand-in on the meta device (class, attributes, shape, stride)."""
    kind: str  # "parameter" | "buffer"
    persistent: bool
    identity: tuple[int, int, int]  # (id, data_ptr, _version) of the live tensor when snapshotted
    stored: StoredTensor | None = None
    """Where a pre-step copy's bytes are (``tensor`` is then their stand-in)."""
    content_hash: str | None = None
    """The live tensor's bytes' hash when snapshotted (``snapshot_module(..., content_hashes=True)``)."""

    def data(self, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor with its bytes: the live one, or the pre-step copy read back (contiguous; into ``buffer``)."""
        return self.tensor if self.stored is None else self.stored.read(buffer)


def _identity(t: torch.Tensor) -> tuple[int, int, int]:
    return (id(t), t.data_ptr() if t.numel() else 0, t._version)


@dataclass
class ModuleSnapshot:
    tensors: dict[str, TensorSlot]
    attrs: dict[str, dict[str, Any]]  # owner -> attribute -> value (tensors by reference)
    kernels: list[KernelRecord]


class PreStepCopies:
    """Copies of tensors as they were before the post-load step, their bytes on disk.

    Each tensor is written once to a ``SpillFile`` and stood in for by a tensor on
    the meta device with its class, plain attributes, shape and stride; a memo by
    ``id`` hands the same stand-in to every layer that holds the tensor, so ties
    survive. Only one tensor's bytes are in memory at a time.
    """

    def __init__(self, spill: SpillFile):
        self.spill = spill
        self._memo: dict[int, tuple[torch.Tensor, StoredTensor]] = {}

    def keep(self, tensor: torch.Tensor) -> tuple[torch.Tensor, StoredTensor]:
        kept = self._memo.get(id(tensor))
        if kept is None:
            kept = (_stand_in(tensor), self.spill.put(tensor))
            self._memo[id(tensor)] = kept
        return kept

    def forget(self) -> None:
        """Drop the memo (the stand-ins and stored bytes stay valid while the spill file is open)."""
        self._memo.clear()


def snapshot_module(
    module: torch.nn.Module, copies: PreStepCopies | None, content_hashes: bool = False
) -> ModuleSnapshot:
    """Snapshot a module. With ``copies``, tensors are copied to disk (shared through its memo, so ties survive).
    Without, ``content_hashes`` records each tensor's hash: a write through ``.data`` (vLLM 0.33's
    ``replace_parameter`` copies a same-shaped result into the parameter so) bumps no version counter, and the
    reference kept would show the new bytes."""
    tensors: dict[str, TensorSlot] = {}
    for name, (tensor, kind, persistent) in module_tensors(module).items():
        identity = _identity(tensor)
        if copies is None:
            digest = hash_tensor(tensor) if content_hashes else None
            tensors[name] = TensorSlot(tensor, kind, persistent, identity, content_hash=digest)
        else:
            stand_in, stored = copies.keep(tensor)
            tensors[name] = TensorSlot(stand_in, kind, persistent, identity, stored)
    attrs = {owner_name: owner_attrs(owner) for owner_name, owner in owners_of(module).items()}
    return ModuleSnapshot(tensors, attrs, find_kernels(module))


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor in place of a copy: the Parameter class, its plain attributes, stride and requires_grad.

    Laid out as a fresh copy would be (``empty_strided``: same stride, storage offset 0).
    """
    data = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    if isinstance(tensor, torch.nn.Parameter):
        stand_in = torch.Tensor._make_subclass(type(tensor), data, tensor.requires_grad)
        for key, value in tensor.__dict__.items():
            if plain_value(value)[0]:
                setattr(stand_in, key, value)
        return stand_in
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
    def tensors_untouched(self) -> bool:
        return not (self.added_tensors or self.removed_tensors or self.changed_tensors)

    @property
    def empty(self) -> bool:
        return self.tensors_untouched and not (self.changed_attrs or self.removed_attrs)


def _same_value(a: object, b: object) -> bool:
    if a is b:
        return True
    if plain_value(a)[0] and plain_value(b)[0]:
        return type(a) is type(b) and a == b
    return False


def _same_bytes(was: TensorSlot, now: torch.Tensor) -> bool:
    """Bytewise equality of a snapshot's tensor and a live one (a copy on disk is compared a chunk at a time)."""
    if was.stored is not None:
        return was.stored.same_bytes(now)
    return same_bytes(was.tensor, now)


def diff_snapshots(before: ModuleSnapshot, after: ModuleSnapshot) -> LayerDiff:
    """What changed from ``before`` to ``after``.

    A tensor changed when it is another object, moved, or was written in place
    (torch's version counter). Writes through ``.data`` bump no counter, so
    where ``before`` holds a copy the bytes are compared as well, and where it
    holds a content hash, the hash.
    """
    diff = LayerDiff()
    diff.added_tensors = set(after.tensors) - set(before.tensors)
    diff.removed_tensors = set(before.tensors) - set(after.tensors)
    for name in set(before.tensors) & set(after.tensors):
        was, now = before.tensors[name], after.tensors[name]
        if was.identity != now.identity or (was.tensor is not now.tensor and not _same_bytes(was, now.tensor)):
            diff.changed_tensors.add(name)
        elif was.content_hash is not None and hash_tensor(now.tensor) != was.content_hash:
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
