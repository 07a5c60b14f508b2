"""The end of a scenario script: its result as JSON on stdout's last line, then the process ended at once."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import NoReturn


def run_scenario(tag: str, main: Callable[[], dict]) -> NoReturn:
    """Run ``main``, print ``TAG {json}`` of what it returns, and leave with ``os._exit(0)``: vLLM leaves threads
    and processes behind that a normal exit would wait for. An exception in ``main`` goes up as it is."""
    result = main()
    print(f"{tag} " + json.dumps(result))
    sys.stdout.flush()
    os._exit(0)
