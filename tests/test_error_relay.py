"""The error relay without vLLM: what a process that vLLM started records is raised, typed, by the one that started
it; only errors of this package, by name, never code (no pickle)."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from tensorizer_manifest import _error_relay
from tensorizer_manifest.errors import CompatibilityError, ConfigurationError, IntegrityError, TensorizerManifestError


@pytest.fixture(autouse=True)
def _own_relay(monkeypatch):
    monkeypatch.delenv(_error_relay.RELAY_ENV, raising=False)
    monkeypatch.setattr(_error_relay, "_OWN", None)


@_error_relay.relaying
def _refuse(kind: str) -> None:
    if kind == "integrity":
        raise IntegrityError("the tensor file is damaged; re-save it")
    raise ValueError("not ours")


def _in_a_child(kind: str) -> None:
    """What an engine's process does: a relaying entry point fails, the process dies."""
    try:
        _refuse(kind)
    except Exception:  # noqa: BLE001 - the process ends here, as a failed vLLM worker does
        os._exit(1)


def _child(kind: str) -> None:
    process = multiprocessing.get_context("spawn").Process(target=_in_a_child, args=(kind,))
    process.start()
    process.join(60)
    assert process.exitcode == 1


def test_an_error_raised_in_another_process_is_raised_here_typed_and_chained():
    relay = _error_relay.open_relay()
    assert os.environ[_error_relay.RELAY_ENV] == str(relay)
    with pytest.raises(IntegrityError, match="damaged; re-save it") as raised:
        with _error_relay.errors_typed():
            _child("integrity")  # inherits the relay from the environment
            raise RuntimeError("Engine core initialization failed. See root cause above.")
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_without_a_typed_error_vllms_own_error_stands():
    _error_relay.open_relay()
    with pytest.raises(RuntimeError, match="initialization failed"):
        with _error_relay.errors_typed():
            _child("other")  # not ours: nothing recorded
            raise RuntimeError("Engine core initialization failed")


def test_only_errors_recorded_during_the_call_count_and_the_first_wins():
    relay = _error_relay.open_relay()
    _error_relay.record(ConfigurationError("an earlier engine's"))
    assert isinstance(_error_relay.relayed_error(0), ConfigurationError)
    with pytest.raises(CompatibilityError, match="first"):
        with _error_relay.errors_typed():
            _error_relay.record(CompatibilityError("first"))
            _error_relay.record(IntegrityError("second: another rank failed after the first"))
            raise RuntimeError("vLLM's")
    assert len(list(relay.glob("*.json"))) == 3


def test_a_recorded_name_is_only_ever_a_class_of_errors():
    relay = _error_relay.open_relay()
    for name in ("Popen", "os.system", "TensorizerManifestErrorX"):
        (relay / f"{name}.json").write_text(json.dumps({"type": name, "message": "m", "time_ns": 1 << 62}))
        found = _error_relay.relayed_error(0)
        assert type(found) is TensorizerManifestError and str(found) == "m"
        (relay / f"{name}.json").unlink()


def test_no_relay_no_translation():
    assert _error_relay.relayed_error() is None
    _error_relay.record(IntegrityError("nowhere to go"))  # a process no engine starter named a relay for
    with pytest.raises(RuntimeError):
        with _error_relay.errors_typed():
            raise RuntimeError("vLLM's")
