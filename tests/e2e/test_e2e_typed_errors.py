"""Typed errors from vLLM's own processes. With vLLM's default multiprocessing the loaders and the worker
methods run in the engine core's process and its workers'; what they raise reaches the caller of ``LLM()`` as that
error, chained to vLLM's, and the installed CLI says it in one line, with its exit code: never only vLLM's "Engine
core initialization failed"."""

from __future__ import annotations

import pytest
from conftest import run_script
from helpers.terminal import typed

pytestmark = pytest.mark.e2e


def test_llm_raises_the_loaders_typed_error_from_the_engines_process(scenarios, tmp_path):
    checkpoint = scenarios.e2e("llama")["checkpoint"]
    result = run_script("scenarios/typed_errors.py", checkpoint, str(tmp_path), marker="TYPED_RESULT")
    assert result["tokens"] is None, "a damaged checkpoint was served"
    assert result["raised"] == "tensorizer_manifest.errors.IntegrityError", result
    assert result["cause"] == "RuntimeError", result  # vLLM's own, chained
    assert "damaged" in result["message"] and "re-save" in result["message"], result["message"]


def test_a_save_refused_in_the_engines_worker_is_one_typed_line_and_exit_2_on_a_terminal(scenarios, tmp_path):
    """The capture loader refuses in the worker's process (vLLM's engine core in a process of its own, as the CLI
    runs it where VLLM_ENABLE_V1_MULTIPROCESSING=1, and its multiprocessing executor: a process under the core's,
    at TP=1 too): the CLI's last word is the ConfigurationError's, after vLLM's own report of its worker, and
    nothing is written."""
    out = tmp_path / "out"
    shown = typed(
        "save", scenarios.e2e("llama")["model_dir"], str(out), "--engine-arg", 'hf_overrides={"tm_marker": 1}',
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )  # fmt: skip
    assert shown.returncode == 2, shown.output[-4000:]
    lines = [line for line in shown.output.splitlines() if line.strip()]
    said = max(i for i, line in enumerate(lines) if line.startswith("error: "))
    vllms = max(i for i, line in enumerate(lines) if "initialization failed" in line)
    assert said > vllms, lines[vllms:]  # ours comes last: after vLLM's error and its traceback
    assert "hf_overrides" in shown.flat and "save with vLLM's default for it" in shown.flat, lines[said]
    assert not (out / "tensorizer-manifest.json").exists()
