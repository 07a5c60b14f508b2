"""Save from an engine vLLM's default loader loaded: each layer's state before the post-load step, rebuilt.

Such an engine has run ``process_weights_after_loading``, so the tensors its raw layers had as loaded are
gone, and the capture loader (which observes the step) was not there to keep them. vLLM itself keeps,
for weight reloading, every layer's tensors as they were created (``record_metadata_for_reloading``: meta
tensors with their class and weight loader). From those this module builds a *shadow* of the model: the
same modules (shallow copies), every tensor on the meta device. The engine's own source weights are read
once, in their order, and handed to the model's own ``load_weights`` on the shadow, so vLLM's weight
loaders place (shard, stack, transpose) each one as they did at load. A layer's loads are only counted
until all its weights are in (vLLM's layerwise-reload counting); then that layer alone is materialized,
loaded, snapshotted, put through vLLM's step and classified exactly as the capture loader classifies it
(``capture.classify``), compared with the engine's live layer, and dropped. Memory: about one layer, plus
the source weights of layers whose weights are still arriving.

The comparison is the guarantee: every tensor the live layer holds must come out of the rebuilt step
bit-identical, else the engine's weights are not its source's (a LoRA merged, an RLHF update, another
revision) and nothing is saved. Processed layers are then written from the live tensors (the same bytes),
raw layers from their rebuilt pre-step copies (on disk, as the capture loader keeps them).

Why not vLLM's own layerwise reload (``reload.layerwise``), whose counting this copies: its driver works on
the live model, and a save must not touch it. It swaps the live layer's tensors for meta ones, runs the step
as soon as a layer's weights are in, with no point between to snapshot the pre-step state a save writes,
and copies the result into the live kernel tensors (``_copy_and_restore_kernel_tensors``). Its parts are
used as they are (``_vllm_compat``: the records, ``get_numel_loaded``, ``get_tensor_load_numel``, the meta
tensors, ``restore_layer_refs``); the driver here differs from vLLM's on purpose: it works on a shadow,
takes the tensors vLLM does not record (a ``bias`` made after the weights) from the live layer rather than
re-counting as they appear, and classifies a layer inside an attention layer after the attention steps, as
the capture loader sees it.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, Protocol, cast

import torch

from .. import _vllm_compat
from ..errors import CheckpointNotFoundError, NotReproducibleError, UnsupportedModelError
from ..format.schema import Fingerprint
from ..live_model.layers import (
    ATTENTION_STEP,
    QUANT_METHOD_STEP,
    ModuleSnapshot,
    PreStepCopies,
    has_post_load,
    module_tensors,
    owned_quant_methods,
    post_load_steps,
    refuse_model_level_hook,
    snapshot_module,
)
from ..live_model.sources import WeightLoaded
from ..load.replay import run_post_load_step
from ..storage.spill import SpillFile, same_bytes
from .capture import Capture, CapturedLayer, CapturePolicy, classify

#: Each module's attributes just before vLLM's post-load step, tensors left out (they are vLLM's record), as a
#: *fork* (``fork_state``): what a step finds on a layer decides what it does (a fused-MoE method with a kernel
#: set up takes its weight-update branch), and the step sets state on the objects a layer holds (a kernel's
#: oneDNN handle), so the shadow starts from private copies of them as they were, never from the live ones.
_PRE_STEP_ATTRIBUTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CONTAINERS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")

#: Objects of these vLLM packages hold a layer's kernel state (quant methods, schemes, kernels, attention
#: impls) and are forked; everything else (configs, process groups, vLLM's C++ handles) is shared, read-only.
_FORKED_PACKAGES = ("vllm.model_executor.", "vllm.v1.attention.", "vllm.attention.")

#: The probe a linear layer's kernels are run on (``Rebuilder._compare_kernels``): rows of normal noise, made
#: the same way for the live and the rebuilt layer.
_PROBE_ROWS = 8
_PROBE_SEED = 0

#: A tensor held as a plain attribute is kept only by weak reference above this size: one the step replaces
#: would otherwise stay alive for as long as the engine serves.
_MAX_KEPT_TENSOR_BYTES = 1 << 20


@dataclass(frozen=True)
class _Released:
    """A large tensor a layer held before its step, kept by weak reference (``_MAX_KEPT_TENSOR_BYTES``)."""

    ref: weakref.ref
    where: str


def _changed_after_loading(what: str, differs: str = "differs from what") -> NotReproducibleError:
    return NotReproducibleError(
        f"{what} {differs} the engine's source weights give through vLLM's load and post-load step: its weights "
        "changed after loading (a LoRA merged, an update) or its source is another revision; save it with "
        "`tensorizer-manifest save SRC OUT` from the weights it serves, not from this engine"
    )


def remember_pre_step_attributes(model: torch.nn.Module) -> None:
    """Fork every module's plain attributes as they are before vLLM's step (a few small objects per layer).
    Installed in every vLLM process by the plugin (``vllm_integration.register``)."""
    memo: dict[int, Any] = {}  # by id: only objects the model keeps alive go in (never a temporary dict)
    for path, module in model.named_modules():
        _PRE_STEP_ATTRIBUTES[module] = {
            name: fork_state(value, memo, release_large=True, where=path)
            for name, value in vars(module).items()
            if name not in _CONTAINERS
        }


def fork_state(value: Any, memo: dict[int, Any], release_large: bool = False, where: str = "") -> Any:
    """A copy of ``value`` in which every object of vLLM's layer packages (``_FORKED_PACKAGES``) is a copy, and
    so is every dict, list and tuple that leads to one; tensors, modules and other objects are shared. ``memo``
    keeps shared objects shared. Methods bound to a forked object are bound to its copy.

    ``release_large`` keeps tensors over ``_MAX_KEPT_TENSOR_BYTES`` by weak reference (``_Released``); forking
    without it resolves them, and a tensor gone since is a ``NotReproducibleError`` naming it."""
    key = id(value)
    if key in memo:
        return memo[key]
    if isinstance(value, _Released):
        tensor = value.ref()
        if tensor is None:
            raise NotReproducibleError(
                f"{value.where}: a tensor this layer held before vLLM's post-load step is gone (the step replaced "
                "it), so the step cannot be run again on a copy; save with load_format='tensorizer_manifest_capture' "
                "or `tensorizer-manifest save SRC OUT` instead"
            )
        return tensor
    if isinstance(value, torch.Tensor):
        if release_large and value.numel() * value.element_size() > _MAX_KEPT_TENSOR_BYTES:
            return _Released(weakref.ref(value), where)
        return value
    if isinstance(value, torch.nn.Module) or isinstance(value, type):
        return value
    if isinstance(value, dict):
        out: Any = {}
        memo[key] = out
        out.update({k: fork_state(v, memo, release_large, where) for k, v in value.items()})
        return out
    if isinstance(value, list):
        out = []
        memo[key] = out
        out.extend(fork_state(v, memo, release_large, where) for v in value)
        return out
    if type(value) is tuple:
        out = tuple(fork_state(v, memo, release_large, where) for v in value)
        memo[key] = out
        return out
    if isinstance(value, MethodType):
        owner = fork_state(value.__self__, memo, release_large, where)
        return value if owner is value.__self__ else MethodType(value.__func__, owner)
    module_name = type(value).__module__ or ""
    if module_name.startswith(_FORKED_PACKAGES) and hasattr(value, "__dict__"):
        out = copy.copy(value)
        memo[key] = out
        out.__dict__.update({k: fork_state(v, memo, release_large, where) for k, v in vars(value).items()})
        return out
    return value


@dataclass
class _Layer:
    """One module of the shadow: its loads until they are all in, then its rebuilt capture."""

    path: str
    live: torch.nn.Module
    shadow: torch.nn.Module
    loadable: int = 0
    """Elements its weight loaders fill (vLLM's count: padding excluded)."""
    loaded: int = 0
    loads: list[tuple[str, inspect.BoundArguments, Callable, str]] = field(default_factory=list)
    done: bool = False
    metas: dict[str, tuple[dict, torch.Tensor]] = field(default_factory=dict)
    """Its shadow tensors on the meta device, put back once it is classified (later loads may look them up)."""
    before: Any = None


def _tensor_stores(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """A module's parameter and buffer registries, written directly: the shadow swaps meta and real tensors in
    and out of them without ``register_parameter``'s checks."""
    return module._parameters, module._buffers


class _LinearLayer(Protocol):
    """What the kernel comparison uses of one of vLLM's linear layers."""

    input_size: int
    quant_method: Any


class _LoadsWeights(Protocol):
    """A vLLM model: its own ``load_weights`` places the source tensors."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


def materialized(meta: torch.Tensor) -> torch.Tensor:
    """A meta tensor made real and zeroed: vLLM's ``materialize_meta_tensor`` leaves it uninitialized, so a region
    no weight loader writes (padding: vocabulary rows, experts, packed columns) would hold whatever the allocator
    had, and the save would record it (vLLM #50523). Zeros are what a fresh page holds, the same on every run."""
    return _vllm_compat.materialize_meta_tensor(meta).zero_()


def _rebind(tensor: torch.Tensor, old: object, new: object) -> torch.Tensor:
    """Point the methods a tensor carries (its ``weight_loader``) from module ``old`` to ``new``."""
    for key, value in list(tensor.__dict__.items()):
        if isinstance(value, MethodType) and value.__self__ is old:
            tensor.__dict__[key] = value.__func__.__get__(new)
    return _vllm_compat.restore_layer_refs(tensor, new)


class Rebuilder:
    """The shadow of a live model, fed the source weights; ``capture`` gives what the capture loader would."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: Any,
        device: torch.device,
        policy: CapturePolicy,
        spill_dir: str | None = None,
    ):
        refuse_model_level_hook(model)
        _refuse_online_quantization(model)
        self.model, self.model_config, self.device, self.policy = model, model_config, device, policy
        self.spill = SpillFile(spill_dir)  # pre-step copies of raw layers: on the output's file system
        self.copies = PreStepCopies(self.spill)
        self.results: dict[str, CapturedLayer] = {}
        self.deferred: list[_Layer] = []
        self._read_by_attention: set[int] = set()  # ids of the shadow's layers inside an attention layer
        self._owners: dict[int, list[_Layer]] = {}
        self._real: dict[int, torch.Tensor] = {}  # meta tensor id -> its materialized tensor (ties share one)
        self.layers: dict[str, _Layer] = {}
        self.skip, self.skip_load = _vllm_compat.skip_tensors()
        self._forked: dict[int, Any] = {}  # fork_state's memo: objects layers share stay shared in the shadow
        owned = owned_quant_methods(model)
        # every module's copy first: state forked below that refers to another module of the model (MLA's
        # attention impl holds its kv_b_proj) then refers to that module's copy, never to the live one
        self._forked.update({id(module): copy.copy(module) for module in model.modules()})
        self.shadow = self._copy(model, "", owned)

    # -- the shadow ----------------------------------------------------------------------------------------------

    def _copy(self, live: torch.nn.Module, path: str, owned: set[int], memo: dict | None = None) -> torch.nn.Module:
        memo = {} if memo is None else memo
        if id(live) in memo:  # a module under two paths (MLA's kv_b_proj, in its layer and its attention): one copy
            return memo[id(live)]
        shadow = memo[id(live)] = self._forked[id(live)]
        before = _PRE_STEP_ATTRIBUTES.get(live)
        if before is None and has_post_load(live):
            raise NotReproducibleError(
                f"{path}: this engine's state before vLLM's post-load step was not recorded (tensorizer-manifest's "
                "vLLM plugin was not installed when it loaded); restart it with tensorizer-manifest installed, or "
                "load it with load_format='tensorizer_manifest_capture'"
            )
        if before is not None:
            shadow.__dict__.clear()
            shadow.__dict__.update(fork_state(before, self._forked))
        # names registered as None (``register_parameter("input_scale", None)``) are state a step reads too
        shadow._parameters = {name: None for name, value in live._parameters.items() if value is None}
        shadow._buffers = {name: None for name, value in live._buffers.items() if value is None}
        shadow._modules = {}
        shadow._non_persistent_buffers_set = set(live._non_persistent_buffers_set)
        for name, child in live._modules.items():
            shadow._modules[name] = (
                None if child is None else self._copy(child, f"{path}.{name}" if path else name, owned, memo)
            )
        if id(live) not in owned:
            layer = _Layer(path, live, shadow)
            for name, (tensor, kind, _) in self._as_created(live).items():
                meta = memo.get(id(tensor))
                if meta is None:
                    meta = _rebind(_vllm_compat.to_meta_tensor(tensor), live, shadow)
                    memo[id(tensor)] = meta
                    self._wrap_loader(meta, name)
                (shadow._parameters if kind == "parameter" else shadow._buffers)[name] = meta
                self._owners.setdefault(id(meta), []).append(layer)
                if name not in self.skip_load:
                    layer.loadable += _vllm_compat.load_numel(meta)
            self.layers[path] = layer
        return shadow

    def _as_created(self, live: torch.nn.Module) -> dict[str, tuple[torch.Tensor, str, bool]]:
        """A live module's tensors as its constructor made them: vLLM's record for a layer with a post-load
        step (the step may have replaced them), the live ones for the rest (the step never touches them)."""
        created = _vllm_compat.created_tensors(live) if has_post_load(live) else None
        if created is None:
            return module_tensors(live)
        params, buffers = created
        out = {name: (t, "parameter", True) for name, t in params.items()}
        out |= {name: (t, "buffer", name not in live._non_persistent_buffers_set) for name, t in buffers.items()}
        for name, entry in module_tensors(live).items():  # what vLLM does not record (a bias made after)
            if name in self.skip:
                out.setdefault(name, entry)
        return out

    def _wrap_loader(self, meta: torch.Tensor, name: str) -> None:
        original = getattr(meta, "weight_loader", None) or _vllm_compat.default_weight_loader()
        signature = inspect.signature(original)
        first = next(iter(signature.parameters))

        def counting_loader(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            numel, answer = _vllm_compat.numel_loaded(original, bound)  # onto the meta tensor: counts, no bytes
            for layer in self._owners.get(id(meta), []):
                if layer.done:
                    continue  # a loader that loads a small field again (CT-WNA16's weight_shape per shard)
                layer.loads.append((name, bound, original, first))
                layer.loaded += numel
                if layer.loadable and layer.loaded >= layer.loadable:
                    self._finish(layer)
            return answer

        cast(WeightLoaded, meta).weight_loader = counting_loader

    # -- a layer whose weights are all in ----------------------------------------------------------------------

    def _materialize(self, layer: _Layer) -> dict[str, torch.Tensor]:
        loaded_names = {name for name, *_ in layer.loads}
        live_tensors = {name: t for name, (t, _, _) in module_tensors(layer.live).items()}
        real = {}
        for store in _tensor_stores(layer.shadow):
            for name, meta in list(store.items()):
                if meta is None:
                    continue
                layer.metas[name] = (store, meta)
                if id(meta) not in self._real:
                    with self.device:
                        tensor = materialized(meta)
                    if name not in loaded_names:  # never in the source: it holds what the engine made at init
                        kept = live_tensors.get(name)
                        if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
                            kept = self._initial(layer).get(name)
                        if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
                            raise NotReproducibleError(
                                f"{layer.path}.{name} is not in the source weights and the engine no longer holds "
                                "it as created (its post-load step replaced it); save with load_format="
                                "'tensorizer_manifest_capture' or `tensorizer-manifest save SRC OUT` instead"
                            )
                        tensor.copy_(kept)
                    self._real[id(meta)] = tensor
                store[name] = real[name] = self._real[id(meta)]
        return real

    def _initial(self, layer: _Layer) -> dict[str, torch.Tensor]:
        """Tensors no source holds, made again as the engine made them at init (its dtype, on a copy of the
        layer without tensors): an attention layer's default scales (``_k_scale``: vLLM's
        ``set_default_quant_scales``), and what a quant method whose ``create_weights`` needs nothing but the
        layer makes (the KV-cache methods' ``k_scale``, deleted by the step). Other methods' tensors all come
        from the source."""
        bare = copy.copy(layer.shadow)  # its attributes (num_kv_heads...), none of its tensors
        bare._parameters, bare._buffers, bare._modules = {}, {}, {}
        method = layer.shadow.__dict__.get("quant_method")
        create = getattr(method, "create_weights", None)
        with _vllm_compat.default_dtype(self.model_config.dtype), self.device:
            if "_k_scale" in layer.metas:  # an attention layer: its scales as its __init__ sets them
                _vllm_compat.set_default_quant_scales(bare)
            if create is not None and len(inspect.signature(create).parameters) == 1:
                create(bare)
        return {name: tensor for name, (tensor, _, _) in module_tensors(bare).items()}

    def _finish(self, layer: _Layer) -> None:
        if layer.done:
            return
        layer.done = True
        real = self._materialize(layer)
        for name, bound, original, first in layer.loads:
            bound.arguments[first] = real[name]
            original(*bound.args, **bound.kwargs)
        for tensor in real.values():  # the loaders as vLLM made them, not the counting ones
            if getattr(tensor, "weight_loader", None) is not None:
                tensor.__dict__.pop("weight_loader", None)
        layer.loads.clear()
        steps = [kind for _, module, kind in post_load_steps(layer.shadow) if module is layer.shadow]
        before = snapshot_module(layer.shadow, self.copies if steps else None)
        self.copies.forget()  # its memo is by id(), and this layer's tensors are freed before the next one's
        if QUANT_METHOD_STEP in steps:
            run_post_load_step(layer.shadow, QUANT_METHOD_STEP, self.model_config, self.device)
        layer.before = before
        if ATTENTION_STEP in steps or id(layer.shadow) in self._read_by_attention:
            # vLLM runs attention steps after every quant-method step, and one may read (MLA: kv_b_proj's
            # weight) or change (MLA on AMX empties it) a layer inside it: that layer is classified after them
            self.deferred.append(layer)
        else:
            self._classify(layer)

    def _classify(self, layer: _Layer) -> None:
        after = snapshot_module(layer.shadow, None)
        captured = classify(layer.path, layer.shadow, layer.before, after, self.policy)
        live = snapshot_module(layer.live, None)
        for name, slot in live.tensors.items():
            rebuilt = after.tensors.get(name)
            if rebuilt is None or not same_bytes(rebuilt.tensor, slot.tensor):
                raise _changed_after_loading(f"{layer.path}.{name}")
        self._compare_kernels(layer, live)
        captured.module = layer.live
        if captured.state == "processed":
            captured.tensors = live.tensors  # the same bytes: written from the engine, not from the shadow
        self.results[layer.path] = captured
        for store in _tensor_stores(layer.shadow):
            store.clear()  # the rebuilt tensors go (the pre-step copies are on disk); the meta ones come back
        for name, (store, meta) in layer.metas.items():
            store[name] = meta
            self._real.pop(id(meta), None)
        layer.before = None

    def _compare_kernels(self, layer: _Layer, live: ModuleSnapshot) -> None:
        """Where vLLM's step hides a weight inside a kernel (oneDNN on AVX-512 and AMX empties linear weights;
        W8A8-int8 keeps only a handle), comparing tensors compares nothing: a linear layer's kernel is run, the
        live one and the rebuilt one, on the same inputs, and must answer bit for bit. A layer of another kind
        whose step hides a weight cannot be compared, and is refused."""
        self._compare_impl_tensors(layer)
        if _vllm_compat.is_linear_layer(layer.live) and self._emptied_by_attention(layer, live):
            return  # never run: the attention layer serves its packed copies, compared with that layer's impl
        if not _vllm_compat.is_linear_layer(layer.live):
            hidden = sorted(
                name
                for name, slot in layer.before.tensors.items()
                if slot.tensor.numel() and (name not in live.tensors or not live.tensors[name].tensor.numel())
                and name in layer.live._parameters  # emptied or set to None in place, not deleted
            )  # fmt: skip
            if hidden:
                raise UnsupportedModelError(
                    f"{layer.path} ({type(layer.live).__name__}): vLLM's post-load step hides {', '.join(hidden)} "
                    "inside its kernel, and only linear layers can be compared by running them; save it with "
                    "`tensorizer-manifest save SRC OUT` instead"
                )
            return
        linears = (cast(_LinearLayer, layer.live), cast(_LinearLayer, layer.shadow))  # vLLM's (checked above)
        features = getattr(linears[0], "input_size_per_partition", None) or linears[0].input_size
        probe = torch.randn(
            _PROBE_ROWS, features, generator=torch.Generator().manual_seed(_PROBE_SEED), dtype=torch.float32
        ).to(device=self.device, dtype=self.model_config.dtype)
        try:
            answers = [module.quant_method.apply(module, probe) for module in linears]
        except Exception as exc:  # noqa: BLE001 -- any failure means this layer cannot be compared
            raise UnsupportedModelError(
                f"{layer.path} ({type(layer.live).__name__}): its kernel cannot be run on a probe input to compare "
                f"it with the rebuilt layer ({type(exc).__name__}: {exc}); save it with `tensorizer-manifest save "
                "SRC OUT` instead"
            ) from exc
        if not same_bytes(*answers):
            raise _changed_after_loading(f"{layer.path}'s kernel", "answers differently from the one")

    def _emptied_by_attention(self, layer: _Layer, live: ModuleSnapshot) -> bool:
        """A linear layer inside an attention layer whose step emptied its weight (MLA on AMX releases
        ``kv_b_proj.weight`` after packing its own copies on the impl): in the engine too, so it is never run."""
        weight = live.tensors.get("weight")
        return id(layer.shadow) in self._read_by_attention and weight is not None and weight.tensor.numel() == 0

    @staticmethod
    def _compare_impl_tensors(layer: _Layer) -> None:
        """The tensors an attention step keeps on the layer's impl (MLA on AMX: ``_w_uk_packed``, ``_w_uv_packed``,
        derived from ``kv_b_proj``) are what the engine computes with: the rebuilt ones must be the same bytes."""
        live_impl, rebuilt_impl = getattr(layer.live, "impl", None), getattr(layer.shadow, "impl", None)
        if live_impl is None or rebuilt_impl is None:
            return
        for name, value in vars(live_impl).items():
            if not isinstance(value, torch.Tensor):
                continue
            rebuilt = vars(rebuilt_impl).get(name)
            if not isinstance(rebuilt, torch.Tensor) or not same_bytes(rebuilt, value):
                raise _changed_after_loading(f"{layer.path}: the attention kernel's {name}")

    # -- the whole model ---------------------------------------------------------------------------------------

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Feed the source weights to the model's own ``load_weights`` on the shadow, then finish every layer.

        An attention step may read or change the weights of layers inside it (MLA's reads its ``kv_b_proj``):
        those are classified, and their rebuilt tensors kept, until the attention steps have run, as the capture
        loader sees them (after every step)."""
        self._read_by_attention = {
            id(inner)
            for _, module, kind in post_load_steps(self.shadow)
            if kind == ATTENTION_STEP
            for inner in module.modules()
            if inner is not module
        }
        cast(_LoadsWeights, self.shadow).load_weights(weights)  # a copy of vLLM's model
        for layer in self.layers.values():
            if not layer.done:
                self._finish(layer)  # padded, tied or weightless: all it will get is in
        for _, module, kind in post_load_steps(self.shadow):
            if kind == ATTENTION_STEP:
                run_post_load_step(module, ATTENTION_STEP, self.model_config, self.device)
        for layer in self.deferred:
            self._classify(layer)

    def capture(self, fingerprint: Fingerprint) -> Capture:
        """What the capture loader would have recorded, in its order (the live model's modules)."""
        layers = []
        for path, _ in self.model.named_modules():
            captured = self.results.get(path)
            if captured is not None and (captured.tensors or captured.runtime_state or captured.kernels):
                layers.append(captured)
        self.copies.forget()
        return Capture(fingerprint=fingerprint, layers=layers, spill=self.spill)

    def close(self) -> None:
        self.spill.close()


def _refuse_online_quantization(model: torch.nn.Module) -> None:
    """A layer vLLM quantizes at load (``uses_meta_device``: its weights are made on the meta device and
    quantized by ``finalize_layerwise_processing``) has no pre-step state of its own to rebuild."""
    for path, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "uses_meta_device", False):
            raise UnsupportedModelError(
                f"{path}: this engine quantizes it at load ({type(method).__name__}, online quantization), which a "
                "running engine's save cannot rebuild; save it with `tensorizer-manifest save SRC OUT` and the "
                "same quantization instead"
            )


def _source_weights(loader: Any, model_config: Any, model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The engine's source weights as vLLM's default loader reads them; gone or unreadable, a typed error
    before anything is rebuilt (vLLM finds its files when the first weight is asked for)."""
    weights = iter(loader.get_all_weights(model_config, model))
    while True:
        try:
            item = next(weights)
        except StopIteration:
            return
        except (OSError, RuntimeError, ValueError) as exc:  # gone at the start, or a shard gone since
            raise CheckpointNotFoundError(
                f"the source weights of this engine ({model_config.model}) cannot be read ({exc}): its state "
                "before vLLM's post-load step cannot be rebuilt; put them back, or save from the source with "
                "`tensorizer-manifest save SRC OUT`"
            ) from None
        yield item


def capture_running_engine(
    model: torch.nn.Module,
    vllm_config: Any,
    policy: CapturePolicy,
    fingerprint: Fingerprint,
    spill_dir: str | None = None,
) -> Capture:
    """Rebuild what the capture loader records, for an engine loaded by vLLM's default loader. ``spill_dir``: where
    the raw layers' pre-step copies go (``spill.spill_dir``), about their size: the output's file system, not a
    RAM-backed ``/tmp``."""
    model_config, load_config = vllm_config.model_config, vllm_config.load_config
    if load_config.load_format not in ("auto", "safetensors", "pt", "npcache"):
        raise UnsupportedModelError(
            f"this engine loaded its weights with load_format={load_config.load_format!r}; only an engine vLLM's "
            "default loader loaded (from safetensors or .bin) can be rebuilt from its source"
        )
    device = _vllm_compat.load_device(vllm_config, load_config)
    loader = _vllm_compat.default_model_loader(_vllm_compat.source_load_config(load_config, load_config.load_format))
    _vllm_compat.apply_expert_parallel_filter(loader, vllm_config, model)  # as the engine read them: its experts only
    rebuilder = Rebuilder(model, model_config, device, policy, spill_dir)
    try:
        # vLLM's loader runs every step under the model's dtype as torch's default: a step reads it (W8A8-int8's
        # oneDNN handle takes its output dtype from it; outside it, the handle writes float32 into bf16 outputs)
        with torch.no_grad(), _vllm_compat.default_dtype(model_config.dtype):
            rebuilder.load(_source_weights(loader, model_config, model))
        return rebuilder.capture(fingerprint)
    except BaseException:
        rebuilder.close()
        raise
