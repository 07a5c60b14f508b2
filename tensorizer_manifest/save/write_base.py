"""The layout-free base, written at the save from the source the engine loaded.

A base is what vLLM's own loader reads from the source (the HF safetensors files), under the names the model's
``load_weights`` takes: fed back through ``load_weights`` at another parallel layout, on another machine or
another vLLM release, vLLM shards, stacks and places it for that engine (``load.from_base``). Which module each
tensor fills was observed while the engine loaded (``live_model.sources``). At the save the source is read again
through a loader of the same settings, and every tensor must come back with the bytes the engine loaded (their
hashes were taken as it loaded), else nothing is written (``NotReproducibleError``): the base is the engine's
source, not whatever the directory holds by then.

A base by reference (``source_dir``) writes no tensor file: the document names the source's safetensors files and
the tensors each holds (``storage.source_files``), after the same check of every tensor against what the engine
loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from .. import _vllm_compat
from ..errors import NotReproducibleError
from ..format.generation import BASE_DOCUMENT, GENERATIONS_FORMAT_VERSION, BaseDocument, encode_base
from ..format.schema import EncryptionKey, TensorFileRef, digest_records
from ..live_model.sources import ObservedSource, source_record
from ..progress import ProgressCallback
from ..storage.files import replace_atomically
from ..storage.source_files import source_files_of
from .write import write_stream

#: The base's tensor file's stem in its generation's folder (``base.<digest>.tensors``).
BASE_STEM = "base"


def source_weights(vllm_config: Any, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's source, read again as vLLM's default loader reads it (all of it: no expert filter)."""
    load_config = vllm_config.load_config
    loader = _vllm_compat.default_model_loader(_vllm_compat.source_load_config(load_config))
    return loader.get_all_weights(vllm_config.model_config, model)


def write_base(
    observed: ObservedSource,
    weights: Iterable[tuple[str, torch.Tensor]],
    folder: Path,
    *,
    encryption_key: EncryptionKey | None = None,
    progress: ProgressCallback | None = None,
    source_dir: Path | None = None,
) -> tuple[str, BaseDocument]:
    """Write ``base.<digest>.tensors`` and ``base.manifest.json`` into ``folder`` from ``weights`` (the source read
    again), each tensor checked against what the engine loaded. Returns the document's name and the document.
    With ``source_dir``, a base by reference: the source is checked the same way, and named, not copied."""
    observed.refuse_unattributed()
    expected = observed.records
    ordered = [(record.name, record) for record in expected]
    ref = TensorFileRef(path="", size=0, tensor_count=len(expected), digest=digest_records(ordered))

    def checked() -> Iterator[tuple[str, torch.Tensor]]:
        position = 0
        for name, tensor in weights:
            record = expected[position] if position < len(expected) else None
            again = source_record(name, tensor)
            if record is None or again != record:
                what = (
                    f"source tensor {name!r}"
                    if record is None or record.name == name
                    else (f"the source's tensor #{position} ({name!r}, the engine loaded {record.name!r})")
                )
                raise NotReproducibleError(
                    f"{what} is not the one this engine loaded: its source files changed since it started. Save "
                    "from an engine started on the source as it is now"
                )
            position += 1
            yield name, tensor
        if position != len(expected):
            raise NotReproducibleError(
                f"the source now has {position} tensors, this engine loaded {len(expected)}: its source files changed "
                "since it started. Save from an engine started on the source as it is now"
            )

    if source_dir is None:
        write_stream(
            folder, BASE_STEM, ref, checked(), len(expected), sum(r.nbytes for r in expected), encryption_key, progress
        )
    else:
        for _ in checked():  # read and compared, not written
            pass
    document = BaseDocument(
        format_version=GENERATIONS_FORMAT_VERSION,
        observed=observed.layout,
        tensor_file=ref if source_dir is None else None,
        tensors=expected,
        consumers=observed.consumers,
        loaded=observed.loaded,
        source=None if source_dir is None else source_files_of(source_dir, [record.name for record in expected]),
    )
    replace_atomically(folder / BASE_DOCUMENT, encode_base(document))
    return BASE_DOCUMENT, document
