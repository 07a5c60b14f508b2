"""A generation against the files vLLM read: another save's tokenizer is refused by name, and the generation's
seal follows the manifest's rules."""

from __future__ import annotations

import msgspec
import pytest
from helpers.synthetic import make_capture

from tensorizer_manifest.checks.generation_files import check_generation
from tensorizer_manifest.errors import ConfigurationError, IntegrityError
from tensorizer_manifest.format import generation as g
from tensorizer_manifest.format.schema import SigningKey, blake3_hex
from tensorizer_manifest.save.write import build_manifest

MANIFEST = build_manifest(make_capture(), "model.tensors")[0]


def _generation(model_dir, key=None):
    files = [
        g.ModelFile(name=p.name, file=g.FileRef(path=f"generations/x/{p.name}", size=p.stat().st_size,
                                                 hash=blake3_hex(p.read_bytes())))
        for p in sorted(model_dir.iterdir())
    ]  # fmt: skip
    generation = g.Generation(
        format_version=3, id=g.new_generation_id(), producer="t", made_by="save", model_files=files
    )
    return g.seal_generation(generation, key)


def test_the_generation_s_own_model_files_pass_and_another_save_s_are_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text('{"v": 1}')
    generation = _generation(tmp_path)
    check_generation(generation, MANIFEST, None, None, tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"v": 2}')  # another save's tokenizer
    with pytest.raises(IntegrityError, match="tokenizer.json: not the tokenizer.json of the checkpoint's generation"):
        check_generation(generation, MANIFEST, None, None, tmp_path)
    check_generation(generation, MANIFEST, None, None, "org/a-hub-id")  # not a local directory: nothing to compare


def test_the_generation_s_seal_is_checked_with_the_keys(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    key = SigningKey(b"k" * 32)
    sealed = _generation(tmp_path, key)
    check_generation(sealed, MANIFEST, key, None, tmp_path)
    with pytest.raises(ConfigurationError, match="generation document is sealed with a signing key"):
        check_generation(sealed, MANIFEST, None, None, tmp_path)
    with pytest.raises(IntegrityError, match="generation document was modified"):
        check_generation(sealed, MANIFEST, SigningKey(b"o" * 32), None, tmp_path)
    edited = msgspec.structs.replace(sealed, made_by="migrate")
    with pytest.raises(IntegrityError, match="was modified"):
        check_generation(edited, MANIFEST, key, None, tmp_path)
    unsealed = msgspec.structs.replace(sealed, seal=None)
    with pytest.raises(IntegrityError, match="not sealed"):
        check_generation(unsealed, MANIFEST, None, None, tmp_path)
