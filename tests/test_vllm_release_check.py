"""``scripts/vllm_release_check.py`` on a tiny fake vLLM wheel: the resolver's answers, found and not, with no
network and no real wheel (the real releases' tables are in docs/vllm-releases.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers.release_check import load_release_check

release_check = load_release_check()
Wanted = release_check.Wanted

#: The fake release: each way vLLM binds a name that the check has to find.
FAKE_VLLM = {
    "vllm/__init__.py": """
from .version import __version__
import typing

MODULE_ATTRS = {"LLM": ".entry:LLM", "Params": ".loaders.default:Params"}

if typing.TYPE_CHECKING:
    from vllm.entry import LLM
    from vllm.ops import plain
else:
    def __getattr__(name):
        raise AttributeError(name)
""",
    "vllm/version.py": "__version__ = '0.99.0'\n",
    "vllm/entry.py": "class LLM:\n    def __init__(self, model, **engine_kwargs):\n        pass\n",
    "vllm/ops.py": """
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no module __getattr__ here: a name for type checkers only
    from vllm.loaders.base import BaseLoader

try:
    from ._C import fast
except ImportError:
    def fast(x):
        return x

counter: int = 0
from torch import empty
from math import *  # another distribution's star import: says nothing of which names it binds

def plain(a, b, *, c=None):
    pass

async def flexible(a, **kwargs):
    pass

alias_of_plain = plain
""",
    "vllm/loaders/__init__.py": """
from .base import BaseLoader
from vllm.loaders.default import DefaultLoader as Loader
from . import default
""",
    "vllm/loaders/base.py": """
class BaseLoader:
    registry = {}

    def __init__(self, config):
        self.config = config
        self.low, self.high = 0, 1

    def load(self, model, config):
        layer = model.first
        layer._skip_dispatch = True  # a flag set on another object

    @classmethod
    def defaults(cls, world_size):
        pass
""",
    "vllm/platforms/__init__.py": """
from typing import TYPE_CHECKING

from .interface import Platform

if TYPE_CHECKING:
    current_platform: Platform


def __getattr__(name):
    raise AttributeError(name)
""",
    "vllm/platforms/interface.py": """
import msgspec


class Platform:
    device_type: str

    def is_cpu(self) -> bool:
        return True


class Sampling(msgspec.Struct, omit_defaults=True):
    temperature: float = 1.0
    max_tokens: int = 16
""",
    "vllm/loaders/default.py": """
from vllm.loaders.base import BaseLoader

class DefaultLoader(BaseLoader):
    def _init_filter(self, model_config):
        pass

    def _read(self, layer):
        return getattr(layer, "_read_flag", None)

class Params:
    def __init__(self, x, y=1):
        pass
""",
    "vllm/loaders/wrapped.py": """
from . import base as base_module

class Wrapped(base_module.BaseLoader):
    pass
""",
}


@pytest.fixture(scope="module")
def fake_wheel(tmp_path_factory) -> Path:
    wheel = tmp_path_factory.mktemp("wheel") / "vllm-0.99.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for member, source in FAKE_VLLM.items():
            archive.writestr(member, source)
        archive.writestr("vllm/_C.abi3.so", b"\0")  # not Python: never read
    return wheel


def _check(wheel: Path, module: str, attr: str = "", parameters: tuple[str, ...] = ()):
    [finding] = release_check.check_names(wheel, [Wanted("private name", module, attr, parameters)])
    return finding.state, finding.status


def test_a_function_is_found_with_its_parameters(fake_wheel):
    assert _check(fake_wheel, "vllm.ops", "plain", ("a", "b", "c")) == ("ok", "ok")


def test_a_name_re_exported_is_followed_to_its_definition(fake_wheel):
    assert _check(fake_wheel, "vllm.loaders", "BaseLoader") == ("ok", "ok (defined in vllm.loaders.base)")
    renamed = _check(fake_wheel, "vllm.loaders", "Loader._init_filter", ("self", "model_config"))
    assert renamed == ("ok", "ok (defined in vllm.loaders.default)")


def test_a_lazy_export_of_a_module_getattr_is_followed(fake_wheel):
    """vllm/__init__.py's names come from its ``__getattr__``: its ``MODULE_ATTRS`` and its ``TYPE_CHECKING``
    imports both say where (a ``TYPE_CHECKING`` import elsewhere binds nothing at run time)."""
    assert _check(fake_wheel, "vllm", "LLM", ("model", "tokenizer")) == (
        "ok",
        "ok via **kwargs (tokenizer) (defined in vllm.entry)",
    )
    assert _check(fake_wheel, "vllm", "Params", ("x",)) == ("ok", "ok (defined in vllm.loaders.default)")
    assert _check(fake_wheel, "vllm", "plain", ("a", "b")) == ("ok", "ok (defined in vllm.ops)")
    assert _check(fake_wheel, "vllm.ops", "BaseLoader") == ("missing", "missing name")


def test_a_submodule_counts_as_a_name(fake_wheel):
    assert _check(fake_wheel, "vllm", "ops") == ("ok", "ok")
    assert _check(fake_wheel, "vllm.loaders", "wrapped") == ("ok", "ok")
    assert _check(fake_wheel, "vllm.loaders", "default.Params") == ("ok", "ok (defined in vllm.loaders.default)")


def test_a_missing_module(fake_wheel):
    assert _check(fake_wheel, "vllm.nowhere", "plain") == ("missing", "missing module")
    assert _check(fake_wheel, "vllm.nowhere") == ("missing", "missing module")


def test_a_missing_name(fake_wheel):
    assert _check(fake_wheel, "vllm.ops", "gone") == ("missing", "missing name")
    assert _check(fake_wheel, "vllm.loaders.default", "DefaultLoader.gone") == ("missing", "missing name")


def test_a_parameter_the_function_lacks(fake_wheel):
    assert _check(fake_wheel, "vllm.ops", "plain", ("a", "b", "d")) == ("changed", "lacks parameter(s) d")


def test_a_required_parameter_not_passed(fake_wheel):
    """``PRIVATE_NAMES`` lists what a call passes: a required parameter it does not list is a new one."""
    assert _check(fake_wheel, "vllm.ops", "plain", ("a",)) == ("changed", "requires parameter(s) b, not passed")


def test_any_parameter_via_kwargs(fake_wheel):
    assert _check(fake_wheel, "vllm.ops", "flexible", ("a", "anything")) == ("ok", "ok via **kwargs (anything)")


def test_a_name_defined_in_try_except(fake_wheel):
    assert _check(fake_wheel, "vllm.ops", "fast", ("x",)) == ("ok", "ok")


def test_assignments_are_names_and_an_alias_has_its_targets_signature(fake_wheel):
    assert _check(fake_wheel, "vllm.ops", "counter") == ("ok", "ok")
    assert _check(fake_wheel, "vllm.ops", "alias_of_plain", ("a", "b")) == ("ok", "ok")
    assert _check(fake_wheel, "vllm.ops", "alias_of_plain", ("a", "z"))[0] == "changed"


def test_a_class_method(fake_wheel):
    found = _check(fake_wheel, "vllm.loaders.default", "DefaultLoader._init_filter", ("self", "model_config"))
    assert found == ("ok", "ok")
    assert _check(fake_wheel, "vllm.loaders.default", "DefaultLoader._init_filter", ("self", "config"))[0] == "changed"


def test_a_base_class_method(fake_wheel):
    inherited = "ok (defined in vllm.loaders.base)"
    assert _check(fake_wheel, "vllm.loaders.default", "DefaultLoader.load", ("self", "model", "config")) == (
        "ok",
        inherited,
    )
    assert _check(fake_wheel, "vllm.loaders.default", "DefaultLoader.registry") == ("ok", inherited)
    # a base written as ``module.Class``
    assert _check(fake_wheel, "vllm.loaders.wrapped", "Wrapped.load", ("self", "model", "config")) == ("ok", inherited)
    assert _check(fake_wheel, "vllm.loaders.wrapped", "Wrapped.load", ("self",))[0] == "changed"


def test_a_class_is_called_through_its_init(fake_wheel):
    assert _check(fake_wheel, "vllm.loaders.default", "Params", ("x",)) == ("ok", "ok")
    assert _check(fake_wheel, "vllm.loaders.default", "Params", ("x", "z")) == ("changed", "lacks parameter(s) z")


def test_a_name_vllm_takes_from_another_distribution(fake_wheel):
    assert _check(fake_wheel, "vllm.ops", "empty") == ("ok", "ok (re-exported from torch, not vLLM's)")
    assert _check(fake_wheel, "vllm.ops", "empty", ("size",))[0] == "unchecked"


def test_other_distributions_names_are_skipped(fake_wheel):
    assert _check(fake_wheel, "torch.cpu", "_is_amx_tile_supported") == ("skipped", "not vLLM's: skipped")


def test_an_installed_tree_reads_as_its_wheel(fake_wheel, tmp_path):
    """The same sources as a directory holding ``vllm/`` (an installed vLLM: ``Path(vllm.__file__).parent.parent``)
    give the wheel's answers; another distribution beside it is not read."""
    for member, source in {**FAKE_VLLM, "other/__init__.py": "def plain(a):\n    pass\n"}.items():
        (tmp_path / member).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / member).write_text(source)
    wanted = [
        Wanted("private name", "vllm", "LLM", ("model", "tokenizer")),
        Wanted("private name", "vllm.loaders", "Loader._init_filter", ("self", "model_config")),
        Wanted("private name", "vllm.loaders.wrapped", "Wrapped.load", ("self", "model", "config")),
        Wanted("private name", "vllm.loaders", "default.Params", ("x", "z")),
        Wanted("private name", "vllm.ops", "plain", ("a",)),
        Wanted("private name", "vllm.ops", "empty"),
        Wanted("private name", "vllm.ops", "gone"),
        Wanted("import", "vllm.nowhere"),
        Wanted("import", "vllm.loaders"),
    ]
    from_tree = [(f.state, f.status) for f in release_check.check_names(tmp_path, wanted)]
    assert from_tree == [(f.state, f.status) for f in release_check.check_names(fake_wheel, wanted)]
    assert {state for state, _ in from_tree} == {"ok", "changed", "missing"}
    sources = release_check.TreeSources(tmp_path)
    assert sources.member("vllm.loaders") == "vllm/loaders/__init__.py" and sources.member("other") is None
    with pytest.raises(FileNotFoundError, match="holds no vllm/"):
        release_check.TreeSources(tmp_path / "vllm")


def _find(wheel: Path, wanted):
    [finding] = release_check.check_names(wheel, [wanted])
    return finding.state, finding.status


def test_a_name_in_its_older_place(fake_wheel):
    """``VllmName("vllm.new_ops | vllm.ops", ...)``: a release that has the name in its new place is read there, one
    that has it in its older place is ok there, one with neither is missing in both."""
    moved = Wanted("private", "vllm.new_ops", "plain", ("a", "b"), older_modules=("vllm.ops",))
    assert _find(fake_wheel, moved) == ("ok", "ok (in vllm.ops, its older place)")
    assert moved.label == "vllm.new_ops:plain(a, b), else vllm.ops"
    here = Wanted("private", "vllm.ops", "plain", ("a", "b"), older_modules=("vllm.loaders",))
    assert _find(fake_wheel, here) == ("ok", "ok")
    gone = Wanted("private", "vllm.new_ops", "gone", older_modules=("vllm.ops",))
    assert _find(fake_wheel, gone) == ("missing", "missing module (nor in vllm.ops)")
    changed = Wanted("private", "vllm.ops", "plain", ("z",), older_modules=("vllm.loaders.base",))
    assert _find(fake_wheel, changed)[0] == "changed"  # found, called otherwise: not looked for further


def test_a_name_called_in_one_of_two_shapes(fake_wheel):
    """Each parameter list a name is called with (one per release's shape): ok when one fits, saying which when it
    is not the first (the newest release's); changed, against the first, when none does."""
    both = Wanted("private", "vllm.loaders.default", "DefaultLoader._init_filter", ("self", "model", "model_config"),
                  other_calls=(("self", "model_config"),))  # fmt: skip
    assert both.label.endswith("DefaultLoader._init_filter(self, model, model_config) or (self, model_config)")
    assert _find(fake_wheel, both) == ("ok", "ok as (self, model_config)")
    neither = Wanted("private", "vllm.loaders.default", "DefaultLoader._init_filter", ("self", "model", "config"),
                     other_calls=(("self", "plan"),))  # fmt: skip
    assert _find(fake_wheel, neither) == ("changed", "lacks parameter(s) model, config; requires parameter(s) "
                                                     "model_config, not passed")  # fmt: skip


def test_an_optional_name_may_be_absent(fake_wheel):
    absent = Wanted("private", "vllm.ops", "finalize", optional=True)
    assert _find(fake_wheel, absent) == ("ok", "not in this release (missing name): optional, the package does without")
    assert _find(fake_wheel, Wanted("private", "vllm.ops", "plain", optional=True)) == ("ok", "ok")


def test_an_attribute_instances_set(fake_wheel):
    """``Class().name``: set as ``self.name`` in a method (a tuple's part too), of the class or a base within vLLM."""
    assert _find(fake_wheel, Wanted("public", "vllm.loaders.base", "BaseLoader().config")) == ("ok", "ok")
    assert _find(fake_wheel, Wanted("public", "vllm.loaders.base", "BaseLoader().high")) == ("ok", "ok")
    inherited = _find(fake_wheel, Wanted("public", "vllm.loaders.default", "DefaultLoader().low"))
    assert inherited == ("ok", "ok (defined in vllm.loaders.base)")
    assert _find(fake_wheel, Wanted("public", "vllm.loaders.base", "BaseLoader().registry")) == ("ok", "ok")
    assert _find(fake_wheel, Wanted("public", "vllm.loaders.base", "BaseLoader().gone")) == ("missing", "missing name")


def test_a_flag_the_module_sets_or_reads(fake_wheel):
    """``*.name``: a flag vLLM sets (``layer._skip_dispatch = True``) or reads (``getattr(layer, "_read_flag")``) on
    objects not its own: the module's source names it."""
    assert _find(fake_wheel, Wanted("private", "vllm.loaders.base", "*._skip_dispatch")) == ("ok", "ok")
    assert _find(fake_wheel, Wanted("private", "vllm.loaders.default", "*._read_flag")) == ("ok", "ok")
    assert _find(fake_wheel, Wanted("private", "vllm.loaders.default", "*._skip_dispatch")) == (
        "missing",
        "missing name",
    )


def test_an_annotated_names_attribute_is_its_classs(fake_wheel):
    """``current_platform: Platform`` (made by the module's ``__getattr__``): its attributes are ``Platform``'s."""
    assert _find(fake_wheel, Wanted("public", "vllm.platforms", "current_platform.is_cpu", ("self",))) == (
        "ok",
        "ok (defined in vllm.platforms.interface)",
    )
    assert _find(fake_wheel, Wanted("public", "vllm.platforms", "current_platform.device_type"))[0] == "ok"
    assert _find(fake_wheel, Wanted("public", "vllm.platforms", "current_platform.gone"))[0] == "missing"


def test_a_class_method_and_a_struct_are_called_as_their_class_calls_them(fake_wheel):
    assert _find(fake_wheel, Wanted("public", "vllm.loaders.base", "BaseLoader.defaults", ("world_size",))) == (
        "ok",
        "ok",
    )
    struct = Wanted("public", "vllm.platforms.interface", "Sampling", ("temperature", "max_tokens"))
    assert _find(fake_wheel, struct) == ("ok", "ok")
    assert _find(fake_wheel, Wanted("public", "vllm.platforms.interface", "Sampling", ("top_q",)))[0] == "changed"


def test_the_declared_names_are_the_compat_modules_table():
    from tensorizer_manifest._vllm_compat import NAMES

    wanted = release_check.declared_names()
    assert [(w.modules, w.attr, w.calls, w.optional) for w in wanted] == [
        (e.modules, e.attr, e.calls, e.optional) for e in NAMES
    ]
    assert {w.kind for w in wanted} == {"public", "private"}


def test_a_cached_wheel_is_not_downloaded_again(tmp_path, monkeypatch):
    cached = tmp_path / "0.99.0" / "vllm-0.99.0-py3-none-any.whl"
    cached.parent.mkdir()
    cached.write_bytes(b"")

    def no_pip(*args, **kwargs):
        raise AssertionError("pip was run for a cached wheel")

    monkeypatch.setattr(release_check.subprocess, "run", no_pip)
    assert release_check.fetch_wheel("0.99.0", tmp_path) == cached


def test_no_network_is_said_in_one_line(tmp_path, monkeypatch):
    def offline_pip(command, **kwargs):
        stderr = (
            "WARNING: Retrying after connection broken by 'NewConnectionError(...)'\nERROR: No matching distribution\n"
        )
        return subprocess.CompletedProcess(command, 1, "", stderr)

    monkeypatch.setattr(release_check.subprocess, "run", offline_pip)
    with pytest.raises(release_check.NoWheel) as raised:
        release_check.fetch_wheel("0.99.0", tmp_path)
    assert str(raised.value) == "vLLM 0.99.0: no wheel to read: no network (pip could not reach the package index)"
    assert not (tmp_path / "0.99.0").exists(), "an empty cache folder was left behind"
    monkeypatch.setattr(sys, "argv", ["vllm_release_check.py", "0.99.0", "--cache", str(tmp_path)])
    assert release_check.main() == 2


def _run_main(tmp_path, fake_wheel, monkeypatch, wanted, *flags):
    cached = tmp_path / "0.99.0" / fake_wheel.name
    cached.parent.mkdir(exist_ok=True)
    cached.write_bytes(fake_wheel.read_bytes())
    monkeypatch.setattr(release_check, "declared_names", lambda: wanted)
    return release_check.main(["0.99.0", "--cache", str(tmp_path), *flags])


def test_the_table_summary_and_exit_status(tmp_path, fake_wheel, monkeypatch, capsys):
    wanted = [
        Wanted("private", "vllm.ops", "plain", ("a", "b")),
        Wanted("public", "vllm.loaders", "BaseLoader"),
        Wanted("private", "torch.cpu", "_is_amx_tile_supported"),
    ]
    assert _run_main(tmp_path, fake_wheel, monkeypatch, wanted, "--markdown") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| what | vLLM name | status |"
    assert "| public | `vllm.loaders:BaseLoader` | ok (defined in vllm.loaders.base) |" in out
    assert out[-1] == "vLLM 0.99.0: 2 names checked (1 private), 0 missing, 0 changed"

    wanted.append(Wanted("public", "vllm.ops", "gone"))
    assert _run_main(tmp_path, fake_wheel, monkeypatch, wanted, "--json") == 1
    document = json.loads(capsys.readouterr().out)
    assert [row["status"] for row in document["findings"]] == [
        "ok",
        "ok (defined in vllm.loaders.base)",
        "not vLLM's: skipped",
        "missing name",
    ]
    assert document["findings"][0]["calls"] == [["a", "b"]]
    assert document["summary"] == "vLLM 0.99.0: 3 names checked (1 private), 1 missing, 0 changed"
