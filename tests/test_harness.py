"""The test harness's own promises: a scenario forked from the preloaded server (``helpers.preloaded``) is
the process ``python SCRIPT`` would have been (arguments, environment, directory, stdin, output, exit code),
a different environment is never forked, and a scenario past its time is killed without losing the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, _scenario_env
from helpers.preloaded import Preloaded

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
