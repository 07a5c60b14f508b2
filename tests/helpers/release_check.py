"""``scripts/vllm_release_check.py`` as a module, for the tests that use its reader of vLLM's sources (the script is
no package's: it is loaded from its file, once)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_release_check.py"


@functools.cache
def load_release_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_release_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module
