"""Smoke tests of every script in ``scripts/`` and ``benchmarks/``, so that none rots unnoticed.

Every ``*.py`` there is found by globbing (a new script is covered without an edit here) and:

* runs as a fresh process from the repository root with ``--help``: it must exit 0 and print a usage
  that names the script and carries the first line of its docstring, so an import error at its top or
  a broken argparse set-up fails here; and it must import neither torch nor vLLM to say so (they take
  seconds), unless ``HEAVY_HELP`` says why;
* has every import statement resolved without being run, those inside functions included (scripts
  import torch and vLLM where they use them, so ``--help`` does not exercise those): a module of this
  repository (the package, ``tests/`` helpers, a script's sibling) must be a file that defines every
  name imported from it, any other module an installed top-level package.

Shell scripts get ``bash -n``. Nothing here starts an engine, so nothing is marked e2e.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("scripts", "benchmarks")
SCRIPTS = sorted(p for folder in FOLDERS for p in (ROOT / folder).glob("*.py"))
SHELL_SCRIPTS = sorted(p for folder in FOLDERS for p in (ROOT / folder).glob("*.sh"))

#: Scripts whose --help may import torch or vLLM, and why.
HEAVY_HELP = {
    "fuzz_long.py": "it runs the fuzz test module's own properties and lists them in --help: importing that "
    "module (which builds tensors with torch) is the check that its names still exist",
}
HEAVY = {"torch", "vllm"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_glob_finds_the_scripts():
    names = {p.name for p in SCRIPTS}
    assert {"fuzz_long.py", "verify_kernels.py", "bench_load.py", "bench_manifest.py"} <= names, names
    assert set(HEAVY_HELP) <= names, "HEAVY_HELP names a script that is gone"


@pytest.mark.parametrize("script", SCRIPTS, ids=_rel)
def test_help(script: Path):
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", _rel(script), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # -X importtime writes one line per imported module to stderr; anything else there is the script's.
    timings = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    errors = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    assert proc.returncode == 0, f"{_rel(script)} --help exited {proc.returncode}:\n{errors[-4000:]}"
    usage = " ".join(proc.stdout.split())
    assert usage.startswith(f"usage: {script.name} "), proc.stdout[:500]
    docstring = ast.get_docstring(ast.parse(script.read_text()))
    assert docstring, f"{_rel(script)} has no module docstring to describe it"
    summary = " ".join(docstring.splitlines()[0].split())
    assert summary in usage, f"--help does not show the docstring's first line ({summary!r}):\n{proc.stdout}"
    if script.name not in HEAVY_HELP:
        imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in timings}
        assert not imported & HEAVY, (
            f"{_rel(script)} --help imports {sorted(imported & HEAVY)}: import them in the functions that use them"
        )


def _bindings(body: list[ast.stmt]) -> set[str]:
    """The names a module's top level binds (``if TYPE_CHECKING:`` blocks left out)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = list(node.targets) if isinstance(node, ast.Assign) else [node.target]
            while targets:  # names, and names in tuples (an attribute or a subscript binds none)
                target = targets.pop()
                if isinstance(target, ast.Name):
                    names.add(target.id)
                elif isinstance(target, ast.Tuple | ast.List | ast.Starred):
                    targets += target.elts if not isinstance(target, ast.Starred) else [target.value]
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            names |= _bindings(node.orelse)
        elif isinstance(node, ast.If | ast.For | ast.While | ast.With | ast.Try):
            for block in ("body", "orelse", "finalbody"):
                names |= _bindings(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                names |= _bindings(handler.body)
    return names


def _exported(source: Path) -> set[str] | None:
    """What ``from <source> import NAME`` may name; None: anything (a module ``__getattr__`` without ``__all__``)."""
    tree = ast.parse(source.read_text())
    names = _bindings(tree.body)
    if "__getattr__" not in names:
        return names
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return names | set(ast.literal_eval(node.value))
    return None


def _local_module(dotted: str, roots: list[Path]) -> tuple[Path | None, bool]:
    """(the file of a module of this repository, whether it is a package); (None, False) if not one of ours."""
    for root in roots:
        base = root.joinpath(*dotted.split("."))
        top = root / dotted.split(".")[0]
        if not (top.is_dir() and (top / "__init__.py").exists()) and not top.with_suffix(".py").exists():
            continue
        if (base / "__init__.py").exists():
            return base / "__init__.py", True
        if base.with_suffix(".py").exists():
            return base.with_suffix(".py"), False
        raise AssertionError(f"no module {dotted} under {_rel(root)}/")
    return None, False


def _catches_import_error(node: ast.Try) -> bool:
    caught = [n.id for h in node.handlers if h.type is not None for n in ast.walk(h.type) if isinstance(n, ast.Name)]
    return bool({"ImportError", "ModuleNotFoundError"} & set(caught))


@pytest.mark.parametrize("script", SCRIPTS, ids=_rel)
def test_every_import_resolves(script: Path):
    roots = [script.parent, ROOT, ROOT / "tests", ROOT / "tests" / "checks"]  # what the scripts put on sys.path
    problems = []
    tree = ast.parse(script.read_text())
    guarded = [t for t in ast.walk(tree) if isinstance(t, ast.Try) and _catches_import_error(t)]
    optional = {id(n) for t in guarded for statement in t.body for n in ast.walk(statement)}
    for node in ast.walk(tree):
        if id(node) in optional:  # inside ``try: ... except ImportError:``, as matplotlib for the plots
            continue
        if isinstance(node, ast.Import):
            wanted = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            assert node.level == 0, f"line {node.lineno}: a script cannot import relatively"
            wanted = [(node.module, [a.name for a in node.names])]
        else:
            continue
        for module, names in wanted:
            where = f"line {node.lineno}: {module}"
            try:
                source, package = _local_module(module, roots)
            except AssertionError as exc:
                problems.append(f"{where}: {exc}")
                continue
            if source is None:
                if importlib.util.find_spec(module.split(".")[0]) is None:
                    problems.append(f"{where}: neither a module of this repository nor an installed package")
                continue
            exported = _exported(source)
            for name in names:
                here = source.parent / name
                submodule = package and (here.with_suffix(".py").exists() or (here / "__init__.py").exists())
                if name != "*" and exported is not None and name not in exported and not submodule:
                    problems.append(f"{where}: defines no {name} ({_rel(source)})")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=_rel)
def test_shell_syntax(script: Path):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_kernel_verification_table_says_each_verdict_and_what_did_not_run():
    """What a GPU owner pastes back (``scripts/verify_kernels.py --device cuda``): one row per record, one per kind
    that wrote none, one per CUDA restorer no tiny kind exercises."""
    spec = importlib.util.spec_from_file_location("verify_kernels", ROOT / "scripts" / "verify_kernels.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from tensorizer_manifest.format.verification_records import VerificationRecord

    def record(restorer: str, result: str, detail: str = "") -> VerificationRecord:
        return VerificationRecord(restorer=restorer, result=result, device_type="cuda", device_name="NVIDIA H100",
                                  device_capability="9.0", vllm_version="0.33.0", tensorizer_manifest_version="0.5",
                                  model="tiny gptq-w4", layers=14, kernel_classes=["MarlinLinearKernel"],
                                  date="2026-12-07", detail=detail)  # fmt: skip

    shown = script.table([record("cuda_wna16", "pass"), record("attention_scales", "fail", "k_scale | differs")],
                         {"fp8-tensor": "CUDA out of memory"}, 61.0)  # fmt: skip
    lines = shown.splitlines()
    assert lines[0] == "cuda NVIDIA H100 (capability 9.0); vLLM 0.33.0; tensorizer-manifest 0.5"
    assert "| tiny gptq-w4 | cuda_wna16 | pass | MarlinLinearKernel | 14 |  |" in lines
    assert "| tiny gptq-w4 | attention_scales | fail | MarlinLinearKernel | 14 | k_scale / differs |" in lines
    assert "| fp8-tensor | - | did not run | - | - | CUDA out of memory |" in lines
    assert any(line.startswith("| - | modelopt_nvfp4_linear | not run |") for line in lines)
    assert lines[-1] == "2 records, 1 kinds that did not run, 61 s"
