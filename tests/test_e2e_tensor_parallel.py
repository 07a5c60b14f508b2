"""Tensor parallelism: one manifest and tensor file per rank, each holding that rank's shard."""

from __future__ import annotations

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e


def test_tp2_save_and_load_token_exact(e2e_dir):
    result = run_script("scenarios/tensor_parallel.py", str(e2e_dir), marker="TP_RESULT", timeout=1200)
    assert result["tokens"] == result["reference"]
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert all(r["size"] == 2 for r in result["ranks"])
    assert result["ranks"][0]["digest"] != result["ranks"][1]["digest"], "both ranks saved the same shard"
    assert len(result["saved"]) == 2
