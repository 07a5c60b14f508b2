"""Crafted bad checkpoints: one mutation per rule, each with the typed error and the gist it must raise.

``mutate(directory)`` damages a copy of a good checkpoint in place. ``scope`` says
who must refuse it: ``offline`` cases are refused by ``validate`` with no engine
(and by the loader); ``engine`` cases need the loading engine's settings (they are
refused by ``validate`` given those settings, and by the loader).

Manifest edits are re-sealed (as anyone can recompute a ``digest`` seal), so that
each case reaches the rule it is about; ``manifest-edited-after-save`` is the one
edit left unsealed, refused by the seal itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from tensorizer_manifest.errors import ManifestError
from tensorizer_manifest.format.schema import decode_manifest, seal_manifest
from tensorizer_manifest.storage.tensor_file import read_index


@dataclass(frozen=True)
class BadInput:
    name: str
    mutate: Callable[[Path], None]
    error: str
    gist: str
    scope: str = "offline"
    engine: dict = field(default_factory=dict)
    """Engine arguments the loading engine is started with (scope "model"): a checkpoint fine as it is, refused
    by an engine set otherwise."""

    def __str__(self) -> str:
        return self.name


def _manifest_path(d: Path) -> Path:
    return next(d.glob("*.manifest.json"))


def _tensor_path(d: Path) -> Path:
    return d / json.loads(_manifest_path(d).read_text())["tensor_file"]["path"]


def reseal(doc: dict) -> None:
    """Seal an edited manifest document anew (a ``digest``), when it still decodes."""
    try:
        manifest = decode_manifest(json.dumps(doc).encode())
    except ManifestError:
        return  # refused while decoding, before its seal is read
    doc["seal"] = msgspec.to_builtins(seal_manifest(manifest))


def _edit(fn: Callable[[dict], None], sealed: bool = True) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        path = _manifest_path(d)
        doc = json.loads(path.read_text())
        fn(doc)
        if sealed:
            reseal(doc)
        path.write_text(json.dumps(doc))

    return mutate


def _stored(doc: dict) -> dict:
    """The first stored tensor record with at least two dimensions that no alias points to."""
    targets = {t["alias_of"] for m in doc["modules"] for t in m["tensors"] if t["alias_of"]}
    return next(
        t
        for m in doc["modules"]
        for t in m["tensors"]
        if t["key"] and len(t["shape"]) >= 2 and (f"{m['path']}.{t['name']}" if m["path"] else t["name"]) not in targets
    )


#: Another dtype of the same item size, so only the dtype differs.
_SAME_SIZE_DTYPE = {
    "bfloat16": "float16",
    "float16": "bfloat16",
    "float32": "int32",
    "int32": "float32",
    "int8": "uint8",
    "uint8": "int8",
}


def _write(data: bytes) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        _manifest_path(d).write_bytes(data)

    return mutate


def _truncate(by: int | None = None, to: int | None = None) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        path = _tensor_path(d)
        size = path.stat().st_size
        os.truncate(path, to if to is not None else size - by)

    return mutate


def _pad(d: Path) -> None:
    with open(_tensor_path(d), "ab") as f:
        f.write(b"\0" * 64)


def _flip_at(offset_of: Callable[[Path], int]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        path = _tensor_path(d)
        offset = offset_of(d)
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x5A]))

    return mutate


def _data_offset(d: Path) -> int:
    entry = max(read_index(_tensor_path(d)).values(), key=lambda e: e.data_length)
    return entry.data_offset + entry.data_length // 2


def _other_checkpoint_manifest(d: Path) -> None:
    """The manifest of another save of the same architecture, pointed at this tensor file."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/
    from helpers.synthetic import write_synthetic_checkpoint

    other = d.parent / (d.name + "-other")
    write_synthetic_checkpoint(other, seed=1234)
    doc = json.loads(_manifest_path(other).read_text())
    doc["tensor_file"]["path"] = _tensor_path(d).name
    reseal(doc)
    _manifest_path(d).write_text(json.dumps(doc))


def _symlink_out(d: Path) -> None:
    path = _tensor_path(d)
    outside = d.parent / (d.name + "-outside.tensors")
    os.replace(path, outside)
    os.symlink(outside, path)


def _garbage_same_size(d: Path) -> None:
    path = _tensor_path(d)
    path.write_bytes(os.urandom(path.stat().st_size))


def _first_module_with(doc: dict, pred) -> dict:
    return next(m for m in doc["modules"] if pred(m))


def _drop_unaliased_record(doc: dict) -> None:
    """Remove the last stored tensor record that no alias points to."""
    targets = {t["alias_of"] for m in doc["modules"] for t in m["tensors"] if t["alias_of"]}
    for module in reversed(doc["modules"]):
        for i, t in enumerate(module["tensors"]):
            name = f"{module['path']}.{t['name']}" if module["path"] else t["name"]
            if t["key"] and name not in targets:
                del module["tensors"][i]
                return
    raise AssertionError("no unaliased stored record")


def _set(path: list, value) -> Callable[[dict], None]:
    def fn(doc: dict) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return fn


BAD_INPUTS: list[BadInput] = [
    # the tensor file
    BadInput("tensor-file-truncated", _truncate(by=100), "IntegrityError", "truncated, padded or from another save"),
    BadInput("tensor-file-empty", _truncate(to=0), "IntegrityError", "truncated, padded or from another save"),
    BadInput("tensor-file-padded", _pad, "IntegrityError", "truncated, padded or from another save"),
    BadInput("tensor-data-flipped", _flip_at(_data_offset), "IntegrityError", "content hash"),
    BadInput("tensor-header-flipped", _flip_at(lambda d: 40), "IntegrityError", "header does not match|cannot read"),
    BadInput(
        "tensor-file-missing",
        lambda d: _tensor_path(d).unlink(),
        "CheckpointNotFoundError",
        "tensor file named by the manifest is missing",
    ),
    BadInput("tensor-file-garbage", _garbage_same_size, "IntegrityError", "header does not match|cannot read"),
    BadInput("tensor-file-symlink-out", _symlink_out, "ManifestError", "link out of the checkpoint directory"),
    # the manifest as bytes
    BadInput("manifest-not-json", _write(b'{"format_version": 1, '), "ManifestError", "not valid JSON"),
    BadInput("manifest-empty", _write(b""), "ManifestError", "empty"),
    BadInput("manifest-json-array", _write(b"[1, 2]"), "ManifestError", "Expected `object`"),
    BadInput(
        "manifest-future-version",
        _edit(_set(["format_version"], 3)),
        "ManifestVersionError",
        "format version 3 is newer than the version 2",
    ),
    BadInput(
        "manifest-version-zero", _edit(_set(["format_version"], 0)), "ManifestError", r">= 1 - at `\$.format_version`"
    ),
    BadInput(
        "manifest-missing-fingerprint",
        _edit(lambda doc: doc.pop("fingerprint")),
        "ManifestError",
        "missing required field `fingerprint`",
    ),
    BadInput(
        "manifest-missing-tensor-hash",
        _edit(lambda doc: _stored(doc).pop("hash")),
        "ManifestError",
        "missing required field `hash`",
    ),
    BadInput("manifest-unknown-field", _edit(_set(["surprise"], 1)), "ManifestError", "unknown field `surprise`"),
    BadInput(
        "manifest-edited-after-save",
        _edit(_set(["producer"], "someone else"), sealed=False),
        "IntegrityError",
        "modified after it was saved",
    ),
    BadInput(
        "manifest-seal-forged",
        _edit(_set(["seal", "hash"], "blake3:" + "0" * 64), sealed=False),
        "IntegrityError",
        "modified after it was saved",
    ),
    BadInput(
        "manifest-wrong-type",
        _edit(_set(["modules"], "all")),
        "ManifestError",
        r"Expected `array`, got `str` - at `\$.modules`",
    ),
    # tensor records
    BadInput(
        "record-changed-dtype",
        _edit(lambda doc: _stored(doc).update(dtype=_SAME_SIZE_DTYPE[_stored(doc)["dtype"]])),
        "IntegrityError",
        "in the file,|digest",
    ),
    BadInput(
        "record-changed-shape",
        _edit(lambda doc: _stored(doc).update(shape=_stored(doc)["shape"][::-1])),
        "IntegrityError",
        "in the file,|digest",
    ),
    BadInput(
        "record-negative-shape",
        _edit(lambda doc: _stored(doc).update(shape=[-1, *_stored(doc)["shape"][1:]])),
        "ManifestError",
        r">= 0 - at `\$.modules\[\d+\].tensors\[\d+\].shape\[0\]`",
    ),
    BadInput(
        "record-overflowing-shape",
        _edit(lambda doc: _stored(doc).update(shape=[2**40, 2**40])),
        "ManifestError",
        "describes more than",
    ),
    BadInput(
        "record-nbytes-mismatch",
        _edit(lambda doc: _stored(doc).update(nbytes=_stored(doc)["nbytes"] + 2)),
        "ManifestError",
        "nbytes",
    ),
    BadInput(
        "record-stride-rank", _edit(lambda doc: _stored(doc).update(stride=[1])), "ManifestError", "differ in rank"
    ),
    BadInput(
        "record-duplicated",
        _edit(
            lambda doc: _first_module_with(doc, lambda m: m["tensors"])["tensors"].append(
                dict(_first_module_with(doc, lambda m: m["tensors"])["tensors"][0])
            )
        ),
        "ManifestError",
        "recorded twice",
    ),
    BadInput("record-dropped", _edit(_drop_unaliased_record), "IntegrityError", "digest|not in the manifest"),
    BadInput(
        "record-hash-changed",
        _edit(lambda doc: _stored(doc).update(hash="blake3:" + "0" * 64)),
        "IntegrityError",
        "digest",
    ),
    BadInput(
        "record-hash-not-blake3",
        _edit(lambda doc: _stored(doc).update(hash="md5:1234")),
        "ManifestError",
        r"matching regex .* - at `\$.modules\[\d+\].tensors\[\d+\].hash`",
    ),
    BadInput(
        "record-alias-dangling",
        _edit(lambda doc: _stored(doc).update(alias_of="no.such.tensor", key=None)),
        "ManifestError",
        "alias of 'no.such.tensor'",
    ),
    BadInput(
        "record-arbitrary-class",
        _edit(lambda doc: _stored(doc).update(param_class="os.system")),
        "ManifestError",
        "not one the loader may build",
    ),
    BadInput(
        "record-dunder-attribute",
        _edit(lambda doc: _stored(doc)["param_attrs"].update(__class__="x")),
        "ManifestError",
        "may not start with '__'",
    ),
    BadInput(
        "module-duplicated",
        _edit(lambda doc: doc["modules"].append(doc["modules"][0])),
        "ManifestError",
        "recorded twice",
    ),
    BadInput(
        "module-raw-marked-processed",
        _edit(lambda doc: _first_module_with(doc, lambda m: m["state"] == "raw").update(state="processed")),
        "ManifestError",
        "cannot replay post_load",
    ),
    BadInput(
        "module-unknown-restorer",
        _edit(lambda doc: doc["modules"][0].update(replay="evil_restorer")),
        "ManifestError",
        "unknown replay 'evil_restorer'",
    ),
    BadInput(
        "tensor-count-mismatch",
        _edit(lambda doc: doc["tensor_file"].update(tensor_count=doc["tensor_file"]["tensor_count"] + 1)),
        "IntegrityError",
        "stored tensors recorded",
    ),
    # paths
    BadInput(
        "path-escapes-with-dotdot",
        _edit(lambda doc: doc["tensor_file"].update(path="../" + doc["tensor_file"]["path"])),
        "ManifestError",
        "plain file name inside the checkpoint directory",
    ),
    BadInput(
        "path-absolute",
        _edit(lambda doc: doc["tensor_file"].update(path="/etc/passwd")),
        "ManifestError",
        "plain file name inside the checkpoint directory",
    ),
    BadInput(
        "manifest-from-another-checkpoint",
        _other_checkpoint_manifest,
        "IntegrityError",
        "header does not match|content hash|truncated",
    ),
    # the engine that would load it (validate needs its settings; the loader knows them)
    BadInput(
        "saved-for-another-dtype",
        _edit(_set(["fingerprint", "dtype"], "float16")),
        "CompatibilityError",
        "dtype",
        "engine",
    ),
    BadInput(
        "saved-for-another-quantization",
        _edit(_set(["fingerprint", "quantization"], "fp8")),
        "CompatibilityError",
        "quantization",
        "engine",
    ),
    BadInput(
        "saved-for-another-parallel-size",
        _edit(_set(["fingerprint", "tensor_parallel_size"], 2)),
        "CompatibilityError",
        "tensor_parallel_size",
        "engine",
    ),
]

#: Only the model vLLM builds can show these (``validate --engine`` and the loader); they need a
#: checkpoint saved by real vLLM, with attention layers and (for the last) a raw layer.
MODEL_BAD_INPUTS: list[BadInput] = [
    BadInput(
        "base-asked-of-a-checkpoint-without-one",
        lambda d: None,
        "ConfigurationError",
        r"ask for the base \(source='base'\), and this checkpoint has none",
        "model",
        engine={"model_loader_extra_config": {"source": "base"}},
    ),
    BadInput(
        "engine-keeps-a-layers-kv-cache-unquantized",
        lambda d: None,
        "CompatibilityError",
        "kv_cache_dtype_skip_layers: saved at vLLM's default",
        "model",
        engine={"kv_cache_dtype_skip_layers": ["0"]},
    ),
    BadInput(
        "renamed-kernel",
        _edit(
            lambda doc: next(k for m in doc["modules"] for k in m["kernels"] if k["attr"] == "impl").update(
                kernel_class="vllm.v1.attention.backends.flash_attn.FlashAttentionImpl"
            )
        ),
        "CompatibilityError",
        "layer.impl",
        "model",
    ),
    BadInput(
        "renamed-module-class",
        _edit(
            lambda doc: _first_module_with(doc, lambda m: m["quant_method"]).update(
                module_class="vllm.model_executor.layers.linear.ReplicatedLinear"
            )
        ),
        "CompatibilityError",
        "module_class",
        "model",
    ),
    BadInput(
        "raw-layer-marked-processed-without-replay",
        _edit(
            lambda doc: _first_module_with(doc, lambda m: m["state"] == "raw").update(state="processed", replay="none")
        ),
        "ReplayError",
        "missing after replay",
        "model",
    ),
]
