"""Many nodes: vLLM's own multi-node launcher, tensor-parallel over two nodes on this
machine, each rank loading its own manifest and tensor file from one S3 bucket (moto on 127.0.0.1),
token-exact against vLLM's default loader on the same layout. The scenario starts and stops every process
it needs, within a bounded time."""

from __future__ import annotations

import re

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def result(e2e_dir):
    return run_script("scenarios/multi_node.py", str(e2e_dir), marker="MULTINODE_RESULT", timeout=1500)


def test_two_nodes_load_one_tensor_parallel_checkpoint_from_s3_token_exact(result):
    reference, ours = result["reference"], result["manifest"]
    assert "tokens" in reference, reference
    assert "tokens" in ours, ours
    assert len(reference["tokens"]) >= 3 and all(len(t) == 16 for t in reference["tokens"])
    assert ours["tokens"] == reference["tokens"]
    assert reference["loads"] == {"0": [], "1": []}  # the reference is vLLM's default loader


def test_each_node_reads_only_its_own_rank_from_the_bucket(result):
    uri = result["uri"]
    loads = result["manifest"]["loads"]
    (generation,) = {load["manifest"].removeprefix(f"{uri}/").rpartition("/")[0] for r in "01" for load in loads[r]}
    assert re.fullmatch(r"generations/[0-9TZ]+-[0-9a-f]{32}", generation)  # both ranks: one generation
    assert [load["manifest"] for load in loads["0"]] == [f"{uri}/{generation}/model-tp0-of-2.manifest.json"]
    assert [load["manifest"] for load in loads["1"]] == [f"{uri}/{generation}/model-tp1-of-2.manifest.json"]
    assert all(float(load["mb"]) > 0 for rank in ("0", "1") for load in loads[rank])
    assert sorted(n for n in result["saved"] if n.endswith(".manifest.json")) == [
        "model-tp0-of-2.manifest.json",
        "model-tp1-of-2.manifest.json",
    ]


def test_no_process_is_left_running_and_no_credential_is_shown(result):
    assert result["reference"]["left_running"] == []
    assert result["manifest"]["left_running"] == []
    assert result["secret_in_logs"] is False
    assert result["secret_in_command"] is False
