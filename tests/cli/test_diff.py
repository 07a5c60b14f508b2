"""`diff` reports what differs between two checkpoints: fingerprint, layers, state, kernels, tensors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from helpers.synthetic import write_synthetic_checkpoint

from tensorizer_manifest.cli.diff import diff_manifests
from tensorizer_manifest.storage.checkpoint import load_manifest

V1 = Path(__file__).parents[1] / "fixtures" / "v1-checkpoint"


def test_diff_of_identical_checkpoints_is_empty(tmp_path):
    a = write_synthetic_checkpoint(tmp_path / "a", seed=7)
    assert diff_manifests(load_manifest(a)[0], load_manifest(V1)[0]).same


def test_diff_reports_fingerprint_layers_state_and_tensors(tmp_path):
    a = write_synthetic_checkpoint(tmp_path / "a", seed=1)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    path = b / "model.manifest.json"
    doc = json.loads(path.read_text())
    doc["fingerprint"]["dtype"] = "float16"
    doc["modules"][1]["state"] = "processed"
    doc["modules"][2]["tensors"][0]["shape"] = [16]
    removed = doc["modules"].pop(3)["path"]
    path.write_text(json.dumps(doc))
    result = diff_manifests(load_manifest(a)[0], load_manifest(b)[0])
    assert not result.same
    assert result.fingerprint == [("dtype", "bfloat16", "float16")]
    assert result.layers_removed == [removed] and result.layers_added == []
    changed = {(layer, what) for layer, what, _, _ in result.layers_changed}
    assert ("model.layers.0.mlp.down_proj", "state") in changed
    assert ("model.norm", "tensor weight shape") in changed

    proc = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "diff", str(a), str(b), "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert doc["same"] is False and doc["layers_removed"] == [removed]
    human = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "diff", str(a), str(b)], capture_output=True, text=True
    )
    assert "fingerprint.dtype: 'bfloat16' -> 'float16'" in human.stdout and f"- {removed}" in human.stdout
    same = subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", "diff", str(a), str(a)], capture_output=True, text=True
    )
    assert same.returncode == 0


def test_diff_between_seeds_sees_hashes(tmp_path):
    a = write_synthetic_checkpoint(tmp_path / "a", seed=1)
    b = write_synthetic_checkpoint(tmp_path / "b", seed=2)
    result = diff_manifests(load_manifest(a)[0], load_manifest(b)[0])
    assert any(what == "tensor weight hash" for _, what, _, _ in result.layers_changed)


def test_diff_compares_forms_and_fallbacks(tmp_path):
    plain = load_manifest(write_synthetic_checkpoint(tmp_path / "a", seed=3))[0]
    both = load_manifest(write_synthetic_checkpoint(tmp_path / "b", seed=3, fallbacks=True))[0]
    assert diff_manifests(plain, both).layers_added == ["model.layers.0.mlp.experts"]
    other = load_manifest(write_synthetic_checkpoint(tmp_path / "c", seed=4, fallbacks=True))[0]
    changed = {(layer, what) for layer, what, _, _ in diff_manifests(both, other).layers_changed}
    assert ("model.layers.0.mlp.experts", "fallback tensor w13_weight hash") in changed
    path = tmp_path / "b" / "model.manifest.json"
    doc = json.loads(path.read_text())
    next(m for m in doc["modules"] if m.get("fallback"))["form"]["isa"] = "amx"
    del next(m for m in doc["modules"] if m.get("fallback"))["fallback"]
    doc["seal"] = None
    path.write_text(json.dumps(doc))
    changes = [(what, a, b) for _, what, a, b in diff_manifests(both, load_manifest(tmp_path / "b")[0]).layers_changed]
    assert ("raw fallback", "present", "absent") in changes
    assert any(what == "form" and b["isa"] == "amx" for what, _, b in changes)


def test_diff_names_the_forms_other_engines_added(tmp_path):
    from helpers.synthetic import experts_form_capture

    from tensorizer_manifest.save.write import write_added_form

    checkpoint = write_synthetic_checkpoint(tmp_path / "a", seed=3, fallbacks=True)
    before = load_manifest(checkpoint)[0]
    after = write_added_form(experts_form_capture(), checkpoint, "model", before)
    (change,) = [c for c in diff_manifests(before, after).layers_changed if c[1] == "added forms"]
    assert change[0] == "model.layers.0.mlp.experts" and change[2] == []
    assert change[3] == [{"form": after.added_forms[0].modules[0].form, "on": ["AVX512", "AMX"]}]
