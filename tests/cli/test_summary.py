"""What `inspect` shows: short class names, rows per layer, the summary (no torch needed)."""

from __future__ import annotations

from helpers.synthetic import write_synthetic_checkpoint

from tensorizer_manifest.cli.summary import layer_row, summary
from tensorizer_manifest.storage.checkpoint import read_manifest


def test_rows_and_summary_of_the_synthetic_checkpoint(tmp_path):
    manifest = read_manifest(write_synthetic_checkpoint(tmp_path / "ckpt"))
    rows = {row["path"]: row for row in map(layer_row, manifest.modules)}
    assert rows["lm_head"]["aliases"] == 1 and rows["lm_head"]["bytes"] == 0  # tied: stored once, elsewhere
    assert rows["model.embed_tokens"]["kernels"] == ["cpu_linear=linear"]
    assert rows["model.layers.0.mlp.down_proj"]["runtime_state"] == ["azp_adj"]
    s = summary(manifest)
    assert (s["layers"], s["raw_layers"], s["processed_layers"]) == (4, 1, 3)
    assert s["tensor_file_bytes"] == manifest.tensor_file.size and s["model_class"] == "LlamaForCausalLM"


def test_a_layer_with_a_raw_fallback_shows_both_forms(tmp_path):
    manifest = read_manifest(write_synthetic_checkpoint(tmp_path / "c", fallbacks=True) / "model.manifest.json")
    layer = next(m for m in manifest.modules if m.fallback)
    own, fallback = layer_row(layer)["forms"]
    assert own == {"state": "processed", "form": layer.form, "tensors": 1, "bytes": 4 * 16 * 32 * 2}
    assert fallback == {"state": "raw fallback", "form": {}, "tensors": 1, "bytes": 4 * 12 * 32 * 2}
    s = summary(manifest)
    assert s["format_version"] == 2 and s["layers_with_fallback"] == 1 and s["fallback_bytes"] == 4 * 12 * 32 * 2
    assert all(len(layer_row(m)["forms"]) == 1 for m in manifest.modules if not m.fallback)


def test_a_form_another_engine_added_is_shown_between_the_own_form_and_the_fallback(tmp_path):
    from helpers.synthetic import experts_form_capture

    from tensorizer_manifest.cli.summary import added_records
    from tensorizer_manifest.save.write import write_added_form

    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    manifest = write_added_form(experts_form_capture(), checkpoint, "model", read_manifest(checkpoint))
    layer = next(m for m in manifest.modules if m.fallback)
    forms = layer_row(layer, added_records(manifest)[layer.path])["forms"]
    assert [f["state"] for f in forms] == ["processed", "processed (added form 0)", "raw fallback"]
    assert forms[1]["form"]["isa"] == "amx"
    (added,) = summary(manifest)["added_forms"]
    assert added["layers"] == 1 and added["cpu_features"] == ["AVX512", "AMX"]
