"""The test harness's own promises: a scenario forked from the preloaded server (``helpers.preloaded``) is
the process ``python SCRIPT`` would have been (arguments, environment, directory, stdin, output, exit code),
a different environment is never forked (vLLM's cache root aside, read only when used), and a scenario past its time
is killed without losing the server. The session's compiler cache (``helpers.cxx_cache``) keys a compile by what it
reads and hands back the library the compiler built. And the
run's summary of hardware gates (``conftest.skip_summary``): each skip counted under the gate its reason names, so
that a machine's run says what it did not prove."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import OTHER_GATE, ROOT, _scenario_env, cpu_flags_line, gate_of, skip_summary
from helpers.preloaded import Preloaded

from tensorizer_manifest import _vllm_compat
from tensorizer_manifest.embedded_models import tiny

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                      "stdin": sys.stdin.read(), "tm": os.environ.get("TM_HARNESS")}))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture(scope="module")
def server():
    preloaded = Preloaded(ROOT)
    yield preloaded
    preloaded.close()


def test_a_forked_scenario_is_the_process_python_would_have_started(server, tmp_path):
    script = tmp_path / "scenario.py"
    script.write_text(SCRIPT)
    env = _scenario_env({"TM_HARNESS": "forked"})
    forked = server.run([str(script), "3", "an argument"], env, timeout=120)
    fresh = subprocess.run([sys.executable, str(script), "3", "an argument"], cwd=ROOT, env=env,
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)  # fmt: skip
    assert (forked.returncode, forked.stderr) == (fresh.returncode, fresh.stderr) == (3, "to stderr\n")
    assert json.loads(forked.stdout) == json.loads(fresh.stdout)
    assert json.loads(forked.stdout)["tm"] == "forked" and json.loads(forked.stdout)["stdin"] == ""


def test_a_different_environment_is_never_forked(server):
    assert server.env is not None  # started by the test above, in its environment
    assert server.can_run(dict(server.env, TM_ANYTHING="1", PYTEST_CURRENT_TEST="another test"))
    assert not server.can_run(dict(server.env, VLLM_CPU_KVCACHE_SPACE="1"))
    assert not server.can_run({k: v for k, v in server.env.items() if k != "HF_HUB_OFFLINE"})
    assert server.can_run(dict(server.env, VLLM_CACHE_ROOT="/another/cache"))  # read when used, never at import


def test_a_server_is_started_again_in_a_new_environment_a_few_times_then_scenarios_run_fresh(tmp_path):
    """An earlier test can leave a setting in the worker's environment: the next scenarios are still forked, by a
    server started in it, up to ``RESTARTS`` times (then fresh processes, never a wrong environment)."""
    script = tmp_path / "scenario.py"
    script.write_text(SCRIPT)
    first = _scenario_env({"TM_HARNESS": "first"})
    second = dict(first, VLLM_CPU_KVCACHE_SPACE="1", TM_HARNESS="second")
    preloaded = Preloaded(ROOT)
    preloaded.RESTARTS = 1
    try:
        assert preloaded.run([str(script), "0"], first, timeout=120).returncode == 0
        assert not preloaded.can_run(second) and preloaded.restart_in(second)
        ran = preloaded.run([str(script), "0"], second, timeout=120)
        assert ran.returncode == 0 and json.loads(ran.stdout)["tm"] == "second"
        assert preloaded.env is not None and preloaded.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
        assert not preloaded.can_run(first) and not preloaded.restart_in(first)  # past RESTARTS: a fresh process
    finally:
        preloaded.close()


def test_a_forked_scenario_sees_its_own_vllm_cache_root(server, tmp_path):
    """The compile-form tests give each engine an empty cache: a forked child must not see the server's."""
    script = tmp_path / "cache_root.py"
    script.write_text("import vllm.envs\nprint(vllm.envs.VLLM_CACHE_ROOT)\n")
    env = _scenario_env({"VLLM_CACHE_ROOT": str(tmp_path / "its-own")})
    assert server.can_run(env)
    forked = server.run([str(script)], env, timeout=120)
    assert forked.returncode == 0, forked.stderr[-2000:]
    assert forked.stdout.strip() == str(tmp_path / "its-own")


def test_a_scenario_past_its_time_is_killed_and_the_server_goes_on(server, tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    env = _scenario_env({})
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        server.run([str(slow)], env, timeout=3)
    assert "started" in expired.value.output
    script = tmp_path / "scenario.py"
    script.write_text(SCRIPT)
    assert server.run([str(script), "0"], env, timeout=120).returncode == 0
    assert os.path.exists(server.log)


SPAWNING = textwrap.dedent(
    """
    import json, multiprocessing, os, sys

    def child(path):
        print("the child's own line", flush=True)
        with open(path, "w") as handle:
            json.dump({"set_at_runtime": os.environ.get("TM_SET_AT_RUNTIME"), "ppid": os.getppid(),
                       "torch_imported_before": "torch" in sys.modules}, handle)
        sys.exit(7)

    if __name__ == "__main__":
        os.environ["TM_SET_AT_RUNTIME"] = "yes"  # as vLLM sets its settings just before it spawns
        seen = []
        for n in range(2):  # the first may start this process's forkserver; the second is forked by one
            path = os.path.join(sys.argv[1], f"child-{n}.json")
            process = multiprocessing.get_context("spawn").Process(target=child, args=(path,), name=f"probe-{n}")
            process.start()
            process.join(timeout=300)
            seen.append({"exitcode": process.exitcode, **json.load(open(path))})
        print("SPAWNED " + json.dumps({"pid": os.getpid(), "children": seen}), flush=True)
    """
)


def _spawned(server: Preloaded, tmp_path, **extra: str) -> tuple[dict, str, list[str]]:
    script = tmp_path / "spawning.py"
    script.write_text(SPAWNING)
    log = tmp_path / "fast_spawn.log"
    env = _scenario_env({"TM_FAST_SPAWN_LOG": str(log), **extra})
    ran = server.run([str(script), str(tmp_path)], env, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    line = next(row for row in ran.stdout.splitlines() if row.startswith("SPAWNED "))
    return json.loads(line.removeprefix("SPAWNED ")), ran.stdout, log.read_text().splitlines() if log.exists() else []


@pytest.mark.skipif(os.environ.get("TM_FAST_SPAWN") == "0", reason="TM_FAST_SPAWN=0: vLLM's spawns stay spawns")
def test_a_spawn_in_a_scenario_is_forked_as_the_process_a_spawn_would_have_been(server, tmp_path):
    """vLLM's engine and worker processes (``helpers.fast_spawn``): forked with torch imported, yet with the
    environment the requester has when it asks (set at runtime included), its output where the requester's
    goes, its exit code seen by the requester."""
    result, stdout, log = _spawned(server, tmp_path)
    assert [child["exitcode"] for child in result["children"]] == [7, 7]
    assert all(child["set_at_runtime"] == "yes" for child in result["children"])
    assert stdout.count("the child's own line") == 2
    assert log and log[-1].endswith("forked probe-1"), log
    assert result["children"][-1]["torch_imported_before"], "the second child imported its libraries itself"
    assert result["children"][-1]["ppid"] != result["pid"]  # the forkserver's child, not the requester's


def test_the_forkserver_forks_only_an_environment_it_serves(monkeypatch):
    """Read at start or import: must equal (else spawned). Read when used, or given by hand: may differ."""
    from helpers import fast_spawn

    launch = {"PATH": "/bin", "LD_PRELOAD": "/lib/libgomp.so.1", "OMP_NUM_THREADS": "2", "VLLM_CACHE_ROOT": "/a"}
    monkeypatch.setattr(fast_spawn, "IMPORT_CHANGES", {"TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"})
    assert fast_spawn.differences(dict(launch), launch) == []
    assert fast_spawn.differences(dict(launch, VLLM_CACHE_ROOT="/b", OMP_NUM_THREADS="1"), launch) == []
    assert fast_spawn.differences(dict(launch, GOMP_CPU_AFFINITY="0 1", TM_X="1"), launch) == []
    assert fast_spawn.differences(dict(launch, TORCHINDUCTOR_CACHE_DIR="/tmp/inductor"), launch) == []
    assert fast_spawn.differences(dict(launch, LD_PRELOAD="/lib/tcmalloc.so"), launch) == ["LD_PRELOAD"]
    assert fast_spawn.differences(dict(launch, OMP_PLACES="{0}"), launch) == ["OMP_PLACES"]
    assert fast_spawn.differences(dict(launch, GOMP_CPU_AFFINITY="0-3:2"), launch) == ["GOMP_CPU_AFFINITY"]
    assert fast_spawn.differences(dict(launch, TORCHINDUCTOR_CACHE_DIR="/elsewhere"), launch) == [
        "TORCHINDUCTOR_CACHE_DIR"
    ]
    monkeypatch.setattr(fast_spawn, "LAUNCH_ENV", None)  # no forkserver started: every spawn stays a spawn
    assert fast_spawn.differences(dict(launch)) == ["(no forkserver)"]


# -- the session's compiler cache ------------------------------------------------------------------------------


def test_the_compiler_cache_keys_a_compile_by_what_it_reads_not_where_it_writes(tmp_path):
    from helpers.cxx_cache import cache_key

    source, header = tmp_path / "a" / "k.cpp", tmp_path / "pch.h"
    source.parent.mkdir()
    source.write_text("int f() { return 1; }\n")
    header.write_text("// header\n")
    args = [str(source), "-O3", "-shared", "-include", str(header), "-o", str(tmp_path / "a" / "k.so")]
    key, output = cache_key(args)
    assert output == str(tmp_path / "a" / "k.so")
    moved = tmp_path / "b" / "k.cpp"  # the same source under another cache directory
    moved.parent.mkdir()
    moved.write_text(source.read_text())
    assert cache_key([str(moved), *args[1:-1], str(tmp_path / "b" / "k.so")])[0] == key
    assert cache_key([*args[:1], "-O2", *args[2:]])[0] != key  # another flag
    header.write_text("// another header\n")
    assert cache_key(args)[0] != key  # another included file
    header.write_text("// header\n")
    source.write_text("int f() { return 2; }\n")
    assert cache_key(args)[0] != key  # another source
    assert cache_key(["-x", "c++-header", str(header), "-o", str(tmp_path / "pch.h.gch")]) is None
    assert cache_key(["--version"]) is None


def test_a_compile_answered_from_the_cache_is_the_library_the_compiler_built(tmp_path, monkeypatch):
    import ctypes
    import shutil

    from helpers import cxx_cache

    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine (inductor needs one too)")
    monkeypatch.setenv("TM_CXX_CACHE_DIR", str(tmp_path / "built"))
    monkeypatch.setattr(cxx_cache, "REAL_COMPILER", shutil.which("g++"))
    (tmp_path / "built").mkdir()
    libraries = []
    for run in ("first", "second"):
        source = tmp_path / run / "k.cpp"
        source.parent.mkdir()
        source.write_text('extern "C" int answer() { return 42; }\n')
        library = tmp_path / run / "k.so"
        assert cxx_cache.main([str(source), "-shared", "-fPIC", "-o", str(library)]) == 0
        assert ctypes.CDLL(str(library)).answer() == 42
        libraries.append(library.read_bytes())
    assert len(list((tmp_path / "built").iterdir())) == 1  # built once, answered once
    assert libraries[0] == libraries[1]


# -- the hardware gates' summary ------------------------------------------------------------------------------


@pytest.fixture
def bare_cpu(monkeypatch):
    """A CPU with neither AMX nor AVX-512 (AVX2 only): every kind that needs one is refused."""
    monkeypatch.setattr(_vllm_compat, "has_amx", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)


def test_the_package_reasons_for_a_cpu_name_their_gate(bare_cpu):
    """The reasons the tests skip kinds with (``kind_param``, ``needs_amx``...) are ``tiny``'s own."""
    assert gate_of(tiny.why_this_cpu_cannot_run("fp8-block")) == "needs AMX"
    assert gate_of(tiny.why_this_cpu_cannot_run("qwen3-moe-w8a8")) == "needs AMX"
    assert gate_of(tiny.why_this_cpu_cannot_run("gptq-w4")) == "needs AVX-512"
    assert gate_of(tiny.why_this_cpu_cannot_run("kv-fp8")) == "needs AVX-512 or AMX"
    assert tiny.why_this_cpu_cannot_run("llama") is None


def test_the_end_to_end_modules_reasons_name_their_gate():
    """As the end-to-end modules word their own skips (``skipif`` on the AMX probe, a skip on a measure)."""
    assert gate_of("a CPU without AMX cannot run the AMX ones it would pick with the probe flipped") == "needs AMX"
    assert gate_of("this CPU has AMX: vLLM packs small linear weights with its SGL kernel") == "needs no AMX"
    assert gate_of("vLLM's own reload_weights fails on an MLA engine on AMX: boom") == "needs no AMX"
    assert gate_of("the 1.3 x target is checked where vLLM holds one copy of each weight (AVX2)") == "AVX2 only"
    assert gate_of("could not import 'vllm': No module named 'vllm'") == OTHER_GATE
    assert gate_of("the package registry cannot be reached here") == OTHER_GATE


def test_one_line_per_gate_with_its_count_and_its_tests_in_a_stable_order(bare_cpu):
    amx, wna16 = tiny.why_this_cpu_cannot_run("fp8-block"), tiny.why_this_cpu_cannot_run("gptq-w4")
    skips = [
        ("tests/e2e/test_e2e_families.py::test_kind[qwen3-moe-fp8]", amx),
        ("tests/cli/test_verify_kernels.py::test_records", wna16),
        ("tests/e2e/test_e2e_families.py::test_kind[fp8-block]", amx),
        ("tests/e2e/test_e2e_upgrade.py::test_upgrade", "the package registry cannot be reached here"),
        ("tests/e2e/test_e2e_vllm.py::test_amx_only", "a CPU without AMX cannot run the AMX ones"),
        ("tests/load/test_replay.py", "could not import 'vllm'"),  # a whole module, skipped at collection
    ]
    assert skip_summary(skips) == [
        "needs AMX: 3 skipped: test_e2e_families::test_kind[fp8-block,qwen3-moe-fp8], test_e2e_vllm::test_amx_only",
        "needs AVX-512: 1 skipped: test_verify_kernels::test_records",
        "other: 2 skipped: test_e2e_upgrade::test_upgrade, test_replay",
    ]
    assert skip_summary([]) == []


def test_the_cpu_flags_line_says_each_flag_of_interest():
    cpuinfo = textwrap.dedent(
        """\
        processor\t: 0
        flags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile
        processor\t: 1
        flags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile
        """
    )
    assert cpu_flags_line(cpuinfo) == "CPU flags: amx_tile=yes avx512f=yes avx512_bf16=no avx2=yes"
    assert cpu_flags_line("processor: 0\n") == "CPU flags: amx_tile=no avx512f=no avx512_bf16=no avx2=no"
