"""vLLM's record of the model's class, carried by a checkpoint (``load.model_class_record``), without vLLM: a save keeps
the record vLLM holds for the source's architecture, and a load places it where vLLM looks only under the trust a
compile form needs, with the generation's bytes, never over a record that is there. That vLLM then starts without
inspecting the class is shown on real vLLM by ``tests/e2e/test_e2e_compile_forms.py`` (`vllm serve` with the key)."""

from __future__ import annotations

import json

import pytest
from helpers.synthetic import make_capture

from tensorizer_manifest import _vllm_compat
from tensorizer_manifest.format import generation as g
from tensorizer_manifest.format.schema import SigningKey
from tensorizer_manifest.load.model_class_record import RECORD_PREFIX, place_records, record_of
from tensorizer_manifest.save import publish
from tensorizer_manifest.save.write import write_checkpoint
from tensorizer_manifest.storage.checkpoint import current_generation_folder

RECORD_NAME = "vllm-model_executor-models-llama-LlamaForCausalLM.json"
RECORD = json.dumps({"hash": "d032877f", "modelinfo": {"architecture": "LlamaForCausalLM", "supports_pp": True}},
                    indent=2).encode()  # fmt: skip


@pytest.fixture
def vllm_records(tmp_path, monkeypatch):
    """vLLM's folder of records (``VLLM_CACHE_ROOT/modelinfos``), holding the Llama's and another class's."""
    folder = tmp_path / "vllm-cache" / "modelinfos"
    folder.mkdir(parents=True)
    (folder / RECORD_NAME).write_bytes(RECORD)
    other = {"hash": "0", "modelinfo": {"architecture": "Qwen3MoeForCausalLM"}}
    (folder / "vllm-model_executor-models-qwen3_moe-Qwen3MoeForCausalLM.json").write_text(json.dumps(other))
    monkeypatch.setattr(_vllm_compat, "model_class_records", lambda: folder)
    return folder


@pytest.fixture
def source(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    (source / "tokenizer.json").write_text('{"version": "1.0"}\n')
    return source


def _save(root, source, signing_key=None) -> g.Generation:
    publication = publish.begin(root, g.new_generation_id())
    manifest = write_checkpoint(make_capture(0), publication.folder, "model", signing_key=signing_key)
    return publish.commit(
        publication,
        made_by="save",
        form_sets=[publish.layout_form_set(publication, g.Layout(), manifest.fingerprint)],
        model_files=publish.copy_model_files(publication, source),
        signing_key=signing_key,
    )


def test_a_save_keeps_vllms_record_of_the_sources_class_and_a_save_from_a_checkpoint_keeps_one(
    tmp_path, source, vllm_records
):
    generation = _save(tmp_path / "ckpt", source)
    names = sorted(m.name for m in generation.model_files)
    assert names == sorted(["config.json", "tokenizer.json", RECORD_PREFIX + RECORD_NAME])
    folder, _ = current_generation_folder(tmp_path / "ckpt")
    assert (folder / (RECORD_PREFIX + RECORD_NAME)).read_bytes() == RECORD
    # A generation's folder as the source (an engine serving the checkpoint saves itself): vLLM's record once,
    # and neither that generation's document nor its commit mark taken for a model file.
    again = _save(tmp_path / "again", folder)
    assert sorted(m.name for m in again.model_files) == names


@pytest.mark.parametrize("config", ['{"architectures": ["GPT2LMHeadModel"]}', '{"architectures": []}', "not json"])
def test_a_source_vllm_holds_no_single_record_of_keeps_none(tmp_path, source, vllm_records, config):
    (source / "config.json").write_text(config)
    assert record_of(source) is None


@pytest.mark.parametrize(
    "signed, given_key, trust, placed",
    [
        (True, True, False, True),  # the seal checked with the user's key
        (False, False, True, True),  # the user trusts whoever can write the checkpoint
        (False, False, False, False),  # neither: vLLM inspects the class, as it would have
        (True, False, False, False),
        (False, True, False, False),  # a key that does not check the seal: the load refuses it
    ],
)
def test_a_record_is_placed_only_under_a_checked_seal_or_the_users_trust(
    tmp_path, source, vllm_records, signed, given_key, trust, placed, caplog
):
    key = SigningKey(b"k" * 32)
    generation = _save(tmp_path / "ckpt", source, signing_key=key if signed else None)
    folder, _ = current_generation_folder(tmp_path / "ckpt")
    (vllm_records / RECORD_NAME).unlink()  # a fresh machine: vLLM holds no record of the class
    with caplog.at_level("INFO", logger="vllm.tensorizer_manifest"):
        written = place_records(folder, generation, key if given_key else None, None, trust)
    assert written == ([RECORD_NAME] if placed else [])
    assert (vllm_records / RECORD_NAME).exists() is placed
    said = "placed vLLM's record" if placed else "record of the model's class not placed ("
    assert said in caplog.text, caplog.text  # either way, one line says so
    if placed:
        assert (vllm_records / RECORD_NAME).read_bytes() == RECORD


def test_a_record_vllm_holds_is_kept_and_one_whose_bytes_changed_is_not_placed(tmp_path, source, vllm_records):
    generation = _save(tmp_path / "ckpt", source)
    folder, _ = current_generation_folder(tmp_path / "ckpt")
    (vllm_records / RECORD_NAME).write_bytes(b"vLLM's own, newer")
    assert place_records(folder, generation, None, None, True) == []
    assert (vllm_records / RECORD_NAME).read_bytes() == b"vLLM's own, newer"
    (vllm_records / RECORD_NAME).unlink()
    (folder / (RECORD_PREFIX + RECORD_NAME)).write_bytes(RECORD.replace(b"true", b"false"))
    assert place_records(folder, generation, None, None, True) == []
    assert not (vllm_records / RECORD_NAME).exists()
