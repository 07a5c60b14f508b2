"""What a user of this package can name, in one JSON document: the snapshot that moves of modules are checked against.

A user names the package through ``tensorizer_manifest.__all__`` (each name's kind and signature), the error
hierarchy, the ``tensorizer-manifest`` commands and their options, the entry points in ``pyproject.toml``
(console script, vLLM plugin), the dotted names a vLLM configuration holds (the worker extension, the two
load formats) and the manifest format (its JSON schema). Module paths inside the package are not on the list:
they are free to move.

``tests/fixtures/public-surface.json`` was written by ``python tests/helpers/public_surface.py`` before the
folders existed; ``tests/test_api.py`` compares the live surface with it. Rewrite the fixture only for a
deliberate change of the public API, and say so in the commit.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "public-surface.json"


def _signature(obj) -> str:
    """The signature, its annotations without the module they are defined in (modules are free to move)."""
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    return re.sub(r"tensorizer_manifest(\.\w+)*\.(?=[A-Z])", "", text)


def _describe(obj) -> dict:
    if inspect.isclass(obj):
        return {
            "kind": "class",
            "bases": [f"{base.__name__}" for base in obj.__mro__[1:] if base is not object],
            "signature": _signature(obj) if not issubclass(obj, BaseException) else "",
        }
    if callable(obj):
        return {"kind": "function", "signature": _signature(obj)}
    return {"kind": type(obj).__name__}


def _commands(group, prefix: str = "") -> dict:
    import click

    found = {}
    for name, command in sorted(group.commands.items()):
        path = f"{prefix}{name}"
        found[path] = [
            {"name": p.name, "opts": sorted(p.opts), "required": p.required, "flag": bool(getattr(p, "is_flag", False))}
            for p in sorted(command.params, key=lambda p: p.name or "")
        ]
        if isinstance(command, click.Group):
            found.update(_commands(command, prefix=f"{path} "))
    return found


def _resolve(target: str):
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def surface() -> dict:
    """The public surface of the installed package, as plain JSON values."""
    import tensorizer_manifest as tm

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    entry_points = {"console_scripts": project["scripts"], **project["entry-points"]}
    for group in entry_points.values():
        for target in group.values():
            assert callable(_resolve(target)), target  # each entry point resolves to something callable
    scripts = project["scripts"]
    (main_target,) = scripts.values()
    worker_module, _, worker_class = tm.WORKER_EXTENSION.rpartition(".")
    worker = getattr(importlib.import_module(worker_module), worker_class)
    return {
        "__all__": {name: _describe(getattr(tm, name)) for name in sorted(tm.__all__) if name != "__version__"},
        "constants": {
            name: getattr(tm, name)
            for name in ("FORMAT_VERSION", "LOAD_FORMAT", "CAPTURE_LOAD_FORMAT", "WORKER_EXTENSION")
        },
        "worker_extension_methods": sorted(n for n in vars(worker) if not n.startswith("_")),
        "cli": _commands(_cli_group(main_target)),
        "entry_points": entry_points,
        "manifest_json_schema_blake2b": hashlib.blake2b(
            json.dumps(tm.json_schema(), sort_keys=True).encode(), digest_size=16
        ).hexdigest(),
    }


def _cli_group(main_target: str):
    """The click group behind the console script: the module of ``main`` holds it as ``app``."""
    return importlib.import_module(main_target.partition(":")[0]).app


if __name__ == "__main__":
    sys.stdout.write(json.dumps(surface(), indent=1, sort_keys=True) + "\n")
