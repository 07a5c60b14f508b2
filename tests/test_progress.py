"""Progress: cumulative updates for a callback, and rich's bar only where a person watches a terminal."""

from __future__ import annotations

import io
import subprocess
import sys

from helpers.synthetic import write_synthetic_checkpoint
from helpers.terminal import in_terminal

from tensorizer_manifest import progress
from tensorizer_manifest.progress import ProgressCounter, ProgressUpdate, terminal_progress


def test_the_counter_hands_cumulative_counts_and_totals_to_the_callback():
    seen: list[ProgressUpdate] = []
    counter = ProgressCounter(seen.append, total_tensors=3, total_bytes=60)
    for n in (10, 20, 30):
        counter.advance(n)
    assert seen == [ProgressUpdate(1, 10, 3, 60), ProgressUpdate(2, 30, 3, 60), ProgressUpdate(3, 60, 3, 60)]
    ProgressCounter(None, 1, 1).advance(1)  # no callback: nothing to call


def test_no_bar_unless_enabled_and_both_streams_are_terminals(monkeypatch):
    monkeypatch.setattr(progress, "interactive", lambda: False)
    with terminal_progress("x") as callback:
        assert callback is None
    monkeypatch.setattr(progress, "interactive", lambda: True)
    with terminal_progress("x", enabled=False) as callback:
        assert callback is None


def test_interactive_is_false_under_pytest_capture():
    assert progress.interactive() is False


def test_the_bar_shows_bytes_tensors_and_rate():
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    with terminal_progress("hashing", console=console) as callback:
        assert callback is not None
        callback(ProgressUpdate(1, 1000, 2, 3000))
        callback(ProgressUpdate(2, 3000, 2, 3000))
    text = out.getvalue()
    assert "hashing" in text and "2/2 tensors" in text and "3.0/3.0 kB" in text, text


def _validate(directory, *extra):
    return [sys.executable, "-m", "tensorizer_manifest.cli", "validate", str(directory), *extra]


def test_validate_draws_a_bar_on_a_terminal_and_nothing_when_piped_or_json(tmp_path):
    directory = write_synthetic_checkpoint(tmp_path / "ckpt")
    piped = subprocess.run(_validate(directory), capture_output=True, text=True)
    assert piped.returncode == 0, piped.stderr
    assert "tensors" not in piped.stdout.replace("tensor records", "") and piped.stderr == "", piped
    assert "━" not in piped.stdout + piped.stderr

    def on_a_terminal(*extra: str) -> str:
        shown = in_terminal(_validate(directory, *extra), timeout=120)
        assert shown.returncode == 0, shown.output
        return shown.output

    shown = on_a_terminal()
    assert "hashing" in shown and "5/5 tensors" in shown and "valid" in shown, shown
    quiet = on_a_terminal("--json")
    assert "hashing" not in quiet and "/5 tensors" not in quiet and '"ok": true' in quiet, quiet
