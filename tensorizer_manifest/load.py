"""Load side: check the manifest against a freshly built model, then restore its tensors exactly.

``check_model`` (and ``validate.check_files`` before it) run before a byte of
weights is read; ``restore_tensors`` then puts every recorded tensor into the
model with its dtype, layout, Parameter class and ties. Replay comes after
(``replay``).
"""

from __future__ import annotations

import torch

from .errors import CompatibilityError, IntegrityError
from .layers import find_kernels, has_post_load, module_tensors
from .schema import Manifest, ModuleRecord, TensorRecord, full_name, kernel_map, qualified_class
from .tensor_file import TensorFileReader
from .tensors import dtype_name, hash_tensor, make_parameter, materialize


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
            fresh_kernels = kernel_map(find_kernels(module))
            for (owner, attr), saved_class in kernel_map(record.kernels).items():
                now = fresh_kernels.get((owner, attr))
                if now is not None and now != saved_class:
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
        unknown = set(saved) - set(fresh)
        if unknown:
            problems.append(
                (f"{path} tensors", sorted(saved), f"{sorted(fresh)} (no restorer creates {sorted(unknown)})")
            )
    return problems


def restore_tensors(
    model: torch.nn.Module, manifest: Manifest, reader: TensorFileReader, verify_hashes: bool = True
) -> int:
    """Put every recorded tensor into the model: exact dtype, layout, class; ties re-made.

    Returns the number of bytes read.
    """
    total = 0
    aliases: list[tuple[torch.nn.Module, TensorRecord, str]] = []
    for record in manifest.modules:
        module = model.get_submodule(record.path)
        for t in record.tensors:
            name = full_name(record.path, t.name)
            if t.alias_of is not None:
                aliases.append((module, t, name))
                continue
            data = reader.read(t.key) if t.key is not None else None
            if data is not None:
                total += data.numel() * data.element_size()
                if verify_hashes and hash_tensor(data) != t.hash:
                    raise IntegrityError(
                        f"{reader.path.name}: content hash of {name!r} does not match the manifest; the file is damaged"
                    )
            _assign(module, t, materialize(t, data, name))
        if record.state == "processed":
            saved = {t.name for t in record.tensors}
            for name in list(module_tensors(module)):
                if name not in saved:
                    delattr(module, name)
    for module, t, name in aliases:
        owner_path, _, attr = t.alias_of.rpartition(".")
        target = getattr(model.get_submodule(owner_path), attr)
        if t.dtype != dtype_name(target.dtype) or t.shape != list(target.shape):
            raise IntegrityError(f"{name!r} is recorded as an alias of {t.alias_of!r} but their dtype or shape differ")
        _place(module, t, target)
    return total


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
