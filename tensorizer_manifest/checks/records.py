"""The manifest's records against themselves, from metadata alone: names unique, shapes and byte counts
consistent, aliases pointing backwards, replays known, raw fallbacks where they may be, and the digest over
every record equal to the one bound to the tensor file. Nothing is read from the tensor file."""

from __future__ import annotations

from ..checkpoint import (
    FileLocation,
)
from ..errors import (
    IntegrityError,
    ManifestError,
    TensorizerManifestError,
)
from ..restorers import known_replays
from ..schema import (
    ALLOWED_PARAM_MODULES,
    DTYPE_ITEMSIZE,
    REPLAY_NONE,
    REPLAY_POST_LOAD,
    EncryptionKey,
    Manifest,
    SigningKey,
    TensorRecord,
    digest_line,
    digest_of_lines,
    fallback_name,
    full_name,
    required_format_version,
)
from .report import Problem
from .seal import check_seal

#: The largest tensor a record may describe; bigger claims are refused before allocation.
MAX_TENSOR_BYTES = 1 << 40


def _check_record(record: TensorRecord) -> str | None:
    """Rules a record must follow that its types alone do not say (those msgspec checked at decode)."""
    if len(record.shape) != len(record.stride):
        return f"shape {record.shape} and stride {record.stride} differ in rank"
    itemsize = DTYPE_ITEMSIZE[record.dtype]
    numel = 1
    for d in record.shape:
        numel *= d
        if numel * itemsize > MAX_TENSOR_BYTES:
            return f"shape {record.shape} describes more than {MAX_TENSOR_BYTES} bytes"
    if numel * itemsize != record.nbytes:
        return f"nbytes {record.nbytes} does not match {record.dtype}{record.shape} ({numel * itemsize} bytes)"
    if record.kind == "buffer" and record.param_class is not None:
        return "a buffer cannot have a parameter class"
    if record.param_class is not None and record.param_class.rpartition(".")[0] not in ALLOWED_PARAM_MODULES:
        return f"parameter class {record.param_class!r} is not one the loader may build"
    if record.param_attrs and any(attr.startswith("__") for attr in record.param_attrs):
        return f"parameter attribute names may not start with '__': {sorted(record.param_attrs)}"
    return None


def _check_module_replay(module, known: set[str], problem) -> None:
    if module.state == "raw" and module.replay != REPLAY_POST_LOAD:
        problem(ManifestError, f"raw layer {module.path!r} must replay post_load, not {module.replay!r}")
    if module.replay not in known:
        problem(
            ManifestError,
            f"layer {module.path!r} names an unknown replay {module.replay!r}; upgrade tensorizer-manifest or re-save",
        )
    if module.state == "processed" and module.replay == REPLAY_POST_LOAD:
        problem(
            ManifestError,
            f"processed layer {module.path!r} cannot replay post_load (that would process it twice)",
        )


def check_manifest(
    manifest: Manifest,
    manifest_path: FileLocation,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
    check_the_seal: bool = True,
) -> tuple[list[Problem], dict[str, TensorRecord]]:
    """The seal (unless ``check_the_seal`` is false), then record-level checks; returns problems and the stored
    records by file key."""
    problems: list[Problem] = []
    where = str(manifest_path)

    def problem(kind: type[TensorizerManifestError], message: str) -> None:
        problems.append(Problem(kind, where, message))

    sealed = check_seal(manifest, signing_key, encryption_key) if check_the_seal else None
    if sealed is not None:
        problem(*sealed)

    records_by_name: dict[str, TensorRecord] = {}
    by_key: dict[str, TensorRecord] = {}
    paths: set[str] = set()
    known = known_replays()
    digest_lines: list[str] = []  # the digest is taken in this same pass: one full name per record

    def check_record(name: str, record: TensorRecord) -> None:
        digest_lines.append(digest_line(name, record))
        if name in records_by_name:
            problem(ManifestError, f"tensor {name!r} is recorded twice")
        bad = _check_record(record)
        if bad:
            problem(ManifestError, f"tensor {name!r}: {bad}")
        if record.alias_of is not None:
            _check_alias(name, record, records_by_name, problem)
        elif record.key is not None:
            if record.key in by_key:
                problem(ManifestError, f"tensor file key {record.key!r} is used twice")
            by_key[record.key] = record
        elif record.nbytes:
            problem(ManifestError, f"tensor {name!r} has {record.nbytes} bytes but no tensor file key")
        records_by_name.setdefault(name, record)

    for module in manifest.modules:
        if module.path in paths:
            problem(ManifestError, f"module {module.path!r} is recorded twice")
        paths.add(module.path)
        _check_module_replay(module, known, problem)
        for record in module.tensors:
            check_record(full_name(module.path, record.name), record)
    for module in manifest.modules:  # the raw fallbacks, after every layer's own tensors (as in the file)
        if module.fallback and (module.state != "processed" or module.replay == REPLAY_NONE):
            problem(ManifestError, f"layer {module.path!r} has a raw fallback but is not a processed layer")
        for record in module.fallback:
            name = fallback_name(full_name(module.path, record.name))
            if record.alias_of is not None:
                problem(ManifestError, f"raw fallback {name!r} is an alias; fallbacks store every tensor")
            check_record(name, record)
    if manifest.format_version < required_format_version(manifest):
        problem(
            ManifestError,
            f"the manifest says format version {manifest.format_version} but holds raw fallbacks (version "
            f"{required_format_version(manifest)}): it was edited by hand; re-save the checkpoint",
        )
    if digest_of_lines(digest_lines) != manifest.tensor_file.digest:
        problem(
            IntegrityError,
            "the tensor records do not match the digest bound to the tensor file: the manifest was edited "
            "or belongs to another checkpoint; re-save it",
        )
    if len(by_key) != manifest.tensor_file.tensor_count:
        problem(
            IntegrityError,
            f"{len(by_key)} stored tensors recorded, the manifest's tensor file entry says "
            f"{manifest.tensor_file.tensor_count}",
        )
    return problems, by_key


def _check_alias(name: str, record: TensorRecord, records_by_name: dict[str, TensorRecord], problem) -> None:
    if record.key is not None:
        problem(ManifestError, f"tensor {name!r} is an alias and cannot also be stored")
    target = records_by_name.get(record.alias_of)
    if target is None or record.alias_of == name:
        problem(ManifestError, f"tensor {name!r} is an alias of {record.alias_of!r}, which is not recorded before it")
        return
    form = (record.dtype, record.shape, record.stride, record.storage_offset, record.hash)
    if (target.dtype, target.shape, target.stride, target.storage_offset, target.hash) != form:
        problem(
            ManifestError,
            f"tensor {name!r} differs in form or content from {record.alias_of!r}, the tensor it is an alias of",
        )
