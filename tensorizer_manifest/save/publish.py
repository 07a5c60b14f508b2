"""A write published as a generation (format version 3): every rank writes into the new generation's folder, then
the first rank records the folder's files in a generation document and swaps the pointer, once, for all ranks.

``design.md``, "Format version 3". Nothing is written outside ``generations/<id>/`` until the commit; after it
the top-level copies vLLM's ``model`` path reads are refreshed from the generation (``refresh_top_level``), and
old generations past their grace period go (``gc``, best effort).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .._constants import PRODUCER
from ..errors import CheckpointNotFoundError, IntegrityError, TensorizerManifestError
from ..format.generation import (
    GENERATIONS_FORMAT_VERSION,
    POINTER_NAME,
    BaseDocument,
    BaseRef,
    CompileForm,
    FileRef,
    FormSet,
    Generation,
    Layout,
    MadeBy,
    ModelFile,
    RankRef,
    generation_dir,
    seal_generation,
)
from ..format.schema import EncryptionKey, Fingerprint, SigningKey, blake3_hex, decode_manifest
from ..load.model_class_record import RECORD_PREFIX, record_of
from ..storage.checkpoint import checkpoint_stem, form_set_of
from ..storage.files import make_folder
from ..storage.generations import LocalCheckpoint
from ..storage.remote import is_model_file

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Publication:
    """Where one write of a checkpoint goes: its generation's id and folder, and the generation it replaces."""

    root: Path
    generation_id: str
    parent: str | None

    @property
    def folder(self) -> Path:
        return self.root / generation_dir(self.generation_id)

    def relative(self, name: str) -> str:
        return f"{generation_dir(self.generation_id)}/{name}"


def begin(root: Path, generation_id: str, parent: str | None = None, read_parent: bool = True) -> Publication:
    """A write of ``root`` as generation ``generation_id``, over the generation that is current now (``parent``
    when the caller read it already, as an add-form does: the generation its engine loaded)."""
    root.mkdir(parents=True, exist_ok=True)
    if read_parent:
        parent = LocalCheckpoint(root).current_generation_id()
    publication = Publication(root=root, generation_id=generation_id, parent=parent)
    make_folder(publication.folder)
    return publication


def layout_stems(layout: Layout) -> list[str]:
    """Every rank's stem of a layout, pipeline stage by stage."""
    return [checkpoint_stem(tp, layout.tp, pp, layout.pp) for pp in range(layout.pp) for tp in range(layout.tp)]


def rank_entry(publication: Publication, stem: str, keeps: dict[str, str] | None = None) -> RankRef:
    """A rank's manifest in the publication's folder, by its bytes, and where each tensor file it names is: in the
    folder, or (``keeps``: name -> path) where an earlier generation keeps it. A rank whose manifest is not there is
    a typed error (a rank on another node writing to its own disk: a sharded save needs a shared file system)."""
    path = publication.folder / f"{stem}.manifest.json"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{path}: rank {stem}'s manifest is not in the generation's folder; every rank of a sharded save must "
            "write to one file system (save to s3://, or to a directory every node mounts)"
        ) from None
    manifest = decode_manifest(data, str(path))
    keeps = keeps or {}
    places = []
    for name in manifest.tensor_file_names():
        if (publication.folder / name).is_file():
            places.append(publication.relative(name))
        elif name in keeps:
            places.append(keeps[name])
        else:
            raise CheckpointNotFoundError(f"{path}: names tensor file {name}, which this write did not produce")
    return RankRef(
        stem=stem,
        manifest=FileRef(path=publication.relative(path.name), size=len(data), hash=blake3_hex(data)),
        tensor_files=places,
    )


def base_entry(publication: Publication, document_name: str, document: BaseDocument) -> BaseRef:
    """The base written into the publication's folder (``save.write_base.write_base``), by its document's bytes."""
    data = (publication.folder / document_name).read_bytes()
    return BaseRef(
        mode="inside" if document.tensor_file is not None else "reference",
        document=FileRef(path=publication.relative(document_name), size=len(data), hash=blake3_hex(data)),
        tensor_files=[] if document.tensor_file is None else [publication.relative(document.tensor_file.path)],
    )


def copy_model_files(publication: Publication, source: Path) -> list[ModelFile]:
    """The source's config, tokenizer and generation files, copied into the generation's folder (never
    downloaded), with their hashes: what vLLM reads from its ``model`` directory belongs to the generation."""
    store = LocalCheckpoint(publication.root)
    files = []
    for path in sorted(source.iterdir()) if source.is_dir() else []:
        if not path.is_file() or not is_model_file(path.name) or path.name == POINTER_NAME:
            continue
        if path.name.startswith(RECORD_PREFIX):  # a checkpoint as the source: this engine's vLLM's record instead
            continue
        ref = store.put(publication.relative(path.name), path.read_bytes())
        files.append(ModelFile(name=path.name, file=ref))
    record = record_of(source)  # vLLM's record of the model's class, for a fresh process to skip inspecting it
    if record is not None:
        files.append(ModelFile(name=record[0], file=store.put(publication.relative(record[0]), record[1])))
    return files


def carry_model_files(publication: Publication, parent: Generation) -> list[ModelFile]:
    """``parent``'s model files, copied into the publication's folder (a few small files): every generation's folder
    holds what vLLM reads, so that any of them can be vLLM's ``model`` (``checkpoint.pinned_generation``)."""
    store = LocalCheckpoint(publication.root)
    files = []
    for model_file in parent.model_files:
        data = (publication.root / model_file.file.path).read_bytes()
        if blake3_hex(data) != model_file.file.hash:
            raise IntegrityError(
                f"{publication.root / model_file.file.path}: not the bytes generation {parent.id} records; "
                "save the checkpoint again"
            )
        files.append(ModelFile(name=model_file.name, file=store.put(publication.relative(model_file.name), data)))
    return files


def commit(
    publication: Publication,
    *,
    made_by: MadeBy,
    form_sets: list[FormSet],
    model_files: list[ModelFile],
    base: BaseRef | None = None,
    compile_forms: list[CompileForm] | None = None,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
) -> Generation:
    """Seal and commit the generation; ``ConcurrentWriteError`` when another writer committed since ``begin``.
    Then the top level is refreshed and old generations are collected (neither can fail the write).
    ``compile_forms``: the parent's, kept by a writer that changes no weights' meaning (an add-form: a compiled graph
    does not depend on which form a layer's tensors take); a save starts without any."""
    generation = Generation(
        format_version=GENERATIONS_FORMAT_VERSION,
        id=publication.generation_id,
        parent=publication.parent,
        producer=PRODUCER,
        made_by=made_by,
        model_files=model_files,
        base=base,
        form_sets=form_sets,
        compile_forms=compile_forms or [],
    )
    generation = seal_generation(generation, signing_key, encryption_key)
    store = LocalCheckpoint(publication.root)
    store.commit(generation)
    try:
        store.refresh_top_level()
        store.gc(store.plan_gc())
    except (OSError, TensorizerManifestError) as exc:  # the commit stands; the next writer or `gc` does it
        logger.warning("%s: committed; tidying up after it failed (%s)", publication.root, exc)
    return generation


def commit_over(
    publication: Publication,
    parent: Generation,
    *,
    made_by: MadeBy,
    form_sets: list[FormSet] | None = None,
    compile_forms: list[CompileForm] | None = None,
    signing_key: SigningKey | None = None,
    encryption_key: EncryptionKey | None = None,
) -> Generation:
    """``commit`` of a write that changes only ``parent``'s form sets or its compile forms (an add-form): the new
    generation keeps ``parent``'s model files (copied into its folder), its base, and whichever of the two this
    write leaves as they were."""
    return commit(
        publication,
        made_by=made_by,
        form_sets=parent.form_sets if form_sets is None else form_sets,
        model_files=carry_model_files(publication, parent),
        base=parent.base,
        compile_forms=parent.compile_forms if compile_forms is None else compile_forms,
        signing_key=signing_key,
        encryption_key=encryption_key,
    )


def form_set(layout: Layout, fingerprint: Fingerprint, ranks: list[RankRef]) -> FormSet:
    return FormSet(layout=layout, fingerprint=fingerprint, ranks=ranks)


def layout_form_set(publication: Publication, layout: Layout, fingerprint: Fingerprint) -> FormSet:
    """A layout's form set: every one of its ranks' manifests in the publication's folder, by its bytes."""
    return form_set(layout, fingerprint, [rank_entry(publication, stem) for stem in layout_stems(layout)])


def with_new_manifests(publication: Publication, parent: Generation, vllm_version: str | None = None) -> list[FormSet]:
    """``parent``'s form sets, where each rank that wrote a new manifest into the publication's folder (an add-form
    by an engine of ``vllm_version``) names it in the form set that engine loaded (``checkpoint.form_set_of``: a
    layout has one per release), and the tensor files it keeps from ``parent`` where ``parent`` has them; the other
    ranks and form sets unchanged."""
    stems = {rank.stem for form_set in parent.form_sets for rank in form_set.ranks}
    written = {stem for stem in stems if (publication.folder / f"{stem}.manifest.json").is_file()}
    loaded = {id(form_set_of(parent, stem, vllm_version)) for stem in written}
    form_sets = []
    for old in parent.form_sets:
        ranks = []
        for rank in old.ranks:
            if id(old) in loaded and rank.stem in written:
                keeps = {path.rpartition("/")[2]: path for path in rank.tensor_files}
                ranks.append(rank_entry(publication, rank.stem, keeps))
            else:
                ranks.append(rank)
        form_sets.append(FormSet(layout=old.layout, fingerprint=old.fingerprint, ranks=ranks))
    return form_sets
