"""Data-parallel replicas started apart (vLLM's offline SPMD mode) agree on one generation, or refuse together:
the first replica's first rank reads the pointer for every replica, and replicas that each pinned another
generation (a commit between their starts) refuse before a byte of weights is read."""

from __future__ import annotations

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def result(scenarios, e2e_dir):
    checkpoint = scenarios.e2e("qwen3-moe")["checkpoint"]
    return run_script(
        "scenarios/data_parallel.py", checkpoint, str(e2e_dir), marker="DATA_PARALLEL_RESULT", timeout=900
    )


def test_replicas_load_the_generation_the_first_replica_read_while_a_commit_lands(result):
    agreed = result["agreement"]
    assert agreed["paused"], [r["tail"] for r in agreed["replicas"]]
    assert agreed["b"] != agreed["a"]
    for replica in agreed["replicas"]:
        assert replica["loaded"] == [agreed["a"]], replica["tail"]
        # what ends them is vLLM's own data-parallel MoE forward on CPU, after the load (its default loader too)
        assert replica["up"] or replica["vllm_forward_unsupported"], replica["tail"]


def test_replicas_that_pinned_two_generations_refuse_before_reading_weights(result):
    refused = result["refusal"]
    assert refused["pinned_first"], refused["replicas"][0]["tail"]
    for replica in refused["replicas"]:
        assert replica["refused"], replica["tail"]
        assert replica["loaded"] == [] and not replica["up"] and replica["exit"] != 0, replica["tail"]
    second = refused["replicas"][1]["refused"]
    assert any(f"this rank was given {refused['committed_between']}" in line for line in second), second
    assert all("tensorizer_manifest.errors.ConcurrentWriteError: " in line for line in second), second
