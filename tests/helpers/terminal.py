"""The installed ``tensorizer-manifest`` script as a person runs it: on a terminal (a real pseudo-terminal, so rich
draws its bars and the commands print their summaries for people) or piped."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

#: The console script pip installed beside this interpreter (``.venv/bin/tensorizer-manifest``).
INSTALLED = Path(sys.executable).with_name("tensorizer-manifest")

_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


@dataclass(frozen=True)
class Typed:
    """What a command run on a terminal left: its exit code and the screen's text (escapes taken out)."""

    returncode: int
    output: str

    @property
    def flat(self) -> str:
        """The text with every run of whitespace one space: what was said, wherever the terminal wrapped it."""
        return " ".join(self.output.split())

    @property
    def last_line(self) -> str:
        lines = [line for line in self.output.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def in_terminal(argv: list[str], env: dict[str, str | None] | None = None, timeout: float = 1200) -> Typed:
    """Run ``argv`` with stdin, stdout and stderr on one pseudo-terminal of 200 columns, as typed into one.
    ``env`` adds variables to this environment; a None value takes one out."""
    import pty

    leader, follower = pty.openpty()
    merged = {**os.environ, "COLUMNS": "200", "TERM": "xterm", **(env or {})}
    environ = {name: value for name, value in merged.items() if value is not None}
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=environ)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        else:
            proc.kill()
            raise AssertionError(f"{' '.join(argv)} ran past {timeout} s on a terminal")
        returncode = proc.wait(timeout=60)
    finally:
        os.close(leader)
    return Typed(returncode, _ESCAPES.sub("", b"".join(chunks).decode(errors="replace")))


def typed(*args: str, env: dict[str, str | None] | None = None, timeout: float = 1200) -> Typed:
    """``tensorizer-manifest ARGS...`` (the installed script) on a terminal."""
    return in_terminal([str(INSTALLED), *args], env=env, timeout=timeout)


def piped(*args: str, env: dict[str, str] | None = None, timeout: float = 1200) -> subprocess.CompletedProcess:
    """``tensorizer-manifest ARGS...`` (the installed script) with its output piped, as in a script or a log."""
    return subprocess.run(
        [str(INSTALLED), *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
