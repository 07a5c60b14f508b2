"""Named pauses for deterministic race tests: a process stops at a named step until the test releases it.

``TENSORIZER_MANIFEST_PAUSE_AT=STEP[,STEP...]:DIRECTORY`` makes ``pause(STEP, who)`` create
``DIRECTORY/STEP.<who>.reached`` and wait until ``DIRECTORY/STEP.release`` exists (at most ``PAUSE_LIMIT_S``,
then it goes on and says so on stderr). Unset, ``pause`` is one dictionary lookup. The steps: ``before-agreement``
(a loader's first rank, the pointer read, before it broadcasts it to the other ranks and replicas),
``after-agreement`` (a loader's rank, once its engine's ranks agreed on a generation, before it reads its
manifest), ``before-commit`` (a writer, its files written, before it swaps the pointer) and ``gc-after-pointer``
(``gc``, the pointer read, before it lists the files). Tests only: never set it in
production. Imports nothing of the package.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

PAUSE_ENV = "TENSORIZER_MANIFEST_PAUSE_AT"
#: A paused process goes on after this long, so that a test that never releases it cannot hang CI.
PAUSE_LIMIT_S = 300.0


def pause(step: str, who: str) -> None:
    """Wait here while a test holds ``step`` (see the module's docstring)."""
    setting = os.environ.get(PAUSE_ENV)
    if not setting:
        return
    steps, _, directory = setting.partition(":")
    if step not in steps.split(",") or not directory:
        return
    gate = Path(directory)
    (gate / f"{step}.{who}.reached").touch()
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while not (gate / f"{step}.release").exists():
        if time.monotonic() > deadline:
            print(f"{PAUSE_ENV}: {step} was not released within {PAUSE_LIMIT_S:.0f} s; going on", file=sys.stderr)
            return
        time.sleep(0.02)
