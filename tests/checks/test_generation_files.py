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
    check_generation(generation, False, None, None, tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"v": 2}')  # another save's tokenizer
    with pytest.raises(IntegrityError, match="tokenizer.json: not the tokenizer.json of the checkpoint's generation"):
        check_generation(generation, False, None, None, tmp_path)
    check_generation(generation, False, None, None, "org/a-hub-id")  # not a local directory: nothing to compare


def test_the_generation_s_seal_is_checked_with_the_keys(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    key = SigningKey(b"k" * 32)
    sealed = _generation(tmp_path, key)
    check_generation(sealed, False, key, None, tmp_path)
    with pytest.raises(ConfigurationError, match="generation document is sealed with a signing key"):
        check_generation(sealed, False, None, None, tmp_path)
    with pytest.raises(IntegrityError, match="generation document was modified"):
        check_generation(sealed, False, SigningKey(b"o" * 32), None, tmp_path)
    edited = msgspec.structs.replace(sealed, made_by="migrate")
    with pytest.raises(IntegrityError, match="was modified"):
        check_generation(edited, False, key, None, tmp_path)
    unsealed = msgspec.structs.replace(sealed, seal=None)
    with pytest.raises(IntegrityError, match="not sealed"):
        check_generation(unsealed, False, None, None, tmp_path)


def test_validate_reports_a_generation_s_damaged_model_file_and_warns_of_a_stale_copy_at_the_top(tmp_path):
    from helpers.synthetic import write_synthetic_checkpoint

    from tensorizer_manifest.checks.validate import validate_checkpoint
    from tensorizer_manifest.save import publish
    from tensorizer_manifest.save.write import write_checkpoint

    source = write_synthetic_checkpoint(tmp_path / "source")  # a config.json to copy
    root = tmp_path / "ckpt"
    publication = publish.begin(root, g.new_generation_id())
    manifest = write_checkpoint(make_capture(), publication.folder, "model")
    generation = publish.commit(
        publication,
        made_by="save",
        form_sets=[publish.form_set(g.Layout(), manifest.fingerprint, [publish.rank_entry(publication, "model")])],
        model_files=publish.copy_model_files(publication, source),
    )
    assert validate_checkpoint(root).ok
    (root / "config.json").write_text('{"architectures": ["Another"]}')  # a stale copy at the top
    report = validate_checkpoint(root)
    assert report.ok and any("not the current generation's config.json" in w for w in report.warnings)
    (root / generation.model_files[0].file.path).write_text("{}")  # the generation's own copy damaged
    report = validate_checkpoint(root)
    assert not report.ok
    assert any(p.kind is IntegrityError and "config.json" in p.where for p in report.problems), report.problems
