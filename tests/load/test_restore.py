"""Restoring tensors into a freshly built model, and checking the model against the manifest first.

The model is a plain torch double with the synthetic checkpoint's layer paths; the
vLLM end of loading is proved in the end-to-end tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.synthetic import fresh_synthetic_model, make_capture, write_synthetic_checkpoint

from tensorizer_manifest.checks.validate import check_files
from tensorizer_manifest.errors import CompatibilityError, IntegrityError
from tensorizer_manifest.load.restore import check_model, restore_tensors
from tensorizer_manifest.storage.checkpoint import load_manifest
from tensorizer_manifest.storage.tensor_file import TensorFileReader


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("load") / "ckpt")


def test_restore_puts_back_exact_tensors_ties_and_layouts(checkpoint):
    manifest, path = load_manifest(checkpoint)
    model = fresh_synthetic_model()
    fresh_embedding = model.model.embed_tokens.weight
    check_model(manifest, model)
    with TensorFileReader(check_files(manifest, path)) as reader:
        nbytes = restore_tensors(model, manifest, reader)
    assert nbytes == sum(r.nbytes for _, r in manifest.ordered_records() if r.key)
    saved = {layer.path: layer.tensors for layer in make_capture().layers}
    for path_, slots in saved.items():
        module = model.get_submodule(path_)
        for name, slot in slots.items():
            got = getattr(module, name)
            assert got.dtype == slot.tensor.dtype and got.stride() == slot.tensor.stride(), f"{path_}.{name}"
            assert torch.equal(got, slot.tensor), f"{path_}.{name}"
            assert isinstance(got, torch.nn.Parameter) == (slot.kind == "parameter")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie is made again
    assert model.model.embed_tokens.weight is fresh_embedding  # vLLM's Parameter keeps its identity...
    assert not fresh_embedding.requires_grad  # ...and takes the saved form
    assert "cache" in model.model.norm._non_persistent_buffers_set


def test_a_damaged_tensor_is_caught_by_its_hash_while_reading(checkpoint, tmp_path):
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(checkpoint, d)
    manifest, path = load_manifest(d)
    tensor_path = check_files(manifest, path)
    from tensorizer_manifest.storage.tensor_file import read_index

    entry = read_index(tensor_path)["model.layers.0.mlp.down_proj.weight"]
    data = bytearray(tensor_path.read_bytes())
    data[entry.data_offset + 3] ^= 0x01
    tensor_path.write_bytes(bytes(data))
    with TensorFileReader(tensor_path) as reader, pytest.raises(IntegrityError, match="content hash of"):
        restore_tensors(fresh_synthetic_model(), manifest, reader)


def test_check_model_names_every_difference_before_reading(checkpoint):
    manifest, _ = load_manifest(checkpoint)
    model = fresh_synthetic_model()
    model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(
        torch.zeros(48, 16, dtype=torch.int8), requires_grad=False
    )
    model.extra = torch.nn.Linear(2, 2)
    del model.model.norm
    with pytest.raises(CompatibilityError) as info:
        check_model(manifest, model)
    message = str(info.value)
    assert "down_proj.weight: saved int8[48, 32], this engine int8[48, 16]" in message
    assert "extra: saved absent from the manifest" in message
    assert "model.norm: saved recorded in the manifest, this engine absent from this model" in message


def test_layers_are_handed_on_in_manifest_order_as_their_tensors_arrive(checkpoint):
    manifest, path = load_manifest(checkpoint)
    model = fresh_synthetic_model()
    seen = []

    def on_layer(record, module, check_hashes):
        check_hashes(record.path)  # this layer's hashes are checked; later layers may still be reading
        assert all(getattr(module, t.name) is not None for t in record.tensors)
        seen.append(record.path)

    with TensorFileReader(check_files(manifest, path), num_readers=2) as reader:
        restore_tensors(model, manifest, reader, on_layer=on_layer)
    assert seen == [m.path for m in manifest.modules]


def test_a_file_written_in_another_order_still_restores(checkpoint, tmp_path):
    """Tensors are taken in file order and kept until their layer comes; the order is not assumed."""
    from tensorizer_manifest.storage.tensor_file import write_tensor_file

    manifest, path = load_manifest(checkpoint)
    with TensorFileReader(check_files(manifest, path)) as reader:
        stored = list(reader.stream())
    reversed_file = tmp_path / "reversed.tensors"
    write_tensor_file(reversed_file, reversed(stored))
    model = fresh_synthetic_model()
    with TensorFileReader(reversed_file) as reader:
        restore_tensors(model, manifest, reader)
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, dict(stored)["model.layers.0.mlp.down_proj.weight"])


def test_the_checked_in_v1_checkpoint_still_loads():
    """Written by tensorizer-manifest 0.1.0 before the layout change: it validates and restores exactly."""
    v1 = Path(__file__).parents[1] / "fixtures" / "v1-checkpoint"
    manifest, path = load_manifest(v1)
    model = fresh_synthetic_model()
    check_model(manifest, model)
    with TensorFileReader(check_files(manifest, path)) as reader:
        restore_tensors(model, manifest, reader)
    for layer in make_capture(seed=7).layers:  # the capture the fixture was written from
        for name, slot in layer.tensors.items():
            assert torch.equal(getattr(model.get_submodule(layer.path), name), slot.tensor), f"{layer.path}.{name}"


class _LayoutRestorer:
    """A restorer whose layout depends on a flag the test flips (as AMX decides vLLM's CPU layouts)."""

    name = "test_layout"
    kernel_independent = False
    amx = True

    def form(self, module):
        return {"isa": "amx" if self.amx else "vec"}

    def creates_tensors(self, module):
        return set()


def test_a_processed_layer_in_a_layout_this_machine_would_not_produce_is_refused(checkpoint, monkeypatch):
    import msgspec

    from tensorizer_manifest import restorers

    manifest, _ = load_manifest(checkpoint)
    down = next(m for m in manifest.modules if m.path.endswith("down_proj"))
    edited = msgspec.structs.replace(down, state="processed", replay="test_layout", form={"isa": "amx"})
    manifest = msgspec.structs.replace(manifest, modules=[edited if m is down else m for m in manifest.modules])
    layout = _LayoutRestorer()
    monkeypatch.setitem(restorers.RESTORERS, "test_layout", layout)
    check_model(manifest, fresh_synthetic_model())  # the same layout here: accepted
    layout.amx = False
    with pytest.raises(CompatibilityError) as info:
        check_model(manifest, fresh_synthetic_model())
    message = str(info.value)
    assert "model.layers.0.mlp.down_proj" in message and "{'isa': 'amx'}" in message and "{'isa': 'vec'}" in message
    assert "--portable" in message
    assert info.value.differences == [("model.layers.0.mlp.down_proj.form", {"isa": "amx"}, {"isa": "vec"})]


def test_an_encrypted_checkpoint_restores_with_its_key_and_is_refused_without_it_before_reading(tmp_path):
    from tensorizer_manifest.errors import ConfigurationError
    from tensorizer_manifest.format.schema import EncryptionKey
    from tensorizer_manifest.progress import ProgressUpdate
    from tensorizer_manifest.save.write import write_checkpoint

    key = EncryptionKey(b"e" * 32)
    write_checkpoint(make_capture(), tmp_path / "ckpt", "model", encryption_key=key)
    manifest, path = load_manifest(tmp_path / "ckpt")
    with pytest.raises(ConfigurationError, match="encryption_key_file in model_loader_extra_config"):
        check_files(manifest, path)
    with pytest.raises(IntegrityError, match="encryption key is not the one"):  # the seal is keyed from it
        check_files(manifest, path, encryption_key=EncryptionKey(b"f" * 32))
    model = fresh_synthetic_model()
    updates: list[ProgressUpdate] = []
    with TensorFileReader(check_files(manifest, path, encryption_key=key), encryption_key=key) as reader:
        nbytes = restore_tensors(model, manifest, reader, progress=updates.append)
    assert updates[-1].nbytes == updates[-1].total_bytes == nbytes
    assert updates[-1].tensors == updates[-1].total_tensors == manifest.tensor_file.tensor_count
    for layer in make_capture().layers:
        for name, slot in layer.tensors.items():
            assert torch.equal(getattr(model.get_submodule(layer.path), name), slot.tensor)
