"""Safe local writes: create-only never replaces, an atomic replace is whole, the lock is refused by name where
the file system cannot lock, and two processes never hold it at once."""

from __future__ import annotations

import errno
import multiprocessing
import os
import time

import pytest

from tensorizer_manifest.errors import ConcurrentWriteError, ConfigurationError
from tensorizer_manifest.storage import files


def test_create_only_never_replaces_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "a.bin"
    assert files.create_only(target, b"first")
    assert not files.create_only(target, b"second")
    assert target.read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_replace_atomically_swaps_the_whole_file(tmp_path):
    target = tmp_path / "p.json"
    files.replace_atomically(target, b"old")
    files.replace_atomically(target, b"new" * 1000)
    assert target.read_bytes() == b"new" * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_temporaries_name_their_host_process_and_thread():
    import threading

    name = files.temporary_name("model.manifest.json")
    _, host, owner, suffix = name.rsplit(".", 3)
    assert name.startswith(".model.manifest.json.") and suffix == "tmp"
    assert host == files.this_host() and owner == f"{os.getpid()}-{threading.get_ident()}"


def test_a_file_system_that_cannot_lock_is_refused_by_name(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(files.fcntl, "flock", no_locks)
    with pytest.raises(ConfigurationError, match="cannot lock files") as refused:
        with files.exclusive_lock(tmp_path / ".lock", "the checkpoint"):
            pytest.fail("the lock must not be taken")
    assert str(tmp_path) in str(refused.value)


def _hold(lock_path, held, release):
    with files.exclusive_lock(lock_path, "x"):
        held.set()
        release.wait(30)


def test_a_second_process_waits_then_gives_up_while_the_first_holds_it(tmp_path, monkeypatch):
    lock_path = tmp_path / ".lock"
    context = multiprocessing.get_context("fork")
    held, release = context.Event(), context.Event()
    holder = context.Process(target=_hold, args=(lock_path, held, release))
    holder.start()
    try:
        assert held.wait(30)
        monkeypatch.setattr(files, "LOCK_TIMEOUT_S", 0.3)
        started = time.monotonic()
        with pytest.raises(ConcurrentWriteError, match="held its lock"):
            with files.exclusive_lock(lock_path, "the checkpoint"):
                pytest.fail("two holders at once")
        assert time.monotonic() - started >= 0.3
    finally:
        release.set()
        holder.join(30)
    with files.exclusive_lock(lock_path, "the checkpoint"):  # released with its holder
        pass


def test_a_holder_killed_with_sigkill_releases_the_lock(tmp_path):
    lock_path = tmp_path / ".lock"
    context = multiprocessing.get_context("fork")
    held, release = context.Event(), context.Event()
    holder = context.Process(target=_hold, args=(lock_path, held, release))
    holder.start()
    assert held.wait(30)
    holder.kill()
    holder.join(30)
    with files.exclusive_lock(lock_path, "the checkpoint"):
        pass
