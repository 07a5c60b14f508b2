"""The named pauses race tests use: a process waits at its step until released, and only at its step."""

from __future__ import annotations

import threading
import time

from tensorizer_manifest import _failpoints


def test_a_paused_step_waits_for_its_release_and_says_it_arrived(tmp_path, monkeypatch):
    monkeypatch.setenv(_failpoints.PAUSE_ENV, f"before-commit,after-agreement:{tmp_path}")
    done = threading.Event()
    worker = threading.Thread(target=lambda: (_failpoints.pause("before-commit", "w1"), done.set()))
    worker.start()
    deadline = time.monotonic() + 10
    while not (tmp_path / "before-commit.w1.reached").exists():
        assert time.monotonic() < deadline, "never reached"
        time.sleep(0.01)
    time.sleep(0.1)
    assert not done.is_set(), "went on without its release"
    (tmp_path / "before-commit.release").touch()
    worker.join(10)
    assert done.is_set()


def test_other_steps_and_an_unset_variable_do_not_pause(tmp_path, monkeypatch):
    _failpoints.pause("before-commit", "w")  # unset: returns at once
    monkeypatch.setenv(_failpoints.PAUSE_ENV, f"after-agreement:{tmp_path}")
    started = time.monotonic()
    _failpoints.pause("before-commit", "w")
    assert time.monotonic() - started < 1
    assert list(tmp_path.iterdir()) == []


def test_an_unreleased_pause_goes_on_after_its_limit(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(_failpoints.PAUSE_ENV, f"before-commit:{tmp_path}")
    monkeypatch.setattr(_failpoints, "PAUSE_LIMIT_S", 0.2)
    _failpoints.pause("before-commit", "w")
    assert "was not released" in capsys.readouterr().err
