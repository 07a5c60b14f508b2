"""What differs between two checkpoints: fingerprint, layers, state, kernels, forms, tensors, fallbacks. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from ..format.schema import Manifest, ModuleRecord, TensorRecord, kernel_map


@dataclass
class ManifestDiff:
    fingerprint: list[tuple[str, object, object]] = field(default_factory=list)
    layers_added: list[str] = field(default_factory=list)
    layers_removed: list[str] = field(default_factory=list)
    layers_changed: list[tuple[str, str, object, object]] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not (self.fingerprint or self.layers_added or self.layers_removed or self.layers_changed)

    def to_dict(self) -> dict:
        return {
            "same": self.same,
            "fingerprint": [{"field": f, "a": a, "b": b} for f, a, b in self.fingerprint],
            "layers_added": self.layers_added,
            "layers_removed": self.layers_removed,
            "layers_changed": [{"layer": p, "what": w, "a": a, "b": b} for p, w, a, b in self.layers_changed],
        }


def _layer_changes(a: ModuleRecord, b: ModuleRecord) -> list[tuple[str, object, object]]:
    changes: list[tuple[str, object, object]] = []
    for attr in ("module_class", "quant_method", "state", "replay"):
        if getattr(a, attr) != getattr(b, attr):
            changes.append((attr, getattr(a, attr), getattr(b, attr)))
    ka, kb = kernel_map(a.kernels), kernel_map(b.kernels)
    for key in sorted(set(ka) | set(kb)):
        if ka.get(key) != kb.get(key):
            changes.append((f"kernel {key[0]}.{key[1]}", ka.get(key), kb.get(key)))
    if a.form != b.form:
        changes.append(("form", a.form, b.form))
    changes += _tensor_changes("tensor", a.tensors, b.tensors)
    if bool(a.fallback) != bool(b.fallback):
        changes.append(("raw fallback", "present" if a.fallback else "absent", "present" if b.fallback else "absent"))
    else:
        changes += _tensor_changes("fallback tensor", a.fallback, b.fallback)
    ra = {(r.owner, r.name) for r in a.runtime_state}
    rb = {(r.owner, r.name) for r in b.runtime_state}
    if ra != rb:
        changes.append(("runtime_state", sorted(".".join(k) for k in ra), sorted(".".join(k) for k in rb)))
    return changes


def _tensor_changes(label: str, a: list[TensorRecord], b: list[TensorRecord]) -> list[tuple[str, object, object]]:
    changes: list[tuple[str, object, object]] = []
    ta = {t.name: t for t in a}
    tb = {t.name: t for t in b}
    for name in sorted(set(ta) | set(tb)):
        x, y = ta.get(name), tb.get(name)
        if x is None or y is None:
            changes.append((f"{label} {name}", "present" if x else "absent", "present" if y else "absent"))
            continue
        for attr in ("kind", "dtype", "shape", "stride", "param_class", "hash", "alias_of"):
            if getattr(x, attr) != getattr(y, attr):
                changes.append((f"{label} {name} {attr}", getattr(x, attr), getattr(y, attr)))
    return changes


def diff_manifests(a: Manifest, b: Manifest) -> ManifestDiff:
    result = ManifestDiff()
    fa, fb = msgspec.structs.asdict(a.fingerprint), msgspec.structs.asdict(b.fingerprint)
    result.fingerprint = [(k, fa[k], fb.get(k)) for k in fa if fa[k] != fb.get(k)]
    ma, mb = a.module_map(), b.module_map()
    result.layers_removed = [p for p in ma if p not in mb]
    result.layers_added = [p for p in mb if p not in ma]
    added_a, added_b = _added_forms(a), _added_forms(b)
    for path in ma:
        if path in mb:
            result.layers_changed += [(path, what, x, y) for what, x, y in _layer_changes(ma[path], mb[path])]
            if added_a.get(path, []) != added_b.get(path, []):
                result.layers_changed.append((path, "added forms", added_a.get(path, []), added_b.get(path, [])))
    return result


def _added_forms(manifest: Manifest) -> dict[str, list[dict]]:
    """Per layer, the forms other engines added: each one's recorded form and the CPU features it was made on."""
    by_path: dict[str, list[dict]] = {}
    for _, form in manifest.readable_forms():
        for record in form.modules:
            by_path.setdefault(record.path, []).append({"form": record.form, "on": form.fingerprint.cpu_features})
    return by_path
