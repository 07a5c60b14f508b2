"""Progress of long reads and writes: the callback the library calls, and the terminal bar the CLI gives it.

The library draws nothing: ``write_checkpoint``, ``restore_tensors`` and
``validate_checkpoint`` take an optional ``ProgressCallback`` and call it after
each tensor with cumulative counts. ``terminal_progress`` makes one that draws
rich's bar (bytes, tensors, rate) on stderr, and only when both stdout and
stderr are terminals: piped output, logs and ``--json`` stay free of it.
No torch, no vLLM; rich is imported only when a bar is drawn.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProgressUpdate:
    """Where a read or write stands: tensors and bytes done, of how many."""

    tensors: int
    nbytes: int
    total_tensors: int
    total_bytes: int


ProgressCallback = Callable[[ProgressUpdate], None]


class ProgressCounter:
    """Turns one call per tensor into cumulative ``ProgressUpdate``s for a callback (None: does nothing)."""

    def __init__(self, callback: ProgressCallback | None, total_tensors: int, total_bytes: int):
        self._callback = callback
        self.tensors = 0
        self.nbytes = 0
        self.total_tensors = total_tensors
        self.total_bytes = total_bytes

    def advance(self, nbytes: int) -> None:
        self.tensors += 1
        self.nbytes += nbytes
        if self._callback is not None:
            self._callback(ProgressUpdate(self.tensors, self.nbytes, self.total_tensors, self.total_bytes))


def interactive() -> bool:
    """Both stdout and stderr are terminals (a person is watching, and nothing is being logged)."""
    try:
        return sys.stdout.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


#: Redraws per second at most: a bar must not cost the load it shows.
_REFRESH_PER_SECOND = 8


@contextmanager
def terminal_progress(description: str, enabled: bool = True, console: Any = None) -> Iterator[ProgressCallback | None]:
    """A callback drawing rich's progress bar on stderr while the block runs; None unless ``enabled`` on a terminal.

    ``console`` (a rich ``Console``) replaces the check for a terminal: tests draw into a string.
    """
    if not enabled or (console is None and not interactive()):
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = console if console is not None else Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[tensors]}"),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, auto_refresh=False) as bar:
        task = bar.add_task(description, total=None, tensors="")
        last = 0.0

        def update(u: ProgressUpdate) -> None:
            nonlocal last
            bar.update(task, completed=u.nbytes, total=u.total_bytes, tensors=f"{u.tensors}/{u.total_tensors} tensors")
            now = time.monotonic()
            if now - last >= 1 / _REFRESH_PER_SECOND or u.tensors == u.total_tensors:
                last = now
                bar.refresh()

        yield update
