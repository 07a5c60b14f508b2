"""Every private vLLM name the package touches exists in the installed vLLM."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tensorizer_manifest import _vllm_compat  # noqa: E402


def test_every_private_vllm_name_is_there():
    missing = _vllm_compat.missing_private_names()
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
    monkeypatch.setattr(_vllm_compat, "PRIVATE_NAMES", (*_vllm_compat.PRIVATE_NAMES, ("vllm", "_no_such_name", ())))
    assert _vllm_compat.missing_private_names() == ["vllm._no_such_name"]
    from vllm import _custom_ops

    monkeypatch.delattr(_custom_ops, "_supports_onednn")
    with pytest.raises(Exception, match=f"vLLM {_vllm_compat.vllm_version()} has no"):
        _vllm_compat.disable_onednn()


def test_a_private_function_whose_signature_changed_is_a_typed_error_before_it_is_called(monkeypatch):
    """A keyword a vLLM release dropped: a TypeError deep in a save, once; now refused by name before the call."""
    import vllm._custom_ops as custom_ops

    from tensorizer_manifest.errors import UnsupportedVLLMError

    module, name = "vllm._custom_ops", "_signature_checked"
    calls = []
    monkeypatch.setattr(_vllm_compat, "PRIVATE_NAMES", (*_vllm_compat.PRIVATE_NAMES, (module, name, ("layer",))))
    monkeypatch.setattr(custom_ops, name, lambda other: calls.append(other), raising=False)
    assert _vllm_compat.missing_private_names() == [f"{module}.{name} (takes no layer)"]
    with pytest.raises(UnsupportedVLLMError) as raised:
        _vllm_compat.private(module, name)
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
        with caplog.at_level(logging.DEBUG):
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
    """``scripts/vllm_release_check.py`` on the installed vLLM's own .py files: every private name (with the
    parameters passed) and every vLLM import of the package is ok, as the import-time check says (none missing). A
    name gone, a parameter renamed, a class method gone and a module gone are each reported, by both."""
    from pathlib import Path

    import vllm

    release_check = _release_check()
    installed = Path(vllm.__file__).parent.parent
    findings = release_check.check_names(installed, release_check.private_names() + release_check.package_imports())
    assert _vllm_compat.missing_private_names() == []  # the import-time check
    assert _not_ok(findings) == []
    ok = release_check.OK
    read = {(f.wanted.module, f.wanted.attr) for f in findings if f.wanted.kind == "private name" and f.state == ok}
    assert read == {(m, a) for m, a, _ in _vllm_compat.PRIVATE_NAMES if m.split(".")[0] == "vllm"}
    assert any(f.wanted.kind == "import" for f in findings)

    sabotaged = (
        ("vllm.model_executor.model_loader", "_NO_SUCH_TABLE", ()),
        ("vllm.model_executor.model_loader.weight_cache.protocol", "_hash_quant_config", ("quant_config", "renamed")),
        ("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts._no_such_method", ("self",)),
        ("vllm.no_such_module", "anything", ()),
    )
    wanted = [release_check.Wanted("private name", *entry) for entry in sabotaged]
    assert [(f.state, f.status) for f in release_check.check_names(installed, wanted)] == [
        ("missing", "missing name"),
        ("changed", "lacks parameter(s) renamed"),
        ("missing", "missing name"),
        ("missing", "missing module"),
    ]
    monkeypatch.setattr(_vllm_compat, "PRIVATE_NAMES", sabotaged)
    assert _vllm_compat.missing_private_names() == [
        "vllm.model_executor.model_loader._NO_SUCH_TABLE",
        "vllm.model_executor.model_loader.weight_cache.protocol._hash_quant_config (takes no renamed)",
        "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts._no_such_method",
        "vllm.no_such_module (module)",
    ]


@pytest.mark.e2e
@pytest.mark.parametrize("release", _vllm_compat.READ_CHECKED_RELEASES)
def test_every_vllm_name_is_in_each_read_checked_release_s_sources(release):
    """Each read-checked release (``READ_CHECKED_RELEASES``), read before it is run: every private vLLM name this
    package calls, with the parameters it passes, and every vLLM import of the package is in its ``.0`` wheel's
    sources (``scripts/vllm_release_check.py``: the wheel downloaded once into build/vllm-wheels; skipped, saying
    why, when it cannot be had)."""
    release_check = _release_check()
    version = f"{release}.0"
    try:
        wheel = release_check.fetch_wheel(version, release_check.DEFAULT_CACHE)
    except release_check.NoWheel as exc:
        pytest.skip(str(exc))  # "vLLM 0.33.0: no wheel to read: no network (...)"
    findings = release_check.check_names(wheel, release_check.private_names() + release_check.package_imports())
    not_ok = _not_ok(findings)
    assert not not_ok, (
        f"{release_check.summary_line(version, findings)}: {not_ok}; update _vllm_compat.py (or the package's "
        f"imports) before supporting it"
    )


@pytest.mark.parametrize(
    ("version", "status"),
    [("0.31.0", "run"), ("0.32.0", "run"), ("0.32.1.dev4+gabc", "run"), ("0.33.0", "read-checked"),
     ("0.33.2rc1", "read-checked"), ("0.34.0", None), ("0.30.1", None), ("1.0.0", None)],
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
