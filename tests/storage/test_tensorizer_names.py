"""Every private tensorizer name the package touches exists in the installed tensorizer, and the wording of its
messages the package reads is still tensorizer's; a name gone is a typed error or one warning, never silence."""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tensorizer_manifest.errors import UnsupportedTensorizerError
from tensorizer_manifest.storage import tensorizer_names
from tensorizer_manifest.storage.tensor_file import TensorFileReader, write_tensor_file

ROOT = Path(__file__).resolve().parents[2]
LOGGER = "tensorizer_manifest.storage.tensorizer_names"


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """No warning given yet, no stream class made yet (and none kept from a test that took a name away)."""
    monkeypatch.setattr(tensorizer_names, "_WARNED", set())
    tensorizer_names.retrying_stream_class.cache_clear()
    yield
    tensorizer_names.retrying_stream_class.cache_clear()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_every_private_tensorizer_name_is_there():
    missing = tensorizer_names.missing_private_names()
    assert not missing, (
        f"tensorizer {tensorizer_names.tensorizer_version()} lacks {missing}: update tensorizer_names.py"
    )
    assert tensorizer_names.retrying_stream_class() is not None
    assert tensorizer_names.s3_download_url() is not None


def test_the_installed_tensorizer_is_in_the_tested_range_that_pyproject_pins():
    tomllib = pytest.importorskip("tomllib")
    specifiers = pytest.importorskip("packaging.specifiers")

    tested = specifiers.SpecifierSet(tensorizer_names.SUPPORTED_TENSORIZER)
    assert tensorizer_names.tensorizer_version() in tested
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"tensorizer{tensorizer_names.SUPPORTED_TENSORIZER}" in dependencies


@pytest.mark.parametrize(("fragment", "module", "qualname"), tensorizer_names.MESSAGE_FRAGMENTS)
def test_each_matched_message_is_still_worded_so_where_tensorizer_raises_it(fragment, module, qualname):
    raiser = importlib.import_module(module)
    for part in qualname.split("."):
        raiser = getattr(raiser, part)
    assert fragment in inspect.getsource(raiser), (
        f"tensorizer {tensorizer_names.tensorizer_version()}'s {module}.{qualname} no longer says {fragment!r}: "
        "update tensorizer_names.py and the matching in storage/"
    )


def test_a_method_gone_gives_up_the_retrying_streams_with_one_warning(monkeypatch, caplog):
    from tensorizer.stream_io import CURLStreamFile

    monkeypatch.delattr(CURLStreamFile, "_fork")
    assert tensorizer_names.missing_private_names() == ["tensorizer.stream_io.CURLStreamFile._fork"]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert tensorizer_names.retrying_stream_class() is None
        tensorizer_names.retrying_stream_class.cache_clear()
        assert tensorizer_names.retrying_stream_class() is None  # asked again: no second warning
    (warning,) = _warnings(caplog)
    assert f"tensorizer {tensorizer_names.tensorizer_version()} has no tensorizer.stream_io.CURLStreamFile._fork" in (
        warning
    )
    assert "no If-Match conditional reads" in warning and "no retried re-opens" in warning
    assert tensorizer_names.SUPPORTED_TENSORIZER in warning


def test_an_instance_attribute_no_longer_set_is_found_in_the_source(monkeypatch, caplog):
    gone = ("tensorizer.stream_io", "CURLStreamFile()._no_such_attribute", ())
    monkeypatch.setattr(tensorizer_names, "PRIVATE_NAMES", (*tensorizer_names.PRIVATE_NAMES, gone))
    assert tensorizer_names.missing_private_names() == ["tensorizer.stream_io.CURLStreamFile()._no_such_attribute"]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert tensorizer_names.retrying_stream_class() is None
    assert len(_warnings(caplog)) == 1 and "CURLStreamFile()._no_such_attribute" in _warnings(caplog)[0]


def test_a_presigner_whose_signature_changed_is_given_up_with_one_warning(monkeypatch, caplog):
    from tensorizer import stream_io

    def presign(path_uri):  # a tensorizer that takes the credentials another way
        return path_uri

    monkeypatch.setattr(stream_io, "_s3_download_url", presign)
    name = "tensorizer.stream_io._s3_download_url (takes no s3_access_key_id, s3_secret_access_key, s3_endpoint)"
    assert tensorizer_names.missing_private_names() == [name]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert tensorizer_names.s3_download_url() is None
        assert tensorizer_names.s3_download_url() is None
    (warning,) = _warnings(caplog)
    assert name in warning and "no If-Match conditional reads" in warning

    monkeypatch.setattr(stream_io, "_s3_download_url", lambda *args, **kwargs: "url")  # a wrapper takes anything
    assert tensorizer_names.missing_private_names() == []
    monkeypatch.delattr(stream_io, "_s3_download_url")
    assert tensorizer_names.missing_private_names() == ["tensorizer.stream_io._s3_download_url"]


@pytest.fixture
def tensor_path(tmp_path):
    path = tmp_path / "x.tensors"
    write_tensor_file(path, [("a", torch.arange(6, dtype=torch.int32)), ("b", torch.ones(2, 3))])
    return path


def test_the_index_gone_is_a_typed_error_naming_the_version_and_range(tensor_path):
    with TensorFileReader(tensor_path) as reader:
        assert set(reader.index()) == {"a", "b"}
        kept = reader._deserializer._metadata
        del reader._deserializer._metadata
        try:
            with pytest.raises(UnsupportedTensorizerError) as raised:
                reader.index()
        finally:
            reader._deserializer._metadata = kept
    message = str(raised.value)
    assert f"tensorizer {tensorizer_names.tensorizer_version()} has no " in message
    assert "tensorizer.serialization.TensorDeserializer()._metadata" in message
    assert tensorizer_names.SUPPORTED_TENSORIZER in message


def test_the_readers_cache_is_emptied_of_what_it_hands_out_or_one_warning_says_it_is_not(tensor_path, caplog):
    with TensorFileReader(tensor_path) as reader:
        assert ("a",) in reader._deserializer._cache
        assert torch.equal(reader.read("a"), torch.arange(6, dtype=torch.int32))
        assert ("a",) not in reader._deserializer._cache and ("b",) in reader._deserializer._cache
    assert _warnings(caplog) == []

    other_tensorizer = SimpleNamespace()  # a deserializer that keeps no such cache
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tensorizer_names.forget_cached(other_tensorizer, "a")
        tensorizer_names.forget_cached(other_tensorizer, "b")
    (warning,) = _warnings(caplog)
    assert "TensorDeserializer()._cache" in warning and "higher peak memory" in warning


def _names_and_fragments() -> list[re.Pattern[str]]:
    names = {name.rpartition(".")[2] for _, name, _ in tensorizer_names.PRIVATE_NAMES}
    return [re.compile(rf"(?<![\w]){re.escape(name)}\b") for name in sorted(names)]


def test_no_other_module_names_a_private_tensorizer_name_or_a_message_of_its():
    """The one module: a private name or a message's wording written elsewhere would drift unchecked again."""
    fragments = [fragment for fragment, _, _ in tensorizer_names.MESSAGE_FRAGMENTS]
    offences = []
    for path in sorted((ROOT / "tensorizer_manifest").rglob("*.py")):
        if path.name == "tensorizer_names.py":
            continue
        text = path.read_text()
        offences += [f"{path.name}: {p.pattern}" for p in _names_and_fragments() if p.search(text)]
        strings = [
            n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        ]
        offences += [f"{path.name}: {f!r}" for f in fragments for s in strings if f in s]
    assert not offences, offences
