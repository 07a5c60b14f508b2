"""A base by reference: the source's own safetensors files, read in place of a base tensor file.

``save --base reference`` writes no copy of the source: the base document names the source's safetensors files,
their sizes, and which base tensors each holds (``format.generation.SourceFiles``); every tensor keeps its record
and content hash. A load opens those files with safetensors itself (no pickle), refuses a file that is missing or
whose size changed before reading a tensor, and streams the tensors it asks for as a base tensor file's reader
does; each tensor's content hash is then checked as it is fed (``load.from_base``), so a changed byte is refused
before any step runs. The checkpoint is then not self-contained: the source must stay where it was, or be named
(``base_source_dir``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from ..errors import CheckpointNotFoundError, ConfigurationError, IntegrityError
from ..format.generation import SourceFile, SourceFiles


def source_files_of(source_dir: Path, names: list[str]) -> SourceFiles:
    """The safetensors files of ``source_dir`` that hold the base tensors ``names`` (each in one file), as a base by
    reference records them. A source that is not plain safetensors files, or that lacks a tensor vLLM's loader
    read, cannot be referenced: ``ConfigurationError`` (save with the base inside)."""
    from safetensors import safe_open

    files = sorted(source_dir.glob("*.safetensors"))
    if not files:
        raise ConfigurationError(
            f"{source_dir}: no *.safetensors files, so a base by reference has nothing to name: save with --base inside"
        )
    where: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safetensors' handle has keys(), not iteration
                where.setdefault(key, path.name)
    missing = [name for name in names if name not in where]
    if missing:
        raise ConfigurationError(
            f"{source_dir}: vLLM's loader read {len(missing)} tensor(s) that no safetensors file there holds under "
            f"that name ({', '.join(missing[:3])}): a base by reference cannot name them; save with --base inside"
        )
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(where[name], []).append(name)
    return SourceFiles(
        root=str(source_dir.resolve()),
        files=[
            SourceFile(name=name, size=(source_dir / name).stat().st_size, tensors=tensors)
            for name, tensors in by_file.items()
        ],
    )


class SourceFilesReader:
    """The base tensors of a base by reference, read from the source's files (``stream``, as a base tensor file's
    reader). Opening checks that every file is there with the size recorded at the save."""

    def __init__(self, source: SourceFiles, source_dir: str | Path | None = None):
        self.path = Path(source_dir if source_dir is not None else source.root)
        """The source directory read (named in every message, as a tensor file's path is)."""
        self.source = source
        self._file_of = {name: f.name for f in source.files for name in f.tensors}
        self._stack = ExitStack()
        for f in source.files:
            path = self.path / f.name
            if not path.is_file():
                raise CheckpointNotFoundError(
                    f"{path}: a source file this checkpoint's base refers to is missing (saved with --base reference "
                    f"from {source.root}): put the source back, or name where it is now with the load option "
                    "base_source_dir"
                )
            size = path.stat().st_size
            if size != f.size:
                raise IntegrityError(
                    f"{path}: the source file this checkpoint's base refers to has changed ({size:,} bytes, "
                    f"{f.size:,} at the save): nothing was served. Restore the source, or save the checkpoint again"
                )

    def stream(self, keys: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for each of ``keys`` (all, without), in that order; each file opened once."""
        from safetensors import safe_open

        opened = {}
        for key in keys if keys is not None else list(self._file_of):
            name = self._file_of.get(key)
            if name is None:
                raise IntegrityError(f"{self.path}: base tensor {key!r} is in none of the source files the base names")
            if name not in opened:
                opened[name] = self._stack.enter_context(safe_open(str(self.path / name), framework="pt"))
            try:
                tensor = opened[name].get_tensor(key)
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own kinds on a changed file
                raise IntegrityError(
                    f"{self.path / name}: base tensor {key!r} cannot be read from the source ({type(exc).__name__}: "
                    f"{exc}): the source changed since the save; nothing was served. Save the checkpoint again"
                ) from None
            yield key, tensor

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SourceFilesReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
