"""Manifest against its tensor file, with no vLLM and no GPU.

Like safetensors' reader, everything that can be checked from metadata is
checked before any tensor data is read or allocated: record names unique,
shapes and byte counts consistent, aliases valid, the digest over all
records equal to the one bound to the tensor file, the file's exact size, the
hash of its head, and tensorizer's own index (every record present once, the
same dtype, shape and byte length, data inside the file and not overlapping).
Content hashes are checked last, one tensor at a time.

``validate_checkpoint`` collects every problem into a frozen report (as
huggingface_hub's cache verification does); the loader calls
``check_files`` and raises the first kind of problem with all of them listed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import blake3

from .checkpoint import load_manifest
from .errors import CheckpointNotFoundError, IntegrityError, ManifestError, TensorizerManifestError
from .schema import Manifest, TensorRecord

#: Bytes read at a time when hashing the non-data parts of a tensor file.
_CHUNK = 1 << 20
_ITEMSIZE = {
    "float64": 8,
    "int64": 8,
    "uint64": 8,
    "complex64": 8,
    "float32": 4,
    "int32": 4,
    "uint32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int16": 2,
    "uint16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}
#: Modules whose Parameter classes a manifest may name (see ``tensors.param_class_from_name``).
_PARAM_MODULES = ("torch.nn.parameter", "vllm.model_executor.parameter")
#: The largest tensor a record may describe; bigger claims are refused before allocation.
MAX_TENSOR_BYTES = 1 << 40


@dataclass(frozen=True)
class Problem:
    kind: type[TensorizerManifestError]
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass(frozen=True)
class ValidationReport:
    manifest_path: Path | None
    tensor_path: Path | None
    records: int = 0
    stored: int = 0
    hashes_checked: int = 0
    problems: tuple[Problem, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        if self.problems:
            first = self.problems[0]
            more = (
                f" (and {len(self.problems) - 1} more: " + "; ".join(map(str, self.problems[1:6])) + ")"
                if len(self.problems) > 1
                else ""
            )
            raise first.kind(f"{first}{more}")

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "manifest": str(self.manifest_path) if self.manifest_path else None,
            "tensor_file": str(self.tensor_path) if self.tensor_path else None,
            "records": self.records,
            "stored": self.stored,
            "hashes_checked": self.hashes_checked,
            "problems": [{"error": p.kind.__name__, "where": p.where, "message": p.message} for p in self.problems],
        }


def full_name(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def head_hash(path: Path, index: dict | None = None) -> str:
    """blake3 of every byte of the file that is not tensor data.

    That is tensorizer's file header, its index and each tensor's own header
    (names, dtypes, shapes, offsets, tensorizer's checksums): a few KiB per
    tensor, so checking it costs little, and with the content hashes it covers
    every byte of the file. It binds the manifest to this exact file.
    """
    if index is None:
        index = _read_index(path)
    size = path.stat().st_size
    # Clamped: a damaged index may claim offsets past the end (reported elsewhere); never seek there.
    spans = sorted((min(max(entry[2], 0), size), min(max(entry[2] + entry[3], 0), size)) for entry in index.values())
    h = blake3.blake3()
    position = 0
    with open(path, "rb") as f:
        for start, end in [*spans, (size, size)]:
            f.seek(position)
            remaining = max(0, start - position)
            while remaining:
                chunk = f.read(min(remaining, _CHUNK))
                if not chunk:
                    break
                h.update(chunk)
                remaining -= len(chunk)
            position = max(position, end)
    return "blake3:" + h.hexdigest()


def digest_records(ordered: list[tuple[str, TensorRecord]]) -> str:
    """One hash over every record's full name and form (also of records that store nothing)."""
    h = blake3.blake3()
    for name, r in ordered:
        form = (name, r.kind, r.dtype, r.shape, r.stride, r.storage_offset, r.nbytes, r.key, r.alias_of, r.hash)
        h.update(repr(form).encode())
        h.update(b"\n")
    return "blake3:" + h.hexdigest()


def resolve_tensor_file(manifest: Manifest, manifest_path: Path) -> Path:
    """The tensor file: a plain name inside the checkpoint directory, no link out of it."""
    name = manifest.tensor_file.path
    if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith("~") or "\0" in name:
        raise ManifestError(
            f"{manifest_path}: tensor file {name!r} must be a plain file name inside the checkpoint directory"
        )
    try:
        directory = manifest_path.parent.resolve()
        path = manifest_path.parent / name
        if path.is_symlink() and path.resolve().parent != directory:
            raise ManifestError(f"{manifest_path}: tensor file {name!r} is a link out of the checkpoint directory")
        if not path.is_file():
            raise CheckpointNotFoundError(f"{path}: the tensor file named by the manifest is missing")
    except TensorizerManifestError:
        raise
    except OSError as exc:  # e.g. a name longer than the file system allows
        raise ManifestError(
            f"{manifest_path}: tensor file {name[:80]!r} cannot be used ({exc.strerror or exc})"
        ) from None
    return path


def _check_record(name: str, record: TensorRecord) -> str | None:
    if len(record.shape) != len(record.stride):
        return f"shape {record.shape} and stride {record.stride} differ in rank"
    if any(d < 0 for d in record.shape) or any(s < 0 for s in record.stride) or record.storage_offset < 0:
        return f"negative shape, stride or offset ({record.shape}, {record.stride}, {record.storage_offset})"
    itemsize = _ITEMSIZE.get(record.dtype)
    if itemsize is None:
        return f"unknown dtype {record.dtype!r}"
    numel = 1
    for d in record.shape:
        numel *= d
        if numel * itemsize > MAX_TENSOR_BYTES:
            return f"shape {record.shape} describes more than {MAX_TENSOR_BYTES} bytes"
    if numel * itemsize != record.nbytes:
        return f"nbytes {record.nbytes} does not match {record.dtype}{record.shape} ({numel * itemsize} bytes)"
    if record.kind == "buffer" and record.param_class is not None:
        return "a buffer cannot have a parameter class"
    if record.param_class is not None and record.param_class.rpartition(".")[0] not in _PARAM_MODULES:
        return f"parameter class {record.param_class!r} is not one the loader may build"
    if any(attr.startswith("__") for attr in record.param_attrs):
        return f"parameter attribute names may not start with '__': {sorted(record.param_attrs)}"
    if not record.hash.startswith("blake3:") or len(record.hash) != 7 + 64:
        return f"content hash {record.hash!r} is not a blake3 hex digest"
    return None


def known_replays() -> set[str]:
    from .replay import RESTORERS  # torch, not vLLM

    return {"post_load", "none", *RESTORERS}


def check_manifest(manifest: Manifest, manifest_path: Path) -> tuple[list[Problem], dict[str, TensorRecord]]:
    """Record-level checks; returns problems and the stored records by file key."""
    problems: list[Problem] = []
    where = str(manifest_path)
    names: set[str] = set()
    records_by_name: dict[str, TensorRecord] = {}
    by_key: dict[str, TensorRecord] = {}
    ordered: list[tuple[str, TensorRecord]] = []
    paths: set[str] = set()
    for module in manifest.modules:
        if module.path in paths:
            problems.append(Problem(ManifestError, where, f"module {module.path!r} is recorded twice"))
        paths.add(module.path)
        if module.state == "raw" and module.replay != "post_load":
            problems.append(
                Problem(ManifestError, where, f"raw layer {module.path!r} must replay post_load, not {module.replay!r}")
            )
        if module.replay not in known_replays():
            problems.append(
                Problem(
                    ManifestError,
                    where,
                    f"layer {module.path!r} names an unknown replay {module.replay!r}; upgrade tensorizer-manifest or re-save",
                )
            )
        if module.state == "processed" and module.replay == "post_load":
            problems.append(
                Problem(
                    ManifestError,
                    where,
                    f"processed layer {module.path!r} cannot replay post_load (that would process it twice)",
                )
            )
        for record in module.tensors:
            name = full_name(module.path, record.name)
            if name in names:
                problems.append(Problem(ManifestError, where, f"tensor {name!r} is recorded twice"))
            names.add(name)
            bad = _check_record(name, record)
            if bad:
                problems.append(Problem(ManifestError, where, f"tensor {name!r}: {bad}"))
            if record.alias_of is not None:
                if record.key is not None:
                    problems.append(
                        Problem(ManifestError, where, f"tensor {name!r} is an alias and cannot also be stored")
                    )
                target = records_by_name.get(record.alias_of)
                if target is None or record.alias_of == name:
                    problems.append(
                        Problem(
                            ManifestError,
                            where,
                            f"tensor {name!r} is an alias of {record.alias_of!r}, which is not recorded before it",
                        )
                    )
                elif (target.dtype, target.shape, target.stride, target.storage_offset, target.hash) != (
                    record.dtype,
                    record.shape,
                    record.stride,
                    record.storage_offset,
                    record.hash,
                ):
                    problems.append(
                        Problem(
                            ManifestError,
                            where,
                            f"tensor {name!r} differs in form or content from {record.alias_of!r}, the tensor it is an alias of",
                        )
                    )
            elif record.key is not None:
                if record.key in by_key:
                    problems.append(Problem(ManifestError, where, f"tensor file key {record.key!r} is used twice"))
                by_key[record.key] = record
            elif record.nbytes:
                problems.append(
                    Problem(ManifestError, where, f"tensor {name!r} has {record.nbytes} bytes but no tensor file key")
                )
            ordered.append((name, record))
            records_by_name.setdefault(name, record)
    if digest_records(ordered) != manifest.tensor_file.digest:
        problems.append(
            Problem(
                IntegrityError,
                where,
                "the tensor records do not match the digest bound to the tensor file: the manifest was edited or belongs to another checkpoint; re-save it",
            )
        )
    if len(by_key) != manifest.tensor_file.tensor_count:
        problems.append(
            Problem(
                IntegrityError,
                where,
                f"{len(by_key)} stored tensors recorded, the manifest's tensor file entry says {manifest.tensor_file.tensor_count}",
            )
        )
    return problems, by_key


def _torch_dtype_name(tensorizer_dtype: str) -> str:
    if "torch." in tensorizer_dtype:
        return tensorizer_dtype.rsplit("torch.", 1)[1]
    import numpy as np

    return str(np.dtype(tensorizer_dtype))


def check_tensor_file(manifest: Manifest, tensor_path: Path, by_key: dict[str, TensorRecord]) -> list[Problem]:
    """File-level checks from metadata only: size, head hash, tensorizer's index."""
    problems: list[Problem] = []
    where = str(tensor_path)
    size = tensor_path.stat().st_size
    if size != manifest.tensor_file.size:
        return [
            Problem(
                IntegrityError,
                where,
                f"{size} bytes, the manifest says {manifest.tensor_file.size}: the file is truncated, padded or from another save",
            )
        ]
    total = sum(r.nbytes for r in by_key.values())
    if total > size:
        return problems + [
            Problem(IntegrityError, where, f"the manifest claims {total} bytes of tensors in a {size} byte file")
        ]
    try:
        index = _read_index(tensor_path)
    except Exception as exc:  # tensorizer raises many kinds on a damaged file
        return problems + [
            Problem(
                IntegrityError,
                where,
                f"tensorizer cannot read the file's index ({type(exc).__name__}: {exc}): the file's header does not match the manifest",
            )
        ]
    if manifest.tensor_file.head_hash is not None and head_hash(tensor_path, index) != manifest.tensor_file.head_hash:
        problems.append(
            Problem(
                IntegrityError,
                where,
                "the file's header does not match the manifest (tensorizer's index or a tensor header differs): it belongs to another checkpoint or is damaged",
            )
        )
    for key in sorted(set(by_key) - set(index)):
        problems.append(Problem(IntegrityError, where, f"tensor {key!r} is in the manifest but not in the file"))
    for key in sorted(set(index) - set(by_key)):
        problems.append(Problem(IntegrityError, where, f"tensor {key!r} is in the file but not in the manifest"))
    spans = []
    for key in sorted(set(index) & set(by_key)):
        record = by_key[key]
        dtype, shape, offset, length, _ = index[key]
        if dtype != record.dtype or shape != record.shape:
            problems.append(
                Problem(
                    IntegrityError,
                    where,
                    f"tensor {key!r} is {dtype}{shape} in the file, {record.dtype}{record.shape} in the manifest",
                )
            )
        if length != record.nbytes:
            problems.append(
                Problem(
                    IntegrityError,
                    where,
                    f"tensor {key!r} has {length} bytes in the file, {record.nbytes} in the manifest",
                )
            )
        if offset < 0 or offset + length > size:
            problems.append(
                Problem(IntegrityError, where, f"tensor {key!r} lies outside the file ({offset}+{length} > {size})")
            )
        spans.append((offset, offset + length, key))
    spans.sort()
    for (s1, e1, k1), (s2, e2, k2) in zip(spans, spans[1:]):
        if s2 < e1:
            problems.append(Problem(IntegrityError, where, f"tensors {k1!r} and {k2!r} overlap in the file"))
    return problems


def _read_index(tensor_path: Path) -> dict[str, tuple[str, list[int], int, int, int]]:
    """tensorizer's index: name -> (dtype, shape, data offset, data length, header offset). Reads no data.

    Uses tensorizer's ``_metadata`` (not public API, stable across 2.10-2.12).
    """
    from tensorizer import TensorDeserializer

    deserializer = TensorDeserializer(str(tensor_path), device="cpu", lazy_load=True, verify_hash=False)
    try:
        index = {}
        for key, entry in deserializer._metadata.items():
            name = key if isinstance(key, str) else ".".join(entry.name)
            index[name] = (
                _torch_dtype_name(entry.dtype),
                list(entry.shape),
                int(entry.data_offset),
                int(entry.data_length),
                int(entry.offset),
            )
        return index
    finally:
        deserializer.close()


def check_files(manifest: Manifest, manifest_path: Path) -> Path:
    """Everything but content hashes; raises on the first kind of problem. Used by the loader."""
    problems, by_key = check_manifest(manifest, manifest_path)
    report = ValidationReport(manifest_path, None, problems=tuple(problems))
    report.raise_for_problems()
    tensor_path = resolve_tensor_file(manifest, manifest_path)
    problems = check_tensor_file(manifest, tensor_path, by_key)
    ValidationReport(manifest_path, tensor_path, problems=tuple(problems)).raise_for_problems()
    return tensor_path


def validate_checkpoint(path: str | Path, *, verify_hashes: bool = True) -> ValidationReport:
    """Every check, every problem: for ``tensorizer-manifest validate``. Never raises for bad input."""
    try:
        manifest, manifest_path = load_manifest(path)
    except TensorizerManifestError as exc:
        return ValidationReport(None, None, problems=(Problem(type(exc), str(path), str(exc)),))
    problems, by_key = check_manifest(manifest, manifest_path)
    records = sum(len(m.tensors) for m in manifest.modules)
    try:
        tensor_path = resolve_tensor_file(manifest, manifest_path)
    except TensorizerManifestError as exc:
        return ValidationReport(
            manifest_path,
            None,
            records,
            len(by_key),
            0,
            tuple(problems) + (Problem(type(exc), str(manifest_path), str(exc)),),
        )
    problems += check_tensor_file(manifest, tensor_path, by_key)
    checked = 0
    if verify_hashes and not problems:
        problems, checked = _check_hashes(tensor_path, by_key)
    return ValidationReport(manifest_path, tensor_path, records, len(by_key), checked, tuple(problems))


def _check_hashes(tensor_path: Path, by_key: dict[str, TensorRecord]) -> tuple[list[Problem], int]:
    from .tensors import TensorFileReader, hash_tensor

    problems: list[Problem] = []
    checked = 0
    try:
        reader = TensorFileReader(tensor_path)
    except Exception as exc:
        return [
            Problem(IntegrityError, str(tensor_path), f"tensorizer cannot open the file ({type(exc).__name__}: {exc})")
        ], 0
    try:
        for key, record in by_key.items():
            try:
                tensor = reader.read(key)
            except Exception as exc:
                problems.append(
                    Problem(
                        IntegrityError, str(tensor_path), f"tensor {key!r} cannot be read ({type(exc).__name__}: {exc})"
                    )
                )
                continue
            checked += 1
            if hash_tensor(tensor) != record.hash:
                problems.append(
                    Problem(
                        IntegrityError,
                        str(tensor_path),
                        f"tensor {key!r}: content hash does not match the manifest (the data is damaged)",
                    )
                )
    finally:
        reader.close()
    return problems, checked


def _normalize_dtype(dtype: str) -> str:
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32", "fp32": "float32"}
    return aliases.get(dtype, dtype).removeprefix("torch.")


def check_engine_settings(
    manifest_path: Path,
    *,
    dtype: str | None = None,
    quantization: str | None = None,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
) -> list[Problem]:
    """The fingerprint fields an engine's command line decides, checked without vLLM."""
    from .checkpoint import read_manifest
    from .errors import CompatibilityError

    try:
        fp = read_manifest(manifest_path).fingerprint
    except TensorizerManifestError as exc:
        return [Problem(type(exc), str(manifest_path), str(exc))]
    wanted: list[tuple[str, object, object]] = []
    if dtype not in (None, "auto"):
        wanted.append(("dtype", fp.dtype, _normalize_dtype(dtype)))
    if quantization is not None:
        wanted.append(("quantization", fp.quantization, None if quantization.lower() == "none" else quantization))
    if tensor_parallel_size is not None:
        wanted.append(("tensor_parallel_size", fp.tensor_parallel_size, tensor_parallel_size))
    if pipeline_parallel_size is not None:
        wanted.append(("pipeline_parallel_size", fp.pipeline_parallel_size, pipeline_parallel_size))
    return [
        Problem(
            CompatibilityError,
            str(manifest_path),
            f"saved with {name}={saved!r}, the engine would use {current!r}: start vLLM with the saved setting or re-save the checkpoint",
        )
        for name, saved, current in wanted
        if saved != current
    ]
