"""Loading layers from the layout-free base: the source's tensors, through the model's own ``load_weights``.

A generation whose form sets have no manifest for this engine's layout and rank (saved at TP=1, loaded at TP=2
or at two pipeline stages) is loaded the way vLLM's default loader loads the source it came from: the model's
``load_weights`` is handed the base's tensors, so vLLM's weight loaders shard, stack and place them for this
rank, layout and release; then vLLM's post-load step runs once on each layer that has one, and the modules' own
hooks that vLLM's step runs after them (``_vllm_compat.own_post_load_hooks``). What differs from
the default loader is what the checkpoint adds: only the tensors this rank's layers were observed to take are
read (a pipeline stage reads its own layers'), each is checked against its content hash before any step runs,
and every parameter those layers took at the save must be filled again, else the load is refused
(``IntegrityError`` naming the layer and the parameter): nothing half-loaded is served.

A form set stores only what vLLM's step changed: its other layers (raw, left alone by the step, raw fallbacks)
are fed from the base the same way at the form set's own layout and release (``feed_layers``), and then hold
what the save recorded for them, content hashes included, or the load is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from .. import _vllm_compat
from ..errors import IntegrityError
from ..format.generation import BaseDocument, Layout
from ..format.schema import ModuleRecord
from ..live_model.layers import post_load_steps
from ..live_model.sources import ObservedSource, SourceObserver
from ..live_model.tensors import dtype_name, hash_tensor
from ..storage.tensor_file import TensorFileReader
from .replay import run_post_load_step


def live_modules(model: torch.nn.Module) -> set[str]:
    """The module paths this rank holds: a pipeline stage's other layers are vLLM's ``PPMissingLayer``s."""
    return {path for path, module in model.named_modules() if type(module).__name__ != "PPMissingLayer"}


def load_from_base(
    model: torch.nn.Module,
    base: BaseDocument,
    reader: TensorFileReader,
    model_config: Any,
    target_device: torch.device,
    *,
    verify_hashes: bool = True,
    around_steps: Callable[[torch.nn.Module, Callable[[], None], dict[str, list[str]]], None] | None = None,
    not_this_ranks: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """Fill this rank's layers from the base and run vLLM's post-load step once on each; returns the report.
    ``around_steps(model, run_steps, filled)`` runs the steps itself, around what it observes (``add-form`` at this
    layout records the processed form they make, as the capture loader does at a save; ``filled``: the parameters
    vLLM's weight loaders filled, by module, which its form set can leave to the base). ``not_this_ranks(name)``:
    a source tensor this rank does not read although its layer took it at the save (with expert parallelism,
    another rank's experts: vLLM's default loader's own filter)."""
    live = live_modules(model)
    seen, loaded = _feed(model, base, reader, live, verify_hashes, not_this_ranks)
    if getattr(model_config, "quantization", None) is None and loaded is not None:
        _refuse_unloaded(set(loaded), model, base, reader)
    steps: list[str] = []

    def run_steps() -> None:
        for path, module, kind in post_load_steps(model):
            run_post_load_step(module, kind, model_config, target_device)
            steps.append(f"{path}:{kind}")
        steps.extend(f"{path}:own_hook" for path in _vllm_compat.run_own_post_load_hooks(model))

    if around_steps is None:
        run_steps()
    else:
        around_steps(model, run_steps, seen.loaded)
    return {
        "source": "base",
        "tensors_read": len(seen.records),
        "tensors_in_base": len(base.tensors),
        "bytes_read": sum(record.nbytes for record in seen.records),
        "layers_fed": sorted(path for path in seen.loaded if path in live),
        "post_load": steps,
        "restored": [],
        "verify_hashes": verify_hashes,
    }


def feed_layers(
    model: torch.nn.Module,
    base: BaseDocument,
    reader: TensorFileReader,
    records: list[ModuleRecord],
    *,
    verify_hashes: bool = True,
    not_this_ranks: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """Fill the layers of ``records`` (a form set's layers that it leaves to the base, ``schema.held_by_base``)
    through the model's ``load_weights``, from the source tensors they took at the save; then each must hold its
    records' tensors (form, and content hash with ``verify_hashes``): what the same release's weight loaders made
    at this layout when it was saved. No step runs here: the caller's replay runs each once. Returns counts for
    the load report."""
    paths = {record.path for record in records}
    seen, _ = _feed(model, base, reader, paths, verify_hashes, not_this_ranks)
    for record in records:
        _refuse_other_than_saved(model.get_submodule(record.path), record, verify_hashes, reader)
    return {
        "layers_fed": sorted(paths),
        "base_tensors_read": len(seen.records),
        "base_bytes_read": sum(record.nbytes for record in seen.records),
    }


def _feed(
    model: torch.nn.Module,
    base: BaseDocument,
    reader: TensorFileReader,
    modules: set[str],
    verify_hashes: bool,
    not_this_ranks: Callable[[str], bool] | None,
) -> tuple[ObservedSource, Any]:
    """The base tensors that ``modules`` took at the save, through ``load_weights``, each checked against its
    content hash; every parameter those modules took must be filled again. Returns what was observed and what
    ``load_weights`` returned."""
    needed = [t for t in base.needed_by(modules) if not_this_ranks is None or not not_this_ranks(t.name)]
    expected = {record.name: record for record in needed}
    observer = SourceObserver(Layout(), content_hashes=verify_hashes)
    with observer.watching(model):
        # A base's records are all stored (each has its key); one that had none would be refused as unfilled below.
        keys = [record.key for record in needed if record.key is not None]
        loaded = cast(Any, model).load_weights(observer.source(reader.stream(keys=keys)))  # every vLLM model has it
    seen = observer.observed
    for record in seen.records:
        if verify_hashes and record.hash != expected[record.name].hash:
            raise IntegrityError(
                f"{reader.path.name}: content hash of base tensor {record.name!r} does not match the base; the file "
                "is damaged: nothing was served. Save the checkpoint again"
            )
    _refuse_unfilled(base, seen.loaded, modules, model, reader)
    return seen, loaded


def _refuse_other_than_saved(
    module: torch.nn.Module, record: ModuleRecord, verify_hashes: bool, reader: TensorFileReader
) -> None:
    """A layer fed from the base holds what the save recorded for it, or the load is refused."""
    held = dict(module.named_parameters(recurse=False))
    for saved in record.tensors:
        tensor = held.get(saved.name)  # a layer fed from the base has parameters only, no alias (checks.records)
        form_differs = tensor is None or (
            (dtype_name(tensor.dtype), list(tensor.shape), list(tensor.stride()), tensor.storage_offset())
            != (saved.dtype, saved.shape, saved.stride, saved.storage_offset)
        )
        hash_differs = tensor is not None and verify_hashes and saved.nbytes and hash_tensor(tensor.data) != saved.hash
        if form_differs or hash_differs:
            raise IntegrityError(
                f"{reader.path.name}: layer {record.path!r} was fed from the base, and its {saved.name!r} is not "
                f"what the save recorded ({'its form' if form_differs else 'its content hash'} differs): this vLLM's "
                "weight loaders do not make it again from the source: nothing was served. Load with "
                "source='base', or save the checkpoint again"
            )


def _refuse_unfilled(
    base: BaseDocument, filled: dict[str, list[str]], live: set[str], model: torch.nn.Module, reader: TensorFileReader
) -> None:
    """Every parameter a live layer took from the source at the save must have been filled now, on this layer or,
    where this release keeps it one module deeper (0.31's ``experts.routed_experts``), on the module below that
    holds it."""
    for path, names in base.loaded.items():
        if path not in live:
            continue
        module = model.get_submodule(path)
        own = dict(module.named_parameters(recurse=False))
        deeper = [inner for inner, _ in module.named_parameters() if "." in inner]
        missing = []
        for name in names:
            held = [name] if name in own else [inner for inner in deeper if inner.rpartition(".")[2] == name]
            for inner in held:
                owner = f"{path}.{inner}".rpartition(".")[0]
                if name not in filled.get(owner, ()):
                    missing.append(inner)
        if missing:
            wanted = sorted(n for n, paths in base.consumers.items() if path in paths)
            raise IntegrityError(
                f"{reader.path.name}: layer {path!r} took {', '.join(missing)} from the source at the save, and the "
                f"base did not fill it now (the base tensors it took: {', '.join(wanted[:6]) or 'none'}); the base "
                "lacks a tensor this layer needs: nothing was served. Save the checkpoint again"
            )


def _refuse_unloaded(loaded: set[str], model: torch.nn.Module, base: BaseDocument, reader: TensorFileReader) -> None:
    """vLLM's default loader's own check of an unquantized model (``track_weights_loading``, the same rule in 0.31
    and 0.32): every parameter came from the source, except those of a module whose quant method has a post-load
    step (vLLM exempts them: they may be built there). A release whose model has a parameter the saving one's did
    not meets a base without it. The names are this release's: 0.31 keeps a MoE's experts one module deeper
    (``experts.routed_experts``) than 0.32, where the save observed them."""
    exempt = {
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        if (method := getattr(module, "quant_method", None)) is not None
        and (getattr(method, "uses_meta_device", False) or getattr(method, "process_weights_after_loading", None))
        for name, _ in module.named_parameters()
    }
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded and name not in exempt)
    if missing:
        layer, _, param = missing[0].rpartition(".")
        raise IntegrityError(
            f"{reader.path.name}: the base lacks a tensor that layer {layer!r} needs (its parameter {param!r}"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} got nothing from the base's "
            f"{len(base.tensors)} tensors): nothing was served. Load it with the vLLM release that saved it, or "
            "save it again from its source"
        )
