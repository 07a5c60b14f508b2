"""The package's layout contract, read from the source (imports inside functions included).

- No import cycle among the package's modules.
- No module imports a private name (``_x``) from another module of the package;
  the private modules ``_constants`` and ``_vllm_compat`` are imported whole, for their public names.
- No module imports from the package root (``__init__`` is the public face, not a dependency).
- Every module says what it is for, and ``docs/design.md`` lists it.
- Every folder's ``__init__`` docstring names every module it holds.
- No module or folder is named after a standard-library module (run from inside the package folder, a tool's
  ``import inspect`` would get ours).

``pyproject.toml``'s import-linter contract (``make lint``) states the layers themselves.
"""

from __future__ import annotations

import ast
import graphlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tensorizer_manifest"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    is_package = MODULES[importer].name == "__init__.py"
    base = importer.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every import of the package, anywhere."""
    found = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(name, node)
            if target.split(".")[0] != "tensorizer_manifest":
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in MODULES:
                    found.append((submodule, "", node.lineno))
                else:
                    found.append((target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "tensorizer_manifest"]
    return found


def test_the_module_list_is_read():
    assert {"tensorizer_manifest.format.schema", "tensorizer_manifest.restorers.base"} <= set(MODULES)


def test_no_import_cycle():
    graph = {name: {target for target, _, _ in _imports(name) if target != name} for name in MODULES}
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None
    assert set(MODULES) <= set(order)


def test_no_private_name_is_imported_from_another_module():
    offences = [
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {attr} from {target}"
        for name in MODULES
        for target, attr, line in _imports(name)
        if attr.startswith("_") and not attr.startswith("__")
    ]
    assert not offences, offences


def test_no_private_attribute_of_a_package_module_is_used():
    offences = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        bound = {attr.split(".")[-1] for target, attr, _ in _imports(name) if not attr and target in MODULES}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not offences, offences


def test_no_module_imports_the_package_root():
    offences = [
        f"{MODULES[name].relative_to(ROOT)}:{line}"
        for name in MODULES
        if name != "tensorizer_manifest"
        for target, _, line in _imports(name)
        if target == "tensorizer_manifest"
    ]
    assert not offences, f"import from the defining module instead: {offences}"


def test_every_module_has_a_docstring_and_a_place_in_the_design_map():
    design = (ROOT / "docs" / "design.md").read_text()
    for path in MODULES.values():
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.relative_to(ROOT)} has no docstring"
        shown = str(path.relative_to(PACKAGE)) if path.name != "__init__.py" else str(path.parent.relative_to(PACKAGE))
        is_restorer = shown.startswith("restorers/") and shown != "restorers/base.py"  # listed by `kernels`
        if shown != "." and not is_restorer:
            assert f"`{shown}" in design, f"docs/design.md does not list {shown}"


def test_each_folder_s_docstring_names_every_module_it_holds():
    """A folder's face says what is in it: each module (and sub-package) as ``name`` or `name.py`."""
    missing = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent
        if folder == PACKAGE:
            continue  # the package root's docstring is its public face, not a map (docs/design.md is)
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        held = [p.stem for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        held += [p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
        unnamed = sorted(n for n in held if f"``{n}``" not in docstring and f"`{n}.py`" not in docstring)
        if unnamed:
            missing.append(f"{folder.relative_to(ROOT)}: {', '.join(unnamed)}")
    assert not missing, "each folder's __init__ docstring must name its modules:\n" + "\n".join(missing)


#: Modules whose tests share a file: the package's face and foundations (test_api), and inside a folder,
#: modules of one subject (every restorer in test_restorers, the four offline checks in test_checks).
_SHARED_TEST_FILE = {
    "tensorizer_manifest": "test_api",
    "tensorizer_manifest.errors": "test_api",
    "tensorizer_manifest._constants": "test_api",
    "tensorizer_manifest._signatures": "test_api",
    **{
        f"tensorizer_manifest.checks.{name}": "checks/test_checks"
        for name in ("report", "seal", "records", "tensor_files")
    },
    # A command's module is tested by running the command as a user does: in test_commands (one file, whose
    # end-to-end tests the workers schedule as one), or beside the module it runs, whose tests run it too.
    **{
        f"tensorizer_manifest.cli.{name}": "cli/test_commands"
        for name in ("save", "add_form", "inspect_command", "validate", "fetch", "gc_command", "kernels", "schema")
    },
    **{f"tensorizer_manifest.cli.{name}_command": f"cli/test_{name}" for name in ("diff", "demo", "verify_kernels")},
    # Every storage backend passes one suite, parametrized over them.
    **{
        f"tensorizer_manifest.storage.backends.{name}": "storage/backends/test_backends"
        for name in ("base", "local", "s3", "http_read_only")
    },
}


def _expected_test_file(name: str) -> str:
    """``tensorizer_manifest.<folder>.<module>`` is tested in ``tests/<folder>/test_<module>.py``."""
    if name in _SHARED_TEST_FILE:
        return _SHARED_TEST_FILE[name]
    parts = name.split(".")[1:]
    if MODULES[name].name == "__init__.py":
        return f"{parts[0]}/"  # a folder's face: its folder of tests
    if parts[-1] == "__main__":
        return "/".join(parts[:-1] + ["test_commands"])  # `python -m`: the commands' tests run it
    if parts[0] == "restorers" and parts[-1] not in ("inventory", "mla_attention"):
        return "restorers/test_restorers"
    if parts[-1] == "mla_attention":
        return "restorers/test_restorer_mla"
    return "/".join(parts[:-1] + ["test_" + parts[-1].lstrip("_")])


def test_every_module_with_logic_has_its_own_test_file():
    tests = ROOT / "tests"
    missing = []
    for name in MODULES:
        expected = _expected_test_file(name)
        found = (tests / expected).is_dir() if expected.endswith("/") else (tests / f"{expected}.py").is_file()
        if not found:
            missing.append(f"{name} -> tests/{expected}")
    assert not missing, missing


def test_the_tests_mirror_the_folders():
    """One folder of tests per folder of the package, and none else (beside the end-to-end tests on real vLLM,
    the helpers, the scenarios they run and the fixtures)."""
    package = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    tests = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert tests - {"e2e", "helpers", "scenarios", "fixtures"} == package
    loose = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    top_modules = sorted(f"test_{n.rsplit('.', 1)[-1].lstrip('_')}.py" for n in MODULES if n.count(".") == 1)
    assert set(loose) - set(top_modules) <= {
        "test_api.py",
        "test_harness.py",
        "test_layout.py",
        "test_scripts.py",
        "test_supported_models.py",
        "test_vllm_release_check.py",
    }


def test_no_module_or_folder_is_named_after_a_standard_library_module():
    names = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    assert not sorted(names & sys.stdlib_module_names)
