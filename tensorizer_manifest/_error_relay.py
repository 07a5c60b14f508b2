"""Typed errors across vLLM's processes.

vLLM runs the loaders and the worker methods in processes of its own (the engine core, a worker per rank). An
error raised there reaches the process that started the engine as text (``Call to collective_rpc method failed:
...``) or not at all (``Engine core initialization failed. See root cause above``): its type is lost, and with it
the CLI's exit code and a caller's ``except ConfigurationError``. So the starting process names a relay directory
in its environment before the engine starts (every process vLLM starts inherits it, ``open_relay``), each
entry point that runs in vLLM's processes records a ``TensorizerManifestError`` it raises there (``relaying``:
its class name and message, as JSON; no pickle), and the starting process raises the first one recorded during
the call, typed again, in place of vLLM's error (``errors_typed``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

from . import errors
from .errors import TensorizerManifestError

#: The relay directory of the process that started the engine; inherited by every process vLLM starts.
RELAY_ENV = "TENSORIZER_MANIFEST_ERROR_RELAY"

_OWN: str | None = None
"""The relay this process made (removed when it exits); one named by a parent process is not reused."""
_OPENED_NS = 0
"""When ``open_relay`` was last called here: the start of the latest engine this process started."""

F = TypeVar("F", bound=Callable[..., Any])


def open_relay() -> Path:
    """In a process about to start an engine: its relay directory, named in the environment for the processes
    vLLM starts. One per process, made on first use and removed at exit."""
    global _OWN, _OPENED_NS
    _OPENED_NS = time.time_ns()
    if _OWN is None or not Path(_OWN).is_dir():
        _OWN = tempfile.mkdtemp(prefix="tensorizer-manifest-errors-")
        atexit.register(_remove, _OWN, os.getpid())
    os.environ[RELAY_ENV] = _OWN
    return Path(_OWN)


def _remove(relay: str, owner: int) -> None:
    """At exit, by the process that made it only (a forked child inherits the registration)."""
    if os.getpid() == owner:
        shutil.rmtree(relay, ignore_errors=True)


def record(exc: TensorizerManifestError) -> None:
    """Note ``exc`` in the relay of the process that started this engine, if it opened one. Best effort: the
    error is raised (and logged by vLLM) here either way."""
    relay = os.environ.get(RELAY_ENV)
    if not relay:
        return
    stamp = time.time_ns()
    entry = {"type": type(exc).__name__, "message": str(exc), "pid": os.getpid(), "time_ns": stamp}
    name = f"{stamp:020d}-{os.getpid()}"
    with contextlib.suppress(OSError):
        temporary = Path(relay, f".{name}.tmp")
        temporary.write_text(json.dumps(entry))
        temporary.rename(Path(relay, f"{name}.json"))  # readers see whole entries only


def relaying(fn: F) -> F:
    """Decorates an entry point that vLLM runs in its own processes (a loader's ``load_model``, a worker
    method): a ``TensorizerManifestError`` it raises is recorded in the relay, then raised as before."""

    @functools.wraps(fn)
    def relayed(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TensorizerManifestError as exc:
            record(exc)
            raise

    return cast(F, relayed)


def _typed(entry: dict[str, Any]) -> TensorizerManifestError:
    """The error an entry records, as its class in ``errors`` (the base class for a name it does not have)."""
    cls = getattr(errors, str(entry.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, TensorizerManifestError)):
        cls = TensorizerManifestError
    return cls(str(entry.get("message", "")))


def relayed_error(since_ns: int | None = None) -> TensorizerManifestError | None:
    """The first error recorded in this process's relay at or after ``since_ns`` (``time.time_ns()``; by default
    since the latest engine started), typed again; None where there is none (or no relay). The first, since a
    rank's failure makes others fail after it."""
    since_ns = _OPENED_NS if since_ns is None else since_ns
    relay = os.environ.get(RELAY_ENV)
    if not relay or not Path(relay).is_dir():
        return None
    for path in sorted(Path(relay).glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            entry = json.loads(path.read_text())
            if int(entry.get("time_ns", 0)) >= since_ns:
                return _typed(entry)
    return None


@contextlib.contextmanager
def errors_typed() -> Iterator[None]:
    """Around a call into an engine from the process that started it (the start, ``collective_rpc``): vLLM's
    error is replaced by the first typed one its processes recorded meanwhile, chained to it."""
    since = time.time_ns()
    try:
        yield
    except TensorizerManifestError:
        raise
    except Exception as exc:
        found = relayed_error(since)
        if found is None:
            raise
        raise found from exc
