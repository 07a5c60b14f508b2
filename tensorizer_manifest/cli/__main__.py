"""``python -m tensorizer_manifest.cli``: the ``tensorizer-manifest`` command, from any Python with the package."""

from __future__ import annotations

from . import main

main()
