"""``storage/remote_checkpoint.py`` against real servers on 127.0.0.1 (moto's S3 server, a plain HTTP server with
Range support): a checkpoint uploaded in order, manifests last and never over another writer's, stale tensor
files removed; its config and tokenizer files fetched (listed on S3, guessed over HTTP)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.remote import fresh_prefix, options_for, write_model_checkpoint
from helpers.servers import RangeHTTPServer
from helpers.synthetic import write_synthetic_checkpoint

from tensorizer_manifest.errors import ConcurrentWriteError, ConfigurationError, RemoteNotFoundError, RemoteStorageError
from tensorizer_manifest.storage.remote import RemoteDir, RemoteFile
from tensorizer_manifest.storage.remote_checkpoint import fetch_model_files, upload_checkpoint


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return write_model_checkpoint(tmp_path / "ckpt")


def test_upload_order_and_s3_reads(moto_s3, checkpoint, tmp_path, monkeypatch):
    uri, options = fresh_prefix(), options_for(moto_s3)
    order: list[str] = []
    upload = RemoteFile.upload
    upload_if = RemoteFile.upload_if
    monkeypatch.setattr(RemoteFile, "upload", lambda self, source: (order.append(self.name), upload(self, source)))
    monkeypatch.setattr(
        RemoteFile, "upload_if", lambda self, source, etag: (order.append(self.name), upload_if(self, source, etag))
    )
    names = upload_checkpoint(checkpoint, uri, options)
    assert order == names
    assert order[0].endswith(".tensors") and order[-1] == "model.manifest.json"  # a manifest never precedes its tensors
    assert set(order[1:-1]) == {"config.json", "tokenizer.json"}

    d = RemoteDir(uri, options)
    assert d.list_names() == sorted(order)
    tensors = d / order[0]
    local = checkpoint / order[0]
    assert tensors.size() == local.stat().st_size
    assert b"".join(tensors.read_range(100, 5000)) == local.read_bytes()[100:5000]
    assert (d / "model.manifest.json").read_bytes() == (checkpoint / "model.manifest.json").read_bytes()
    with pytest.raises(RemoteStorageError, match="over the 10 byte limit"):
        (d / "model.manifest.json").read_bytes(limit=10)

    cache = fetch_model_files(uri, tmp_path / "cache", options)
    assert sorted(p.name for p in cache.iterdir()) == ["config.json", "tokenizer.json"]


def test_a_resave_to_the_same_prefix_leaves_no_stale_tensor_file(moto_s3, tmp_path):
    uri, options = fresh_prefix(), options_for(moto_s3)
    first = write_synthetic_checkpoint(tmp_path / "first", seed=1)
    second = write_synthetic_checkpoint(tmp_path / "second", seed=2)
    upload_checkpoint(first, uri, options)
    d = RemoteDir(uri, options)
    (d / "other.0123456789abcdef.tensors").upload(first / "config.json")  # another rank's file stays
    (d / "notes.txt").upload(first / "config.json")
    old = [n for n in d.list_names() if n.startswith("model.") and n.endswith(".tensors")]
    upload_checkpoint(second, uri, options)
    new = [n for n in d.list_names() if n.endswith(".tensors")]
    expected = sorted(p.name for p in second.iterdir() if p.name.endswith(".tensors"))
    assert old != expected  # different weights, different file names: the first one is stale now
    assert new == sorted([*expected, "other.0123456789abcdef.tensors"])
    assert "notes.txt" in d.list_names()


def test_a_manifest_another_writer_committed_during_an_upload_is_never_overwritten(moto_s3, tmp_path, monkeypatch):
    """Each manifest upload is a compare-and-swap on the version found when the upload began (S3's conditional
    writes): a writer that came first is told, never silently replaced."""
    uri, options = fresh_prefix(), options_for(moto_s3)
    first, second, third = (write_synthetic_checkpoint(tmp_path / n, seed=i) for i, n in enumerate("abc", 1))
    upload_checkpoint(first, uri, options)
    d = RemoteDir(uri, options)
    upload = RemoteFile.upload

    def another_writer_meanwhile(self, source):
        upload(self, source)
        if self.name.endswith(".tensors"):  # while this upload runs, another writer commits its manifest
            monkeypatch.setattr(RemoteFile, "upload", upload)
            upload_checkpoint(third, uri, options)

    monkeypatch.setattr(RemoteFile, "upload", another_writer_meanwhile)
    with pytest.raises(ConcurrentWriteError, match="another writer replaced it"):
        upload_checkpoint(second, uri, options)
    assert (d / "model.manifest.json").read_bytes() == (third / "model.manifest.json").read_bytes()
    # a manifest that is not there yet is created only if no other writer created it first
    fresh = RemoteDir(fresh_prefix(), options) / "model.manifest.json"
    fresh.upload_if(first / "model.manifest.json", None)
    with pytest.raises(ConcurrentWriteError, match="there was none then"):
        fresh.upload_if(second / "model.manifest.json", None)
    etag = fresh.current_etag()
    fresh.upload_if(second / "model.manifest.json", etag)
    assert fresh.read_bytes() == (second / "model.manifest.json").read_bytes()


def test_a_re_save_finds_the_stale_files_of_an_encrypted_save_too():
    from tensorizer_manifest.storage.remote_checkpoint import _same_stem

    new = "model.1111111111111111.tensors"
    assert _same_stem("model.0123456789abcdef-fedcba9876543210.tensors", new)
    assert _same_stem("model.0123456789abcdef.tensors", "model.2222222222222222-3333333333333333.tensors")
    assert not _same_stem("model-tp1-of-2.0123456789abcdef-fedcba9876543210.tensors", new)  # another rank's


def test_http_reads_sizes_and_guessed_model_files(checkpoint, tmp_path):
    with RangeHTTPServer(checkpoint.parent) as server:
        d = RemoteDir(f"{server.url}/{checkpoint.name}")
        manifest = d / "model.manifest.json"
        data = (checkpoint / "model.manifest.json").read_bytes()
        assert manifest.size() == len(data) and manifest.read_bytes() == data
        assert b"".join(manifest.read_range(10, 60)) == data[10:60]
        with pytest.raises(RemoteNotFoundError):
            (d / "absent.json").size()
        with pytest.raises(ConfigurationError, match="cannot be listed"):
            d.list_names()
        with pytest.raises(ConfigurationError, match="read-only"):
            manifest.upload(checkpoint / "config.json")
        cache = fetch_model_files(str(d), tmp_path / "cache")
        assert sorted(p.name for p in cache.iterdir()) == ["config.json", "tokenizer.json"]
        with pytest.raises(RemoteNotFoundError, match="no config.json"):
            fetch_model_files(f"{server.url}/nowhere", tmp_path / "cache2")


def test_writing_to_http_is_refused(checkpoint):
    with pytest.raises(ConfigurationError, match="only s3://"):
        upload_checkpoint(checkpoint, "https://host/prefix")
