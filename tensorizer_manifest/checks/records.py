"""The manifest's records against themselves, from metadata alone: names unique, shapes and byte counts
consistent, aliases pointing backwards, replays known, raw fallbacks where they may be, and the digest over
every record equal to the one bound to the tensor file. Nothing is read from the tensor file."""

from __future__ import annotations

from ..errors import (
    IntegrityError,
    ManifestError,
    ManifestVersionError,
    TensorizerManifestError,
)
from ..format.generation import BaseDocument
from ..format.schema import (
    ALLOWED_PARAM_MODULES,
    DTYPE_ITEMSIZE,
    REPLAY_NONE,
    REPLAY_POST_LOAD,
    EncryptionKey,
    Manifest,
    ModuleRecord,
    SigningKey,
    TensorFileRef,
    TensorRecord,
    UnreadableForm,
    digest_line,
    digest_of_lines,
    fallback_name,
    fed_from_base,
    form_base,
    full_name,
    held_by_base,
    required_format_version,
)
from ..restorers import known_replays
from ..storage.checkpoint import (
    FileLocation,
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


class _Records:
    """The records of one tensor file, checked as they are added, its digest taken in the same pass."""

    def __init__(self, problem, base_available: bool = False):
        self.problem = problem
        self.base_available = base_available
        """Records held by the base (``held_by_base``) may be here: the manifest is in a generation with one."""
        self.by_name: dict[str, TensorRecord] = {}
        self.by_key: dict[str, TensorRecord] = {}
        self.digest_lines: list[str] = []

    def add(self, name: str, record: TensorRecord) -> None:
        problem = self.problem
        self.digest_lines.append(digest_line(name, record))
        if name in self.by_name:
            problem(ManifestError, f"tensor {name!r} is recorded twice")
        bad = _check_record(record)
        if bad:
            problem(ManifestError, f"tensor {name!r}: {bad}")
        if record.alias_of is not None:
            _check_alias(name, record, record.alias_of, self.by_name, problem)
        elif record.key is not None:
            if record.key in self.by_key:
                problem(ManifestError, f"tensor file key {record.key!r} is used twice")
            self.by_key[record.key] = record
        elif record.nbytes and not self.base_available:
            problem(
                ManifestError,
                f"tensor {name!r} has {record.nbytes} bytes but no tensor file key (a tensor the base holds, in a "
                "checkpoint without one: it was edited, or its generation's base is gone); save the checkpoint again",
            )
        self.by_name.setdefault(name, record)

    def check_bound_to(self, ref: TensorFileRef, what: str) -> None:
        """The digest and count bound to the tensor file ``ref`` must be these records'."""
        if digest_of_lines(self.digest_lines) != ref.digest:
            self.problem(
                IntegrityError,
                f"the tensor records of {what} do not match the digest bound to its tensor file: the manifest was "
                "edited or belongs to another checkpoint; re-save it",
            )
        if len(self.by_key) != ref.tensor_count:
            self.problem(
                IntegrityError,
                f"{len(self.by_key)} stored tensors recorded for {what}, its tensor file entry says {ref.tensor_count}",
            )


def check_manifest(
    manifest: Manifest,
    manifest_path: FileLocation,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
    check_the_seal: bool = True,
    base_available: bool = False,
) -> tuple[list[Problem], dict[str, TensorRecord]]:
    """The seal (unless ``check_the_seal`` is false), then record-level checks; returns problems and the stored
    records of the main tensor file by key (``check_added_forms`` gives each added form's). ``base_available``:
    the manifest is a rank of a generation with a base, so layers may be fed from it (``held_by_base``)."""
    problems: list[Problem] = []
    where = str(manifest_path)

    def problem(kind: type[TensorizerManifestError], message: str) -> None:
        problems.append(Problem(kind, where, message))

    sealed = check_seal(manifest, signing_key, encryption_key) if check_the_seal else None
    if sealed is not None:
        problem(*sealed)

    records = _Records(problem, base_available)
    paths: set[str] = set()
    known = known_replays()
    for module in manifest.modules:
        if module.path in paths:
            problem(ManifestError, f"module {module.path!r} is recorded twice")
        paths.add(module.path)
        _check_module_replay(module, known, problem)
        _check_fed_from_base(module, problem)
        for record in module.tensors:
            records.add(full_name(module.path, record.name), record)
    for module in manifest.modules:  # the raw fallbacks, after every layer's own tensors (as in the file)
        if module.fallback and (module.state != "processed" or module.replay == REPLAY_NONE):
            problem(ManifestError, f"layer {module.path!r} has a raw fallback but is not a processed layer")
        for record in module.fallback:
            name = fallback_name(full_name(module.path, record.name))
            if record.alias_of is not None:
                problem(ManifestError, f"raw fallback {name!r} is an alias; fallbacks store every tensor")
            records.add(name, record)
    if manifest.format_version < required_format_version(manifest):
        problem(
            ManifestError,
            f"the manifest says format version {manifest.format_version} but holds raw fallbacks or added forms "
            f"(version {required_format_version(manifest)}): it was edited by hand; re-save the checkpoint",
        )
    records.check_bound_to(manifest.tensor_file, "the manifest")
    return problems, records.by_key


def _check_fed_from_base(module: ModuleRecord, problem) -> None:
    """A layer fed from the base takes all its tensors from it (own or fallback), never some of them. (That they
    are what vLLM's weight loaders make from the base is checked as they are fed: ``from_base.feed_layers``.)"""
    for what, records in (("tensors", module.tensors), ("raw fallback", module.fallback)):
        if fed_from_base(records) and not all(held_by_base(record) or record.nbytes == 0 for record in records):
            problem(ManifestError, f"layer {module.path!r}: some of its {what} are in the base, some not (all or none)")


def check_base(base: BaseDocument, where: FileLocation) -> tuple[list[Problem], dict[str, TensorRecord]]:
    """A base document's records (each stored, none an alias, bound to its tensor file) and its consumers (every
    name one the base holds); returns problems and the records by key."""
    problems: list[Problem] = []

    def problem(kind: type[TensorizerManifestError], message: str) -> None:
        problems.append(Problem(kind, str(where), message))

    records = _Records(problem)
    for record in base.tensors:
        if record.alias_of is not None or record.key != record.name:
            problem(ManifestError, f"base tensor {record.name!r} must be stored under its own name")
        records.add(record.name, record)
    if base.tensor_file is not None:  # a base by reference: its records are checked against the source as it is read
        records.check_bound_to(base.tensor_file, "the base")
    unknown = sorted(set(base.consumers) - set(records.by_name))
    if unknown:
        problem(ManifestError, f"the base names consumers of tensors it does not hold: {', '.join(unknown[:5])}")
    return problems, records.by_key


def check_added_forms(manifest: Manifest, manifest_path: FileLocation) -> tuple[list[list[Problem]], list[dict]]:
    """Each added form's records: processed layers of the manifest that have a fallback, made from the fallbacks
    the manifest holds now (``AddedForm.base``), checked as the main file's are and bound to its own tensor
    file. Returns, per form, its problems and its stored records by key (a loader skips a form with problems;
    ``validate`` reports them). A form this version cannot decode (``UnreadableForm``) has one problem, its
    reason."""
    where = str(manifest_path)
    layers = manifest.module_map()
    known = known_replays()
    by_key: list[dict] = []
    problems_by_form: list[list[Problem]] = []
    for index, form in enumerate(manifest.added_forms):
        problems: list[Problem] = []
        problems_by_form.append(problems)

        def problem(kind: type[TensorizerManifestError], message: str, problems=problems) -> None:
            problems.append(Problem(kind, where, message))

        if isinstance(form, UnreadableForm):
            problem(ManifestVersionError, f"added form {index}: {form.reason}")
            by_key.append({})
            continue
        what = f"added form {index} ({form.tensor_file.path})"
        if form.base is None:
            problem(
                ManifestVersionError,
                f"{what} does not record the raw fallbacks it was made from (an older version added it): run "
                "add-form again to use it",
            )
        elif form.base != form_base(manifest, (m.path for m in form.modules)):
            problem(
                ManifestError,
                f"{what} was made from other raw fallbacks than this manifest's (the checkpoint was re-saved "
                "after it was added?): run add-form again",
            )
        records = _Records(problem)
        seen: set[str] = set()
        for module in form.modules:
            saved = layers.get(module.path)
            if saved is None or not saved.fallback:
                problem(ManifestError, f"{what}: layer {module.path!r} is not a layer of the manifest with a fallback")
            if module.path in seen:
                problem(ManifestError, f"{what}: layer {module.path!r} is recorded twice")
            seen.add(module.path)
            if module.state != "processed" or module.replay in (REPLAY_NONE, REPLAY_POST_LOAD) or module.fallback:
                problem(ManifestError, f"{what}: layer {module.path!r} must be a processed form a restorer replays")
            _check_module_replay(module, known, problem)
            for record in module.tensors:
                records.add(full_name(module.path, record.name), record)
        records.check_bound_to(form.tensor_file, what)
        by_key.append(records.by_key)
    return problems_by_form, by_key


def _check_alias(
    name: str, record: TensorRecord, alias_of: str, records_by_name: dict[str, TensorRecord], problem
) -> None:
    if record.key is not None:
        problem(ManifestError, f"tensor {name!r} is an alias and cannot also be stored")
    target = records_by_name.get(alias_of)
    if target is None or alias_of == name:
        problem(ManifestError, f"tensor {name!r} is an alias of {alias_of!r}, which is not recorded before it")
        return
    form = (record.dtype, record.shape, record.stride, record.storage_offset, record.hash)
    if (target.dtype, target.shape, target.stride, target.storage_offset, target.hash) != form:
        problem(
            ManifestError,
            f"tensor {name!r} differs in form or content from {alias_of!r}, the tensor it is an alias of",
        )
