"""Load side: check the manifest against a freshly built model, then restore its tensors exactly.

``check_model`` (and ``validate.check_files`` before it) run before a byte of
weights is read; ``restore_tensors`` then puts every recorded tensor into the
model with its dtype, layout, Parameter class and ties. Replay comes after
(``replay``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import torch

from .. import _vllm_compat
from ..errors import CompatibilityError, IntegrityError
from ..format.schema import Manifest, ModuleRecord, TensorRecord, full_name, qualified_class
from ..live_model.layers import has_post_load, module_tensors
from ..live_model.tensors import dtype_name, hash_tensor, make_parameter, materialize
from ..progress import ProgressCallback, ProgressCounter
from ..restorers import RESTORERS
from ..storage.tensor_file import TensorFileReader
from .layer_forms import kernel_differences


def check_model(manifest: Manifest, model: torch.nn.Module) -> None:
    """Compare a freshly built model with the manifest, layer by layer, before any weights are read."""
    records = manifest.module_map()
    problems: list[tuple[str, object, object]] = []
    modules = dict(model.named_modules())
    for path, module in modules.items():
        if path not in records and (module_tensors(module) or has_post_load(module)):
            problems.append((f"{path or '<root>'}", "absent from the manifest", type(module).__name__))
    for path, record in records.items():
        module = modules.get(path)
        if module is None:
            problems.append((path, "recorded in the manifest", "absent from this model"))
            continue
        if qualified_class(module) != record.module_class:
            problems.append((f"{path}.module_class", record.module_class, qualified_class(module)))
        quant_method = getattr(module, "quant_method", None)
        current_qm = qualified_class(quant_method) if quant_method is not None else None
        if current_qm != record.quant_method:
            problems.append((f"{path}.quant_method", record.quant_method, current_qm))
        # Kernels the model already has when built must match for layers a restorer replays;
        # raw layers get theirs chosen again by vLLM's own step.
        if record.state == "processed" and record.replay != "none":
            for owner, attr, saved_class, now in kernel_differences(record, module):
                problems.append((f"{path}.{owner}.{attr}", saved_class, now))
        problems.extend(_check_layer_tensors(path, record, module))
    if problems:
        detail = "; ".join(f"{what}: saved {a}, this engine {b}" for what, a, b in problems[:20])
        more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        raise CompatibilityError(
            f"the checkpoint does not match the model this engine builds: {detail}{more}. "
            "Load it with the engine settings it was saved with, or re-save it on this engine.",
            problems,
        )
    check_forms(manifest, model)


def check_forms(manifest: Manifest, model: torch.nn.Module) -> None:
    """Refuse processed layers whose tensors are in a layout this machine's kernels would not produce.

    Each restorer computes, from the freshly built layer, the layout vLLM's step
    would write here (``Restorer.form``); the manifest holds the saving machine's.
    """
    differences: list[tuple[str, object, object]] = []
    for record in manifest.modules:
        restorer = RESTORERS.get(record.replay) if record.state == "processed" else None
        if restorer is None:
            continue
        made_here = restorer.form(model.get_submodule(record.path))
        if made_here != record.form:
            differences.append((record.path, record.form, made_here))
    if not differences:
        return
    path, saved, here = differences[0]
    more = f" (and {len(differences) - 1} more layers)" if len(differences) > 1 else ""
    saved_cpu = ", ".join(manifest.fingerprint.cpu_features) or "unrecorded"
    try:
        this_cpu = ", ".join(_vllm_compat.cpu_features())
    except Exception:  # not a CPU platform
        this_cpu = manifest.fingerprint.device_type
    raise CompatibilityError(
        f"layer {path!r} was saved processed in the layout {saved} (saved on {saved_cpu}); vLLM on this "
        f"machine ({this_cpu}) would produce {here}{more}. Processed tensors only load where the kernel "
        "lays them out the same way: re-save the checkpoint on this kind of machine, or save it with "
        "--portable (every layer raw) to load it anywhere.",
        [(f"{p}.form", a, b) for p, a, b in differences],
    )


def _check_layer_tensors(path: str, record: ModuleRecord, module: torch.nn.Module) -> list[tuple[str, object, object]]:
    fresh = module_tensors(module)
    saved = {t.name: t for t in record.tensors}
    problems: list[tuple[str, object, object]] = []
    if record.state == "raw":
        if set(saved) != set(fresh):
            problems.append((f"{path} tensors", sorted(saved), sorted(fresh)))
            return problems
        for name, t in saved.items():
            tensor = fresh[name][0]
            if t.dtype != dtype_name(tensor.dtype) or t.shape != list(tensor.shape):
                problems.append(
                    (f"{path}.{name}", f"{t.dtype}{t.shape}", f"{dtype_name(tensor.dtype)}{list(tensor.shape)}")
                )
    else:
        restorer = RESTORERS.get(record.replay)
        unknown = set(saved) - set(fresh) - (restorer.creates_tensors(module) if restorer is not None else set())
        if unknown:
            problems.append(
                (f"{path} tensors", sorted(saved), f"{sorted(fresh)} (no restorer creates {sorted(unknown)})")
            )
    return problems


class HashChecker:
    """Content hashes checked on another thread while the readers go on (blake3 releases the GIL).

    ``check_layer`` waits for one layer's hashes: call it before anything may
    change that layer's tensors in place. ``check_all`` waits for the rest.
    """

    def __init__(self, file_name: str):
        self._file_name = file_name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensorizer-manifest-hash")
        self._pending: dict[str, list[tuple[str, Future[bool]]]] = {}

    def submit(self, layer: str, name: str, tensor: torch.Tensor, expected: str) -> None:
        future = self._pool.submit(lambda: hash_tensor(tensor) == expected)
        self._pending.setdefault(layer, []).append((name, future))

    def check_layer(self, layer: str) -> None:
        for name, future in self._pending.pop(layer, ()):
            if not future.result():
                raise IntegrityError(
                    f"{self._file_name}: content hash of {name!r} does not match the manifest; the file is damaged"
                )

    def check_all(self) -> None:
        for layer in list(self._pending):
            self.check_layer(layer)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _no_check(layer: str) -> None:
    return None


def without_layers(manifest: Manifest, paths: set[str]) -> Manifest:
    """``manifest`` less the layers ``paths`` (those fed from the base, ``from_base.feed_layers``): what the tensor
    files restore."""
    if not paths:
        return manifest
    return msgspec.structs.replace(manifest, modules=[m for m in manifest.modules if m.path not in paths])


def restore_tensors(
    model: torch.nn.Module,
    manifest: Manifest,
    reader: TensorFileReader,
    verify_hashes: bool = True,
    on_layer: Callable[[ModuleRecord, torch.nn.Module, Callable[[str], None]], None] | None = None,
    progress: ProgressCallback | None = None,
    sources: dict[str, TensorFileReader] | None = None,
) -> int:
    """Put every recorded tensor into the model: exact dtype, layout, class; ties re-made.

    Tensors are read in file order by the reader's parallel readers and placed
    as they arrive; tensors of the file that no record names (the form of a
    layer not chosen) are skipped, not read. Once a layer's tensors are all in place, ``on_layer(record,
    module, check_hashes)`` is called (in manifest order) while reading goes
    on; ``check_hashes(path)`` waits for that layer's content hashes. Every hash
    is checked before this returns. ``progress`` is called after each tensor is
    read. ``sources`` names, for layers whose tensors are in another file (a
    form ``add-form`` added), that file's reader. Returns the number of bytes read.
    """
    hashes = HashChecker(reader.path.name) if verify_hashes else None
    sources = sources or {}
    stored = [t for m in manifest.modules for t in m.tensors if t.alias_of is None and t.key is not None]
    counter = ProgressCounter(progress, len(stored), sum(t.nbytes for t in stored))
    # Only what this manifest's records name: an effective manifest (layer_forms.choose_forms) names one form a layer.
    # Each file is read in its own order: a layer's records are in the file of its form, in manifest order.
    wanted: dict[int, tuple[TensorFileReader, list[str]]] = {}
    for m in manifest.modules:
        source = sources.get(m.path, reader)
        keys = wanted.setdefault(id(source), (source, []))[1]
        keys.extend(t.key for t in m.tensors if t.alias_of is None and t.key is not None)
    streams = {i: _Arrivals(source, source.stream(keys=keys)) for i, (source, keys) in wanted.items()}

    total = 0
    try:
        for record in manifest.modules:
            module = model.get_submodule(record.path)
            take = streams[id(sources.get(record.path, reader))].take
            for t in record.tensors:
                name = full_name(record.path, t.name)
                if t.alias_of is not None:  # its target was recorded, so placed, before it
                    _place_alias(model, module, t, t.alias_of, name)
                    continue
                data = take(t.key) if t.key is not None else None
                if data is not None:
                    total += data.numel() * data.element_size()
                    counter.advance(data.numel() * data.element_size())
                    if hashes is not None:
                        hashes.submit(record.path, name, data, t.hash)
                _assign(module, t, materialize(t, data, name))
            if record.state == "processed":
                saved = {t.name for t in record.tensors}
                for name in list(module_tensors(module)):
                    if name not in saved:
                        delattr(module, name)
            if on_layer is not None:
                on_layer(record, module, hashes.check_layer if hashes is not None else _no_check)
        if hashes is not None:
            hashes.check_all()
    finally:
        for arrivals in streams.values():
            arrivals.stream.close()
        if hashes is not None:
            hashes.close()
    return total


class _Arrivals:
    """The tensors of one file as they arrive, in its order, held until their record takes them."""

    def __init__(self, reader: TensorFileReader, stream):
        self.reader, self.stream = reader, stream
        self._arrived: dict[str, torch.Tensor] = {}

    def take(self, key: str) -> torch.Tensor:
        while key not in self._arrived:
            got = next(self.stream, None)
            if got is None:
                raise IntegrityError(
                    f"{self.reader.path.name}: tensor {key!r} named in the manifest is not in the file"
                )
            self._arrived[got[0]] = got[1]
        return self._arrived.pop(key)


def _place_alias(
    model: torch.nn.Module, module: torch.nn.Module, record: TensorRecord, alias_of: str, name: str
) -> None:
    owner_path, _, attr = alias_of.rpartition(".")
    target = getattr(model.get_submodule(owner_path), attr)
    if record.dtype != dtype_name(target.dtype) or record.shape != list(target.shape):
        raise IntegrityError(f"{name!r} is recorded as an alias of {record.alias_of!r} but their dtype or shape differ")
    _place(module, record, target)


def _assign(module: torch.nn.Module, record: TensorRecord, data: torch.Tensor) -> None:
    if record.kind == "parameter":
        existing = module._parameters.get(record.name)
        if existing is not None and qualified_class(existing) == record.param_class:
            existing.data = data
            existing.requires_grad_(record.requires_grad)
            tensor: torch.Tensor = existing
        else:
            tensor = make_parameter(record, data)
    else:
        tensor = data
    _place(module, record, tensor)


def _place(module: torch.nn.Module, record: TensorRecord, tensor: torch.Tensor) -> None:
    name = record.name
    module._parameters.pop(name, None)
    module._buffers.pop(name, None)
    module.__dict__.pop(name, None)
    if record.kind == "parameter":
        module._parameters[name] = tensor  # type: ignore[assignment]
    else:
        module._buffers[name] = tensor
        if record.persistent:
            module._non_persistent_buffers_set.discard(name)
        else:
            module._non_persistent_buffers_set.add(name)
