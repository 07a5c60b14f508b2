"""docs/supported-models.md is what scripts/supported_models.py generates, and has a row for every kind."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tensorizer_manifest.embedded_models.tiny import TINY_KINDS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("supported_models", ROOT / "scripts" / "supported_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_published_table_is_what_the_script_renders(script):
    """Regenerate with `scripts/supported_models.py run` (or `render` after editing nothing but the JSON)."""
    table = json.loads(script.JSON_PATH.read_text())
    assert script.MARKDOWN_PATH.read_text() == script.render(table)


def test_every_kind_has_a_row_with_a_known_status(script):
    rows = json.loads(script.JSON_PATH.read_text())["rows"]
    assert list(rows) == [*TINY_KINDS, *script.LAYOUTS], "run scripts/supported_models.py run to add the new kinds"
    statuses = {script.STATUS_EXACT, script.STATUS_STATE_EXACT, script.STATUS_FAILED, script.STATUS_NOT_RUNNABLE,
                script.STATUS_NOT_RUN}  # fmt: skip
    assert {r["status"] for r in rows.values()} <= statuses
    for kind, r in rows.items():
        if r["status"] == script.STATUS_EXACT:
            assert r["machine"] and r["vllm"] and r["commit"], kind


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_e2e_families" name="test_tokens_match_default_loader[llama]"/>
<testcase classname="tests.test_e2e_families" name="test_processed_tensors_bitwise_equal_to_default_engine[llama]"/>
<testcase classname="tests.test_e2e_families" name="test_tokens_match_default_loader[opt]">
<failure message="AssertionError: assert [[1]] == [[2]]&#10;more">trace</failure></testcase>
<testcase classname="tests.test_e2e_pipeline_parallel" name="test_pp2_saves_one_checkpoint_per_stage"/>
<testcase classname="tests.test_e2e_families" name="test_tokens_match_default_loader[gptq-w4]">
<skipped type="pytest.skip" message="vLLM's CPU 4-bit kernel is only in the AVX-512 build">skip</skipped></testcase>
</testsuite></testsuites>"""


def test_status_comes_from_every_test_of_the_kind_and_a_skip_keeps_an_earlier_row(script, tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    tests = script.outcomes(junit)
    rows = {kind: script.row(kind, results, None, "abc1234") for kind, results in tests.items()}
    assert rows["llama"]["status"] == script.STATUS_EXACT
    assert (rows["llama@PP2"]["status"], rows["llama@PP2"]["layout"]) == (script.STATUS_STATE_EXACT, "TP1 PP2")
    assert (rows["opt"]["status"], rows["opt"]["reason"]) == (
        script.STATUS_FAILED,
        "AssertionError: assert [[1]] == [[2]]",
    )
    assert rows["gptq-w4"]["status"] == script.STATUS_NOT_RUNNABLE and "AVX-512" in rows["gptq-w4"]["reason"]
    earlier = {"rows": {"gptq-w4": {"kind": "gptq-w4", "status": script.STATUS_EXACT, "machine": "AVX512 AMX"}}}
    table = script.merged(earlier, rows, ["llama", "gptq-w4", "opt", "mistral"])
    assert table["rows"]["gptq-w4"] == earlier["rows"]["gptq-w4"]  # shown on another machine: kept
    assert table["rows"]["opt"]["status"] == script.STATUS_FAILED  # a failure here always replaces
    assert table["rows"]["mistral"]["status"] == script.STATUS_NOT_RUN
    assert "| `opt` |" in script.render(table) and "not run yet" in script.render(table)
    skipped_before = {"rows": {"gptq-w4": {"kind": "gptq-w4", "status": script.STATUS_NOT_RUNNABLE, "reason": "old"}}}
    assert script.merged(skipped_before, rows, ["gptq-w4"])["rows"]["gptq-w4"] == rows["gptq-w4"]  # newer reason
