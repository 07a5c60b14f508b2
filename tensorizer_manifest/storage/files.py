"""Local files written safely: the writers' lock, temporaries named by their owner, create-only and atomic
replacement, each made durable (``fsync`` of the file, then of its directory).

One copy of each of these for every writer (``save.write``'s manifests, ``generations``' pointer and files). No
torch, no vLLM.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConcurrentWriteError, ConfigurationError

#: How long a writer waits for another writer's commit (a compare and a rename: milliseconds) before it gives up
#: with ``ConcurrentWriteError``.
LOCK_TIMEOUT_S = 60.0


@contextmanager
def exclusive_lock(lock_path: Path, subject: object) -> Iterator[None]:
    """Writers of one checkpoint take turns: an exclusive ``flock`` on ``lock_path`` (a file that stays), released
    by the kernel when its holder dies, even by ``kill -9``. ``subject`` names what the lock guards in errors.

    Across hosts on a shared file system it serialises them as far as that file system's locks do (NFSv4's do).
    A file system that cannot lock is refused by name (``ConfigurationError``): a lock that only looks held (a
    lock file made with ``O_EXCL``, filelock's soft fallback) would outlive a writer killed with ``-9`` and block
    every later one, or let two in at once."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ConcurrentWriteError(
                        f"{subject}: another writer has held its lock for over {LOCK_TIMEOUT_S:.0f} s; nothing "
                        "was committed: re-run when it is done"
                    ) from None
                time.sleep(0.01)
            except OSError as exc:
                raise ConfigurationError(
                    f"{lock_path.parent}: this file system cannot lock files ({exc.strerror or type(exc).__name__} "
                    f"on {lock_path.name}), and writers of a checkpoint take turns under a lock; nothing was "
                    "committed. Write the checkpoint on a local disk or a file system with locks (NFSv4 has them), "
                    "then copy it, or upload it to S3"
                ) from None
        yield
    finally:
        os.close(fd)  # releases the lock


def this_host() -> str:
    """This host's name as a temporary's name carries it (no dots, so that the name splits back)."""
    return socket.gethostname().replace(".", "_") or "localhost"


def temporary_name(name: str) -> str:
    """``.<name>.<host>.<pid>-<thread>.tmp``: whose it is, so that cleaning up never touches another host's file,
    and two threads of one process writing one name never share a temporary."""
    return f".{name}.{this_host()}.{os.getpid()}-{threading.get_ident()}.tmp"


def remove_dead_temporaries(directory: Path, pattern: str = ".*.tmp") -> None:
    """Hidden temporaries (``temporary_name``) in ``directory`` of this host's writers that were killed (their
    process is gone). Another host's are never touched: a process id means nothing here (a shared file system)."""
    for tmp in directory.glob(pattern):
        parts = tmp.name.rsplit(".", 3)
        if len(parts) != 4:
            continue
        host, pid = parts[1], parts[2].split("-")[0]
        if host != this_host() or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except PermissionError:  # alive, another user's
            pass


def make_folder(path: Path) -> None:
    """``path`` and its missing parents, each new entry made durable (``fsync`` of the directory holding it): a
    folder a commit names survives a crash as its files do."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
        fsync_dir(folder.parent)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temporary(target: Path, data: bytes) -> Path:
    tmp = target.parent / temporary_name(target.name)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def create_only(target: Path, data: bytes) -> bool:
    """Create ``target`` with ``data`` whole and durable, only if no file has that name (a hard link of a
    temporary, which fails where the name exists; a rename would replace it silently). False: it existed."""
    tmp = _write_temporary(target, data)
    try:
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        fsync_dir(target.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def replace_atomically(target: Path, data: bytes) -> None:
    """Replace ``target`` with ``data`` in one rename: a reader sees the old bytes or the new, never a part."""
    tmp = _write_temporary(target, data)
    try:
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)
