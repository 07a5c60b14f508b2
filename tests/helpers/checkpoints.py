"""Where a checkpoint's files are, whatever its format version: tests read the manifest a load would read."""

from __future__ import annotations

from pathlib import Path


def manifest_file(checkpoint: str | Path, stem: str | None = None) -> Path:
    """The rank's manifest a load reads: at the top (format versions 1 and 2), or in the current generation's
    folder, through the pointer (format version 3)."""
    from tensorizer_manifest.storage.checkpoint import load_manifest

    return Path(load_manifest(Path(checkpoint), stem)[1])


def copy_as_version_2(checkpoint: str | Path, out: str | Path) -> Path:
    """A copy of the checkpoint laid out as format version 2: rank manifests, tensor files and model files at the
    top, plain copies (a version-3 rank manifest is a version-2 manifest). For the damage catalogues, which edit
    one file in place and expect that file's own check to catch it: in a version-3 checkpoint the generation's
    record of each file's hash catches every such edit first (``tests/checks/test_generation_files.py``)."""
    import shutil

    from tensorizer_manifest.storage.generations import LocalCheckpoint

    source, out = Path(checkpoint), Path(out)
    generation = LocalCheckpoint(source).current()
    if generation is None:
        shutil.copytree(source, out, symlinks=True)
        return out
    out.mkdir(parents=True)
    for model_file in generation.model_files:
        shutil.copyfile(source / model_file.file.path, out / model_file.name)
    for form_set in generation.form_sets:
        for rank in form_set.ranks:
            shutil.copyfile(source / rank.manifest.path, out / f"{rank.stem}.manifest.json")
            for path in rank.tensor_files:
                shutil.copyfile(source / path, out / Path(path).name)
    return out


def write_stock_tensor_file(path):
    """A tensor file as stock vLLM's ``save_tensorized_model`` writes one: tensorizer's, no manifest beside it."""
    import torch
    from tensorizer import TensorSerializer

    path.parent.mkdir(parents=True, exist_ok=True)
    serializer = TensorSerializer(str(path))
    serializer.write_state_dict({"model.embed_tokens.weight": torch.ones(4, 4)})
    serializer.close()
    return path


def commit_again(out: str | Path) -> str:
    """A second re-save's commit without an engine: the current generation's manifests written anew into a new
    generation over it (their tensor files and its base kept where they are), committed as every writer commits.
    The same weights under a new generation id."""
    from tensorizer_manifest.format.generation import new_generation_id
    from tensorizer_manifest.save import publish
    from tensorizer_manifest.storage.generations import LocalCheckpoint

    root = Path(out)
    current = LocalCheckpoint(root).current()
    publication = publish.begin(root, new_generation_id(), parent=current.id, read_parent=False)
    for form_set in current.form_sets:
        for rank in form_set.ranks:
            (publication.folder / f"{rank.stem}.manifest.json").write_bytes((root / rank.manifest.path).read_bytes())
    generation = publish.commit(
        publication,
        made_by="save",
        form_sets=publish.with_new_manifests(publication, current),
        model_files=publish.carry_model_files(publication, current),
        base=current.base,
    )
    return generation.id
