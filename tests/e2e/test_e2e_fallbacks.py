"""Raw fallbacks on real vLLM: one checkpoint loads processed where its form fits, through vLLM's step elsewhere.

A layer saved processed in a form that one machine kind or one kernel produces keeps its raw tensors beside it
(by default). ``scenarios/fallbacks.py`` loads the saved checkpoint as it is, as the other x86 machine would see
it (its first such layer records the other ISA), and as a newer vLLM would see it (the fingerprint says 0.31.0),
counting vLLM's steps per layer and every tensor read. The flipped AMX probe (``scenarios/other_machine.py``)
is the other machine itself, where this CPU can run what that machine picks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import kind_param, run_script
from helpers.terminal import typed

from tensorizer_manifest._vllm_compat import has_amx

pytestmark = pytest.mark.e2e

#: Kinds whose expensive layers save processed in a machine-specific form, and their restorer.
MACHINE_SPECIFIC = {"qwen3-moe": "cpu_unquantized_moe", "gptq-w4": "cpu_wna16"}


@pytest.fixture(scope="module", params=[kind_param(k) for k in MACHINE_SPECIFIC])
def loads(request, scenarios, e2e_dir, moto_s3):
    kind = request.param
    saved = scenarios.e2e(kind)
    s3 = {"TM_TEST_S3_ENDPOINT": moto_s3.endpoint, "TM_TEST_S3_KEY_ID": moto_s3.key_id,
          "TM_TEST_S3_SECRET": moto_s3.secret}  # fmt: skip
    result = run_script("scenarios/fallbacks.py", saved["checkpoint"], str(e2e_dir), kind, marker="FALLBACKS_RESULT",
                        output=True, env=s3)  # fmt: skip
    return kind, saved, result


def _fallback_warnings(kind: str, result: dict, case: str) -> list[str]:
    """vLLM's log lines of the load of ``case`` that tell of fallbacks (each names the case's manifest, in the
    case's own folder: ``KIND-other-form`` and ``KIND-base-other-form`` are two cases)."""
    lines = result["_output"].splitlines()
    manifest = re.compile(rf"/{re.escape(kind)}-{re.escape(case)}/(generations/[^/]+/)?model\.manifest\.json")
    return [line for line in lines if manifest.search(line) and "raw fallback" in line]


def _with_fallback(entry: dict) -> dict[str, dict]:
    return {path: layer for path, layer in entry["layers"].items() if layer["fallback_keys"]}


def _steps_on(entry: dict, paths) -> dict[str, int]:
    return {key: n for key, n in entry["post_load_counts"].items() if key.split(":", 1)[1] in paths}


def test_saved_with_the_defaults_machine_specific_layers_keep_a_fallback(loads):
    kind, saved, result = loads
    layers = result["as-saved"]["layers"]
    with_fallback = _with_fallback(result["as-saved"])
    assert with_fallback, "the defaults keep raw fallbacks of machine-specific layers"
    for path, layer in layers.items():
        if layer["fallback_keys"]:
            assert layer["state"] == "processed" and layer["replay"] == MACHINE_SPECIFIC[kind], path
        elif layer["state"] == "processed" and layer["replay"] == MACHINE_SPECIFIC[kind]:
            pytest.fail(f"{path}: a machine-specific processed layer without a fallback")
    assert all(saved["layers"][p]["form"] for p in with_fallback)


def test_where_the_form_fits_only_the_processed_form_is_read(loads):
    _, saved, result = loads
    entry = result["as-saved"]
    assert entry["error"] is None, entry["error"]
    assert entry["tokens"] == saved["reference_tokens"]
    assert entry["forms"]["fallback"] == 0 and entry["forms"]["processed_with_fallback"] == len(_with_fallback(entry))
    wanted = {k for layer in entry["layers"].values() for k in layer["keys"]}
    assert {file for file, _, _ in entry["keys_read"]} == {entry["tensor_file"]}
    read = [key for _, key, _ in entry["keys_read"]]
    assert sorted(read) == sorted(wanted), "every layer's own tensors once, no fallback's"
    assert not _steps_on(entry, _with_fallback(entry)), "processed layers never see vLLM's step"
    manifest = re.compile(rf"{re.escape(result['checkpoint'])}/(generations/[^/]+/)?model\.manifest\.json")
    assert not [line for line in result["_output"].splitlines() if manifest.search(line) and "raw fallback" in line]


def test_a_layer_whose_form_this_machine_would_not_produce_loads_through_its_fallback(loads):
    """The other machine's form on one layer: that layer alone falls back, token-exact, vLLM's step once."""
    kind, saved, result = loads
    entry = result["other-form"]
    assert entry["error"] is None, entry["error"]
    assert entry["tokens"] == saved["reference_tokens"]
    with_fallback = _with_fallback(entry)
    edited = next(iter(with_fallback))  # the scenario edits the first
    assert entry["forms"]["fallback_layers"] == [edited]
    (reason,) = entry["forms"]["fallback_reasons"]
    assert "recorded, this machine gives" in reason
    assert _steps_on(entry, {edited}) == {f"quant_method:{edited}": 1}
    (warning,) = _fallback_warnings(kind, result, "other-form")  # no silent fallback: vLLM's log says it
    assert "1 processed layer(s) loaded through their raw fallback" in warning and reason in warning
    assert not _steps_on(entry, set(with_fallback) - {edited})
    wanted = {k for layer in entry["layers"].values() for k in layer["keys"]}
    wanted = wanted - set(entry["layers"][edited]["keys"]) | set(entry["layers"][edited]["fallback_keys"])
    assert sorted(key for _, key, _ in entry["keys_read"]) == sorted(wanted), "only the chosen form's tensors"


def test_saved_with_a_base_a_layer_that_takes_its_fallback_is_fed_from_the_base(loads):
    """The default save (with a base) stores no fallback bytes of its own: they are the base's. The other machine's
    form on one layer: that layer is fed from the base, vLLM's step once on it, token-exact. One byte of the base
    tensor it is fed from changed: refused by content hash, nothing served."""
    _, saved, result = loads
    entry = result["base-other-form"]
    assert entry["error"] is None, entry["error"]
    assert entry["tokens"] == saved["reference_tokens"]
    with_fallback = _with_fallback(entry)
    edited = next(iter(with_fallback))
    assert all(key is None for p in with_fallback for key in entry["layers"][p]["fallback_keys"])  # the base's
    assert entry["forms"]["fallback_layers"] == [edited] and edited in entry["layers_fed"]
    assert _steps_on(entry, {edited}) == {f"quant_method:{edited}": 1}
    assert not _steps_on(entry, set(with_fallback) - {edited})
    damaged = result["base-other-form-damaged"]
    assert damaged["error"] is not None and damaged["error"].startswith("IntegrityError"), damaged["error"]
    assert "content hash of base tensor" in damaged["error"] and "tokens" not in damaged


def test_saved_with_a_base_add_form_makes_this_machines_form_from_what_the_base_fed(loads):
    """The other machine's checkpoint with a base: add-form feeds the fallbacks from the base, observes vLLM's step
    and adds this machine's form; those layers then load it, processed, token-exact."""
    _, saved, result = loads
    entry = result["base-added-form"]
    with_fallback = _with_fallback(entry)
    added = result["base-add-form"]
    assert sorted(added["added"]) == sorted(with_fallback) and added["not_added"] == {}
    assert entry["error"] is None, entry["error"]
    assert entry["tokens"] == saved["reference_tokens"]
    assert entry["forms"]["added_form"] == len(with_fallback) and entry["forms"]["fallback"] == 0
    assert not _steps_on(entry, with_fallback), "vLLM's step ran on a layer its added form holds processed"


def test_a_kernel_specific_form_from_another_vllm_loads_through_the_fallbacks(loads):
    kind, saved, result = loads
    entry = result["older-vllm"]
    assert entry["error"] is None, entry["error"]
    assert entry["tokens"] == saved["reference_tokens"]
    with_fallback = _with_fallback(entry)
    assert sorted(entry["forms"]["fallback_layers"]) == sorted(with_fallback)
    (reason,) = entry["forms"]["fallback_reasons"]
    assert "vllm_version '0.31.0'" in reason
    (warning,) = _fallback_warnings(kind, result, "older-vllm")
    assert f"{len(with_fallback)} processed layer(s) loaded through their raw fallback" in warning
    assert _steps_on(entry, with_fallback) == {f"quant_method:{p}": 1 for p in with_fallback}
    read = {key for _, key, _ in entry["keys_read"]}
    assert not read & {k for p in with_fallback for k in entry["layers"][p]["keys"]}
    assert read >= {k for p in with_fallback for k in entry["layers"][p]["fallback_keys"]}
    assert entry["bytes_read"] == sum(n for _, _, n in entry["keys_read"])


def test_without_fallbacks_the_other_machine_refuses_before_reading(scenarios, e2e_dir):
    """``--no-fallbacks``: only the processed form, and the other machine kind refuses it as before."""
    saved = scenarios.e2e("qwen3-moe")
    out = Path(e2e_dir) / "qwen3-moe-no-fallbacks"
    model_dir = Path(saved["checkpoint"]).parent / "tiny-qwen3-moe"
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the flag is the subject, not vLLM's engine
    said = typed("save", str(model_dir), str(out), "--dtype", "bfloat16", "--no-fallbacks", env=in_process)
    assert said.returncode == 0 and "committed generation" in said.flat, said.output[-3000:]  # as typed
    result = run_script("scenarios/other_machine.py", str(out), marker="OTHER_MACHINE_RESULT")
    assert result["error"] == "CompatibilityError", result
    assert "saved processed in the layout" in result["message"] and "--portable" in result["message"]
    assert result["tensors_read"] == 0


@pytest.mark.skipif(
    not has_amx(),
    reason="loading as the other machine runs that machine's kernels: a CPU without AMX cannot run the AMX ones "
    "it would pick with the probe flipped (the other-form case above shows the fallback path on this CPU)",
)
@pytest.mark.parametrize("kind", [kind_param(k) for k in ("gptq-w4", "awq-w4", "ct-w4a16", "qwen3-moe")])
def test_the_other_machine_loads_the_defaults_token_exact(scenarios, kind):
    saved = scenarios.e2e(kind)
    model_dir = str(Path(saved["checkpoint"]).parent / f"tiny-{kind}")
    other = run_script("scenarios/other_machine.py", saved["checkpoint"], "--reference", model_dir,
                       marker="OTHER_MACHINE_RESULT")  # fmt: skip
    assert other["error"] is None, other
    assert other["tokens"] == other["reference_tokens"]


def test_a_damaged_fallback_is_caught_by_its_content_hash_and_nothing_is_served(loads):
    _, _, result = loads
    entry = result["other-form-damaged"]
    assert entry["error"] is not None and entry["error"].startswith("IntegrityError"), entry["error"]
    assert "content hash of" in entry["error"] and "does not match" in entry["error"]
    assert "tokens" not in entry


def test_add_form_makes_the_other_machines_checkpoint_load_processed_here(loads):
    """Saved where its form is the other machine's, this machine adds its own (``add-form`` typed on a terminal: it
    ends with its summary): those layers then load that form, processed (no vLLM step), bitwise what vLLM makes
    here, and only their added tensors are read for them."""
    _, saved, result = loads
    with_fallback = _with_fallback(result["as-saved"])
    added = result["add-form"]
    assert added["returncode"] == 0, added["said"][-3000:]
    assert "Traceback" not in added["said"] and "error:" not in added["said"], added["said"][-3000:]
    assert sorted(added["added"]) == sorted(with_fallback) and added["tensor_file"]
    summary = f"added the form of {len(with_fallback)} layers made here: {added['tensor_file']}"
    assert summary in added["said"] and "this machine kind now loads them processed" in added["said"], added["said"]
    assert "stays on its fallback" not in added["said"]  # nothing left out
    entry = result["added-form"]
    assert entry["error"] is None, entry["error"]
    assert entry["tokens"] == saved["reference_tokens"]
    assert entry["forms"]["added_form"] == len(with_fallback) and entry["forms"]["fallback"] == 0
    assert not _steps_on(entry, with_fallback), "the added form is processed: vLLM's step never runs on it"
    (form,) = entry["added_forms"]
    assert form["tensor_file"] == added["tensor_file"]
    here = result["as-saved"]["layers"]  # saved on this machine: vLLM's own processed tensors here
    for path in with_fallback:
        assert form["layers"][path]["hashes"] == here[path]["hashes"], f"{path}: not bitwise vLLM's form here"
        assert form["layers"][path]["form"] == saved["layers"][path]["form"]
    main = {k for p, layer in entry["layers"].items() if p not in with_fallback for k in layer["keys"]}
    read = {(file, key) for file, key, _ in entry["keys_read"]}
    assert read == {(entry["tensor_file"], k) for k in main} | {
        (form["tensor_file"], k) for p in with_fallback for k in form["layers"][p]["keys"]
    }


def test_an_added_form_a_layer_does_not_choose_is_never_opened(loads):
    _, saved, result = loads
    entry = result["added-form-unused"]  # the saved forms fit here again; the added form's file is gone
    assert entry["error"] is None, entry["error"]
    assert entry["tokens"] == saved["reference_tokens"]
    assert entry["forms"]["processed_with_fallback"] == len(_with_fallback(entry)) and entry["forms"]["added_form"] == 0
    assert entry["forms"]["skipped_forms"] == {}
    assert {file for file, _, _ in entry["keys_read"]} == {entry["tensor_file"]}


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("added-form-missing", "CheckpointNotFoundError"),
        ("added-form-truncated", "IntegrityError"),
        ("added-form-unknown-replay", "restorer_from_a_newer_version"),
        ("added-form-newer-field", "cannot read it"),
        ("added-form-other-base", "other raw fallbacks"),
    ],
)
def test_an_added_form_this_loader_cannot_use_is_skipped_said_and_its_layers_fall_back(loads, case, why):
    """A form is an optimisation, never a single point of failure: missing, damaged, from a newer version, or
    made over other fallbacks."""
    _, saved, result = loads
    entry = result[case]
    with_fallback = _with_fallback(entry)
    assert entry["error"] is None, entry["error"]
    assert entry["tokens"] == saved["reference_tokens"]
    assert entry["forms"]["added_form"] == 0 and entry["forms"]["fallback"] == len(with_fallback)
    assert list(entry["forms"]["skipped_forms"]) == ["0"] and why in entry["forms"]["skipped_forms"]["0"]
    assert _steps_on(entry, with_fallback) == {f"quant_method:{p}": 1 for p in with_fallback}
    logged = [line for line in result["_output"].splitlines() if "added form 0 is skipped" in line]
    assert any(why in line for line in logged), logged


def test_add_form_with_other_engine_settings_is_refused_and_writes_nothing(loads):
    _, _, result = loads
    refused = result["add-form-float16"]
    assert refused["error"] is not None and refused["error"].startswith("CompatibilityError"), refused
    assert "dtype" in refused["error"] and "float16" in refused["error"]
    assert refused["files"] == refused["files_before"]


@pytest.mark.skipif(
    not has_amx(),
    reason="adding the other machine's form runs that machine's kernels: a CPU without AMX cannot run the AMX ones "
    "it would pick with the probe flipped (the added-form case above shows add-form on this CPU)",
)
@pytest.mark.parametrize("kind", [kind_param(k) for k in ("gptq-w4", "awq-w4", "ct-w4a16", "qwen3-moe")])
def test_after_add_form_the_other_machine_loads_processed_and_bitwise_its_default_loaders(scenarios, e2e_dir, kind):
    saved = scenarios.e2e(kind)
    model_dir = str(Path(saved["checkpoint"]).parent / f"tiny-{kind}")
    other = run_script("scenarios/other_machine.py", saved["checkpoint"], "--reference", model_dir,
                       "--add-form", str(e2e_dir), marker="OTHER_MACHINE_RESULT")  # fmt: skip
    assert other["error"] is None, other
    added = other["add_form"]["added"]
    assert added and other["add_form"]["not_added"] == {}
    assert other["forms"]["added_form"] == len(added) and other["forms"]["fallback"] == 0
    assert not [k for k in other["post_load_counts"] if k.split(":", 1)[1] in added]
    assert other["tokens"] == other["reference_tokens"]
    for name, digest in other["added_hashes"].items():
        assert other["reference_hashes"][name] == digest, f"{name}: not what vLLM's default loader makes there"


def test_add_form_works_on_s3_and_the_checkpoint_then_loads_processed_from_there(loads):
    _, saved, result = loads
    with_fallback = _with_fallback(result["as-saved"])
    added = result["s3-add-form"]
    assert sorted(added["added"]) == sorted(with_fallback)
    current = added["current"]  # the add-form's generation, committed over the one its engine loaded
    assert current["id"] == added["generation"] and current["made_by"] == "add-form"
    assert (
        len(current["tensor_files"]) == 2
        and current["tensor_files"][1] == f"generations/{current['id']}/" + (added["tensor_file"])
    )
    entry = result["s3-added-form"]
    assert entry["error"] is None, entry["error"]
    assert entry["tokens"] == saved["reference_tokens"]
    assert entry["forms"]["added_form"] == len(with_fallback) and entry["forms"]["fallback"] == 0
    assert not _steps_on(entry, with_fallback)
