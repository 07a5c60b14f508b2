"""Format version 3 on real vLLM: a save is one generation; a TP=2 engine's ranks agree on one generation while
a re-save of another model commits (a loader racing a writer, made deterministic with a named pause)."""

from __future__ import annotations

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def result(e2e_dir, moto_s3):
    s3 = {"TM_TEST_S3_ENDPOINT": moto_s3.endpoint, "TM_TEST_S3_KEY_ID": moto_s3.key_id,
          "TM_TEST_S3_SECRET": moto_s3.secret}  # fmt: skip
    return run_script(
        "scenarios/generations.py", str(e2e_dir), marker="GENERATIONS_RESULT", timeout=1500, output=True, env=s3
    )


def test_a_generation_loads_token_exact_against_the_engine_it_was_saved_from(result):
    one = result["one_rank"]
    assert one["tokens"] == one["reference"]
    assert one["saved_generation"] == one["current"] == one["loaded_generation"]
    assert {"config.json", "tokenizer_config.json"} <= set(one["model_files"])
    assert {"tensorizer-manifest.json", "generations", "model.manifest.json", "config.json"} <= set(one["top_level"])
    assert not any(name.endswith(".tensors") for name in one["top_level"]), "tensor files belong in a generation"


def test_a_generation_s_own_folder_as_vllm_s_model_loads_that_generation(result):
    one = result["one_rank"]
    assert one["pinned_tokens"] == one["reference"]
    assert one["pinned_generation"] == one["saved_generation"]


def test_vllm_reads_the_generation_s_own_files_whatever_lies_at_the_top(result):
    """The plugin gives vLLM the current generation's folder as its ``model``: a tokenizer file edited at the top
    (another save's) is never what the engine runs with; the served name stays the path the user gave."""
    one = result["one_rank"]
    at_top = one["other_tokenizer_at_top"]
    assert at_top["tokens"] == one["reference"]
    assert at_top["model_max_length"] != 7, "vLLM read the edited top-level tokenizer_config.json"
    assert at_top["model"].endswith(f"/generations/{one['current']}")
    assert at_top["served_model_name"] == one["checkpoint"]


def test_another_save_s_tokenizer_beside_the_weights_is_refused_by_name(result):
    """Where vLLM's model is a directory apart from the checkpoint (``checkpoint_dir``), its files are checked."""
    assert result["one_rank"]["other_tokenizer"] is not None, "an engine started with another save's tokenizer"
    refusals = [line for line in result["_output"].splitlines() if "IntegrityError" in line]
    assert any("tokenizer_config.json: not the tokenizer_config.json of the checkpoint's generation" in line
               for line in refusals), refusals  # fmt: skip


def test_a_tp2_load_reads_one_generation_while_two_re_saves_commit_and_a_gc_runs(result):
    """Both ranks paused after agreeing on A; B's save committed to completion, then C's, then a gc; released, the
    engine answers as A, every rank reporting A's generation (gc kept it: retired within its grace period). A fresh
    load then answers as B's weights, from C. No mix, no error."""
    race = result["race"]
    assert race["paused_both_ranks"], race.get("raced_output")
    assert race["generation_b"] != race["generation_a"]
    assert race["tokens_b"] != race["tokens_a"], "the two models must answer differently for the test to mean anything"
    raced = race["raced"]
    assert raced is not None, race.get("raced_output")
    assert raced["generations"] == [race["generation_a"], race["generation_a"]]
    assert raced["tokens"] == race["tokens_a"]
    # and what vLLM reads itself is A's too, the generation config read after the load included (B's differ)
    assert raced["read"]["model"].endswith(f"/generations/{race['generation_a']}"), raced["read"]
    assert (raced["read"]["temperature"], raced["read"]["top_k"]) != (0.25, 7), raced["read"]
    assert raced["read"]["model_max_length"] != 77, raced["read"]
    assert race["gc"].get("current") == race["generation_c"], race["gc"]
    assert {race["generation_a"], race["generation_b"]} <= set(race["gc"]["kept_generations"])
    assert not [path for path in race["gc"]["removed"] if race["generation_a"] in path]
    assert race["generation_after"] == race["generation_c"]
    assert race["tokens_after"] == race["tokens_b"]


def test_on_s3_racing_uploads_and_a_failed_rank_upload_leave_one_save_that_loads_token_exact(result):
    """A's upload paused before its pointer PUT while B's commits: A is refused; A again with rank 1's manifest
    upload failing: refused, the pointer still B's. A TP=2 engine loads from the bucket as B, token-exact."""
    race, s3 = result["race"], result["s3"]
    assert s3["a_paused"], "A's writer never reached its commit"
    assert len(s3["writer_a"]) == 1 and s3["writer_a"][0].startswith("UPLOAD refused ConcurrentWriteError"), s3
    assert race["generation_b"] in s3["writer_a"][0]  # it names the generation that won
    assert s3["current_after_race"] == race["generation_b"]
    assert s3["failed_upload"] is not None and s3["failed_upload"][0].startswith("RemoteStorageError: "), s3
    assert "model-tp1-of-2.manifest.json" in s3["failed_upload"][0]
    assert s3["current_after_failed_upload"] == race["generation_b"]
    assert s3["generation"] == race["generation_b"]
    assert s3["tokens"] == race["tokens_b"] != race["tokens_a"]
