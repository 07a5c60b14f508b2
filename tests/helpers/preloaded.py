"""Scenario processes that start with torch, transformers and vLLM already imported.

Every end-to-end scenario runs in a process of its own (vLLM keeps process-global state), and each such
process used to spend 10 of its ~25 seconds importing the same libraries. ``Preloaded`` keeps one process
per pytest worker that has imported them once and forks a child per scenario: the child is a process of its
own as before (its own vLLM state, its own exit), it only skips the imports. Measured on the family matrix's
gpt2 kind: 25 s as a fresh process, 11 s as a forked child (the server's imports take 10 s, once). The
imported heap is frozen before the first fork (``freeze_the_imported_heap``): vLLM's collections then skip it.

A child is only forked when it would have seen what a fresh process sees: the request's environment equals
the one the libraries were imported under, apart from the variables nothing reads at import
(``fast_spawn.read_when_used``), so a setting vLLM reads at import time cannot differ. Where an earlier test
left another setting in the worker's environment, the server is started again in the new one (a few times a
session, ``Preloaded.restart_in``); past that, a scenario runs as a fresh process, as before. vLLM's own engine
and worker processes, which it spawns, are forked too where they can be (``helpers.fast_spawn``).

Run as a script, this file is the server: JSON requests on stdin, JSON replies on the pipe it was given.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # the server's script: tests/, not tests/helpers, first on the path, so that
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # ``helpers.fast_spawn`` is one module here too

from helpers.fast_spawn import log as log_fast_spawn  # noqa: E402
from helpers.fast_spawn import read_when_used  # noqa: E402

#: Imported once by the server, before any fork. Importing them must start no thread and read no setting a
#: scenario changes before its own imports (vLLM reads its settings and CPU probes when they are used).
PRELOAD = (
    "torch",
    "transformers",
    "safetensors.torch",
    "tensorizer",
    "vllm",
    "vllm.model_executor.model_loader.base_loader",
    "tensorizer_manifest.save.from_source",
    "tensorizer_manifest.cli.demo",
    "tensorizer_manifest.embedded_models.tiny",
    "tensorizer_manifest.vllm_integration.loaders",
    "tensorizer_manifest.vllm_integration.worker",
    "tensorizer_manifest.vllm_integration.plugin",
)


def _same_environment(a: dict[str, str], b: dict[str, str]) -> bool:
    """Equal in every variable that something may read at import (``fast_spawn.read_when_used``: those that are
    read only when used may differ; a forked child is given its own)."""
    return not differing(a, b)


def differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The variables that keep ``a`` from being forked by a server started in ``b`` (for the log)."""
    return sorted(k for k in a.keys() | b.keys() if not read_when_used(k) and a.get(k) != b.get(k))


class Preloaded:
    """One server per pytest worker, started by the first scenario in that scenario's environment; ``run``
    answers as ``subprocess.run`` does."""

    def __init__(self, root: Path):
        self.root = root
        self.env: dict[str, str] | None = None
        self._server: subprocess.Popen | None = None
        self._replies: int | None = None  # the read end of the reply pipe
        self._pending = b""
        self._restarts = 0
        self.log = Path(tempfile.gettempdir()) / f"preloaded-scenarios-{os.getpid()}-{id(self):x}.log"  # its own

    def _start(self) -> None:
        read_end, write_end = os.pipe()
        with open(self.log, "w") as log:
            self._server = subprocess.Popen(
                [sys.executable, __file__, str(write_end)],
                cwd=self.root,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=log,
                pass_fds=(write_end,),
                text=True,
            )
        os.close(write_end)
        self._replies, self._pending = read_end, b""
        self._reply(timeout=300)  # {"ready": true}

    def _reply(self, timeout: float) -> dict:
        """The server's next line (read from the pipe itself: a buffered reader would hide a line from select)."""
        while b"\n" not in self._pending:
            if not select.select([self._replies], [], [], timeout)[0]:
                raise TimeoutError
            chunk = os.read(self._replies, 65536)
            if not chunk:
                raise RuntimeError(f"the preloaded scenario server exited; its log: {self.log}")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    #: How many times a server may be replaced by one in another environment (``restart_in``).
    RESTARTS = 6

    def can_run(self, env: dict[str, str]) -> bool:
        """Whether the running server (or the next one started) forks a scenario in ``env``."""
        return self.env is None or _same_environment(env, self.env)

    def restart_in(self, env: dict[str, str]) -> bool:
        """Where ``env`` cannot be forked (an earlier test left a setting in the worker's environment, say): the
        server is replaced by one started in ``env``, up to ``RESTARTS`` times a session, and True. Else False:
        the scenario runs as a fresh process."""
        differ = differing(env, self.env or {})
        if self._restarts >= self.RESTARTS:
            log_fast_spawn(f"a scenario runs as a fresh process: its environment differs in {differ}")
            return False
        log_fast_spawn(f"the preloaded server restarts: the next scenario's environment differs in {differ}")
        self.close()
        self.env, self._server, self._restarts = None, None, self._restarts + 1
        return True

    def run(self, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """``argv[0]`` is the script; its output is returned as text, like ``subprocess.run(capture_output=True)``."""
        if self._server is None or self._server.poll() is not None:
            self.env = self.env or dict(env)
            self._start()
        with tempfile.TemporaryDirectory(prefix="scenario-") as out:
            stdout, stderr = Path(out, "stdout"), Path(out, "stderr")
            request = {"argv": argv, "env": env, "cwd": str(self.root), "stdout": str(stdout), "stderr": str(stderr)}
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
            child = self._reply(timeout=60)["pid"]
            try:
                returncode = self._reply(timeout=timeout)["returncode"]
            except TimeoutError:
                os.kill(child, signal.SIGKILL)
                self._reply(timeout=60)
                raise subprocess.TimeoutExpired(argv, timeout, stdout.read_text(), stderr.read_text()) from None
            return subprocess.CompletedProcess(argv, returncode, stdout.read_text(), stderr.read_text())

    def close(self) -> None:
        if self._server is not None and self._server.poll() is None:
            self._server.stdin.close()
            self._server.wait(timeout=60)
            os.close(self._replies)
            self.log.unlink(missing_ok=True)  # kept only where the server died: its imports' error is there


def _child(request: dict) -> None:
    """In the forked child: become the scenario's process (its argv, environment, directory, output), run it
    as ``__main__`` and exit as it would have."""
    import runpy

    streams = ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
               (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC))  # fmt: skip
    for fd, path, flags in streams:  # stdin: not the server's requests
        handle = os.open(path, flags, 0o600)
        os.dup2(handle, fd)
        os.close(handle)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = os.path.abspath(request["argv"][0])
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(script)  # what ``python SCRIPT`` puts first
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)  # a normal exit, atexit handlers and buffers included, as the script's own would be


def freeze_the_imported_heap() -> None:
    """Keep the imported libraries' objects (nearly all of the heap) out of every later collection.

    vLLM runs a full ``gc.collect()`` five times per engine start and twice per shutdown, each walking every
    object torch, transformers and vLLM made at import (and, in a forked child, writing to every page they are
    on). Frozen once, they are skipped: on a tiny Llama an engine's start and shutdown take 0.6 s of CPU instead
    of 4.0 s. vLLM's own ``gc.freeze``/``gc.unfreeze`` (around serving, and in ``cleanup_dist_env_and_memory``)
    become no-ops, so that nothing moves the imports back; what a scenario makes is collected as before. A test
    harness's setting only: the package never touches the collector. A scenario run as a fresh process (another
    environment's Python) calls it itself once it has imported them.
    """
    import atexit
    import gc

    if getattr(gc.freeze, "__name__", "") == "<lambda>":  # frozen already (a forked child calling it again)
        return
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # at exit, as before: the last collection frees them (extensions check for leaks)
    gc.freeze = gc.unfreeze = lambda: None  # type: ignore[assignment]


#: Set to 0 to let vLLM spawn its engine and worker processes as it does (``helpers.fast_spawn``).
FAST_SPAWN_ENV = "TM_FAST_SPAWN"


def _serve(reply_fd: int) -> None:
    import importlib
    import threading

    replies = os.fdopen(reply_fd, "w")
    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    freeze_the_imported_heap()
    if threading.active_count() != 1:  # a thread in the parent would be a lock held forever in a child
        raise RuntimeError(f"preloading started threads: {threading.enumerate()}")
    from helpers import fast_spawn  # as the forkserver names it, so that what is pickled resolves there

    learned = None
    if os.environ.get(FAST_SPAWN_ENV) != "0":
        learned = Path(tempfile.mkdtemp(prefix="fast-spawn-")) / "environment.json"
        fast_spawn.remove_at_exit(str(learned.parent))
        fast_spawn.install(list(PRELOAD), str(learned), import_changes=fast_spawn.imported_changes(before))
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        if learned is not None and learned.exists():  # a scenario's first spawn: serve the next ones forked
            fast_spawn.start_forkserver(str(learned))
            learned = None  # the forkserver reads it when it starts; removed with its directory at exit
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            _child(request)  # never returns: SystemExit ends the child
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
