"""Reading a checkpoint for people: one row per layer, and a summary. No torch, no vLLM."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec

from ..format.schema import AddedForm, Manifest, ModuleRecord, fed_from_base


def _short(qualified: str | None) -> str:
    if not qualified:
        return "-"
    head, _, rest = qualified.partition("[")
    name = (
        head.rsplit(".", 1)[-1]
        if "<lambda>" not in head
        else head.split(".<locals>")[0].rsplit(".", 1)[-1] + ".<lambda>"
    )
    return name + (f"[{rest}" if rest else "")


def layer_row(module: ModuleRecord, added: Sequence[tuple[int, ModuleRecord]] = ()) -> dict:
    stored = [t for t in module.tensors if t.alias_of is None]
    return {
        "path": module.path or "<root>",
        "module_class": _short(module.module_class),
        "quant_method": _short(module.quant_method),
        "kernels": [f"{k.attr}={_short(k.kernel_class)}" for k in module.kernels],
        "state": module.state,
        "from_base": fed_from_base(module.tensors),
        "replay": module.replay,
        "tensors": len(module.tensors),
        "aliases": len(module.tensors) - len(stored),
        "bytes": sum(t.nbytes for t in stored),
        "runtime_state": [f"{a.owner}.{a.name}" if a.owner != "layer" else a.name for a in module.runtime_state],
        "forms": forms_of(module, added),
    }


def _form(state: str, record: ModuleRecord) -> dict:
    stored = [t for t in record.tensors if t.alias_of is None]
    return {"state": state, "form": record.form, "tensors": len(stored), "bytes": sum(t.nbytes for t in stored)}


def forms_of(module: ModuleRecord, added: Sequence[tuple[int, ModuleRecord]] = ()) -> list[dict]:
    """The forms a layer can load in, in the order a loader tries them: its own, the forms other engines
    added (``added``: their index in ``added_forms`` and record), then the raw fallback."""
    own = _form(module.state, module)
    if not module.fallback:
        return [own]
    processed = [own, *(_form(f"processed (added form {i})", record) for i, record in added)]
    fallback = {
        "state": "raw fallback",
        "form": {},
        "tensors": len(module.fallback),
        "bytes": sum(t.nbytes for t in module.fallback),
    }
    return [*processed, fallback]


def summary(manifest: Manifest) -> dict:
    states = Counter(m.state for m in manifest.modules)
    replays = Counter(m.replay for m in manifest.modules)
    fp = manifest.fingerprint
    return {
        "format_version": manifest.format_version,
        "producer": manifest.producer,
        "model_class": _short(fp.model_class),
        "dtype": fp.dtype,
        "quantization": fp.quantization,
        "tensor_parallel": f"rank {fp.tensor_parallel_rank} of {fp.tensor_parallel_size}",
        "pipeline_parallel": f"rank {fp.pipeline_parallel_rank} of {fp.pipeline_parallel_size}",
        "device": fp.device_type + (f" {fp.device_capability}" if fp.device_capability else ""),
        "vllm_version": fp.vllm_version,
        "torch_version": fp.torch_version,
        "tensorizer_version": fp.tensorizer_version,
        "tensor_file": manifest.tensor_file.path,
        "tensor_file_bytes": manifest.tensor_file.size,
        "tensors_stored": manifest.tensor_file.tensor_count,
        "layers": len(manifest.modules),
        "raw_layers": states.get("raw", 0),
        "processed_layers": states.get("processed", 0),
        "layers_fed_from_base": sum(fed_from_base(m.tensors) for m in manifest.modules),
        "fallbacks_in_base": sum(fed_from_base(m.fallback) for m in manifest.modules),
        "layers_with_fallback": sum(1 for m in manifest.modules if m.fallback),
        "fallback_bytes": sum(t.nbytes for m in manifest.modules for t in m.fallback),
        "added_forms": [
            {
                "tensor_file": f.tensor_file.path,
                "layers": len(f.modules),
                "bytes": f.tensor_file.size,
                "vllm_version": f.fingerprint.vllm_version,
                "cpu_features": f.fingerprint.cpu_features,
            }
            if isinstance(f, AddedForm)
            else {"unreadable": f.reason}
            for f in manifest.added_forms
        ],  # fmt: skip
        "save_id": manifest.save_id,
        "replay": dict(sorted(replays.items())),
    }


def _fallback_cell(forms: list[dict]) -> str:
    if len(forms) < 2:
        return "-"
    own, *added, fallback = forms
    where = ", ".join(f"{k}={v}" for k, v in own["form"].items()) or "this kernel"
    also = f"; {len(added)} added form(s)" if added else ""
    return f"raw, {fallback['tensors']} tensors, {fallback['bytes']:,} bytes (processed only where {where}{also})"


def added_records(manifest: Manifest) -> dict[str, list[tuple[int, ModuleRecord]]]:
    """Per layer, the records of the forms other engines added for it, with their index."""
    by_path: dict[str, list[tuple[int, ModuleRecord]]] = {}
    for index, form in manifest.readable_forms():
        for record in form.modules:
            by_path.setdefault(record.path, []).append((index, record))
    return by_path


def as_json(manifest: Manifest) -> bytes:
    added = added_records(manifest)
    doc = {"summary": summary(manifest), "layers": [layer_row(m, added.get(m.path, [])) for m in manifest.modules]}
    return msgspec.json.format(msgspec.json.encode(doc), indent=2)


def render(manifest: Manifest, source: str, console) -> None:
    from rich.table import Table

    table = Table(title=f"{source}", show_lines=False, header_style="bold")
    # Names people search for are never folded; only the long lists are.
    columns = ("layer", "class", "quant method", "kernel", "state", "replay", "tensors", "bytes", "runtime state")
    with_fallbacks = any(m.fallback for m in manifest.modules)
    for column in columns + (("fallback",) if with_fallbacks else ()):
        table.add_column(column, no_wrap=column not in ("kernel", "runtime state", "fallback"), overflow="fold")
    added = added_records(manifest)
    for module in manifest.modules:
        row = layer_row(module, added.get(module.path, []))
        table.add_row(
            row["path"],
            row["module_class"],
            row["quant_method"],
            "\n".join(row["kernels"]) or "-",
            ("[yellow]raw[/yellow]" if row["state"] == "raw" else "[green]processed[/green]")
            + (", from the base" if row["from_base"] else ""),
            row["replay"],
            f"{row['tensors']}" + (f" ({row['aliases']} tied)" if row["aliases"] else ""),
            f"{row['bytes']:,}",
            ", ".join(row["runtime_state"]) or "-",
            *([_fallback_cell(row["forms"])] if with_fallbacks else []),
        )
    console.print(table)
    s = summary(manifest)
    console.print(
        f"[bold]{s['model_class']}[/bold] {s['dtype']}"
        f"{' ' + s['quantization'] if s['quantization'] else ''}, "
        f"TP {s['tensor_parallel']}, PP {s['pipeline_parallel']}, "
        f"{s['device']}; vLLM {s['vllm_version']}, torch {s['torch_version']}, tensorizer {s['tensorizer_version']}"
    )
    if s["layers_with_fallback"]:
        console.print(
            f"{s['layers_with_fallback']} processed layers keep a raw fallback ({s['fallback_bytes']:,} bytes): "
            "loaded processed where their form fits, through vLLM's step elsewhere"
        )
    for index, form in enumerate(s["added_forms"]):
        if "unreadable" in form:
            console.print(f"added form {index}: not read by this version, loaders skip it: {form['unreadable']}")
            continue
        console.print(
            f"added form {index}: {form['layers']} layers in {form['tensor_file']} ({form['bytes']:,} bytes), made "
            f"by vLLM {form['vllm_version']} on {', '.join(form['cpu_features']) or 'a device'}"
        )
    if s["layers_fed_from_base"] or s["fallbacks_in_base"]:
        console.print(
            f"{s['layers_fed_from_base']} layers (and {s['fallbacks_in_base']} raw fallbacks) are the base's: their "
            "tensors are as vLLM's weight loaders make them from the source, so the base feeds them at load and this "
            "file stores only what vLLM's step changed"
        )
    console.print(
        f"{s['layers']} layers: {s['processed_layers']} processed, {s['raw_layers']} raw; "
        f"{s['tensors_stored']} tensors, {s['tensor_file_bytes']:,} bytes in {s['tensor_file']}; "
        f"format v{s['format_version']} by {s['producer']}"
    )
