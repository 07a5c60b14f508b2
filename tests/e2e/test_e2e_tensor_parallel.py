"""Tensor parallelism: one manifest and tensor file per rank, each holding that rank's shard."""

from __future__ import annotations

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def result(e2e_dir):
    return run_script("scenarios/tensor_parallel.py", str(e2e_dir), marker="TP_RESULT", timeout=1200, output=True)


def test_tp2_save_and_load_token_exact(result):
    assert result["tokens"] == result["reference"]
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert all(r["size"] == 2 for r in result["ranks"])
    assert result["ranks"][0]["digest"] != result["ranks"][1]["digest"], "both ranks saved the same shard"
    assert len(result["saved"]) == 2
    save_ids = {r["save_id"] for r in result["ranks"]}
    assert len(save_ids) == 1 and None not in save_ids, "the ranks of one save share one id"


def test_a_save_that_fails_on_one_rank_commits_on_none_and_leaves_the_checkpoint_as_it_was(result):
    """Rank 1's rebuild refuses (its weight changed in place); rank 0 wrote its part, then the vote: neither
    commits, and every manifest and tensor file is as it was (the checkpoint that loaded token-exact)."""
    assert result["nudged"] == [None, "model.layers.0.post_attention_layernorm.weight"]
    assert result["voted_down_save"] is not None, "a save with a changed rank committed"
    output = result["_output"]
    assert "model.layers.0.post_attention_layernorm.weight differs" in output  # rank 1's own refusal
    assert "another rank of this engine failed to write its part of the save" in output  # rank 0 voted down
    assert result["unchanged_by_voted_down_save"], result["files_before"]


def test_a_save_that_failed_on_one_rank_after_another_committed_is_refused_at_load_naming_the_ranks(result):
    assert result["failed_save"] is not None and "Is a directory" in " ".join(result["failed_save"])
    first = result["ranks"][0]["save_id"]
    rank0, rank1 = result["save_ids_after_failure"]
    assert rank1 == first and rank0 not in (None, first)  # rank 0 committed the new save, rank 1 kept the old
    assert result["mixed_tokens"] is None, "a checkpoint mixing two saves was served"
    output = result["_output"].splitlines()
    refusals = [line for line in output if "IntegrityError" in line and "different saves" in line]
    assert refusals, result.get("mixed_error")
    assert f"model-tp0-of-2 by save {rank0}" in refusals[0] and f"model-tp1-of-2 by save {rank1}" in refusals[0]
