"""``storage/remote/objects.py`` against real servers on 127.0.0.1: moto's S3 server (started and stopped by the
session's fixtures) and a plain HTTP server with Range support (a thread per test). Each failure (missing
object, refused credentials, unreachable endpoint, a transfer cut short) its own typed error; no credential
in a message; one version of an object read."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.remote import fresh_prefix, options_for, write_model_checkpoint
from helpers.servers import BUCKET, RangeHTTPServer, closed_endpoint
from helpers.synthetic import write_synthetic_checkpoint

from tensorizer_manifest.errors import (
    CheckpointNotFoundError,
    RemoteAccessError,
    RemoteChangedError,
    RemoteNotFoundError,
    RemoteStorageError,
    RemoteUnreachableError,
)
from tensorizer_manifest.storage.remote import RemoteDir, RemoteFile, RemoteOptions, as_remote, transfer_error
from tensorizer_manifest.storage.remote_checkpoint import upload_checkpoint


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return write_model_checkpoint(tmp_path / "ckpt")


def test_remote_paths_behave_like_paths():
    d = RemoteDir("s3://bucket/a/b/")
    f = d / "model.manifest.json"
    assert str(d) == "s3://bucket/a/b" and str(f) == "s3://bucket/a/b/model.manifest.json"
    assert f.name == "model.manifest.json" and f.parent == d
    assert isinstance(as_remote("s3://bucket/a/model.manifest.json"), RemoteFile)
    assert isinstance(as_remote("s3://bucket/a"), RemoteDir)


def test_a_file_keeps_the_first_version_it_sees():
    f = RemoteFile("s3://b/x.tensors")
    f._pin('"abc"', "reading its size")
    f._pin('W/"abc"', "opening it")  # the same version, marked weak by a cache in between
    assert f.etag == '"abc"'
    with pytest.raises(RemoteChangedError, match="s3://b/x.tensors: the object was replaced"):
        f._pin('"def"', "opening it")
    assert f.etag is None  # let go: the next read starts with the version there now
    http = RemoteFile("https://host/x.tensors")
    http._pin('"abc"', "opening it")
    assert http.etag is None  # over plain HTTP no version is kept (a CDN's nodes may differ)


def test_missing_objects_and_buckets(moto_s3):
    options = options_for(moto_s3)
    with pytest.raises(RemoteNotFoundError, match="no such object") as exc:
        RemoteFile(f"s3://{BUCKET}/nothing/here.json", options).size()
    assert isinstance(exc.value, CheckpointNotFoundError)  # callers that catch the local kind catch this too
    with pytest.raises(RemoteNotFoundError, match="no such bucket"):
        RemoteDir("s3://no-such-bucket/x", options).list_names()
    with pytest.raises(RemoteNotFoundError):
        RemoteFile(f"s3://{BUCKET}/nothing/here.json", options).read_bytes()


def test_wrong_credentials_are_refused_without_showing_them(moto_s3_auth, checkpoint):
    server = moto_s3_auth
    uri = fresh_prefix()
    upload_checkpoint(checkpoint, uri, options_for(server))  # the right key works
    wrong_secret = RemoteOptions(server.key_id, "not-the-secret-0123456789", server.endpoint)
    unknown_key = RemoteOptions("AKIAUNKNOWNKEY000000", "another-wrong-secret-42", server.endpoint)
    for options, reason in ((wrong_secret, "secret access key does not match"), (unknown_key, "not known")):
        for action in (
            lambda o=options: RemoteFile(f"{uri}/model.manifest.json", o).size(),
            lambda o=options: RemoteDir(uri, o).list_names(),
            lambda o=options: RemoteFile(f"{uri}/new.json", o).upload(checkpoint / "config.json"),
        ):
            with pytest.raises(RemoteAccessError) as exc:
                action()
            text = str(exc.value)
            assert isinstance(exc.value, PermissionError)
            # A HEAD answer has no body, so it cannot say which credential is wrong.
            assert "access denied" in text and (reason in text or "refused the credentials" in text), text
            for secret in (*options.secrets(), server.secret):
                assert secret not in text


def test_an_unreachable_endpoint_is_its_own_error():
    options = RemoteOptions("AKIAEXAMPLEKEYID", "secret-value-never-shown", closed_endpoint())
    with pytest.raises(RemoteUnreachableError, match="cannot be reached") as exc:
        RemoteFile("s3://bucket/x/model.manifest.json", options).size()
    assert isinstance(exc.value, ConnectionError) and "secret-value" not in str(exc.value)
    with pytest.raises(RemoteUnreachableError):
        RemoteFile(f"{closed_endpoint()}/x/config.json").size()


def test_a_server_that_ignores_ranges_is_refused(checkpoint):
    from helpers.servers import RangeHTTPServer as Server

    with Server(checkpoint.parent, ranges=False) as server:
        f = RemoteFile(f"{server.url}/{checkpoint.name}/model.manifest.json")
        with pytest.raises(RemoteStorageError, match="ignores HTTP range requests"):
            list(f.read_range(10, 20))


def test_a_transfer_cut_short_is_a_typed_error(checkpoint):
    tensors = next(checkpoint.glob("*.tensors"))
    with RangeHTTPServer(checkpoint.parent, cut_after=1000) as server:
        f = RemoteFile(f"{server.url}/{checkpoint.name}/{tensors.name}")
        with pytest.raises(RemoteStorageError) as exc:
            stream = f.open()
            try:
                while stream.read(1 << 16):
                    pass
            except Exception as cut:
                raise transfer_error(cut, str(f), "reading it") from None
        assert "cut short" in str(exc.value) or "closed the connection" in str(exc.value)


@pytest.mark.parametrize("num_readers", [1, 2])
def test_a_remote_read_of_one_form_skips_the_other(moto_s3, tmp_path, num_readers):
    """The loader names the tensors of each layer's chosen form; over S3 too only those arrive, intact."""
    from tensorizer_manifest.live_model.tensors import hash_tensor
    from tensorizer_manifest.storage.checkpoint import load_manifest
    from tensorizer_manifest.storage.tensor_file import TensorFileReader

    local = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    uri, options = fresh_prefix(), options_for(moto_s3)
    upload_checkpoint(local, uri, options)
    manifest, _ = load_manifest(local)
    own = {t.key: t for m in manifest.modules for t in m.tensors if t.key and not t.alias_of}
    fallbacks = {t.key: t for m in manifest.modules for t in m.fallback}
    layer = next(m for m in manifest.modules if m.fallback)
    chosen = {k: t for k, t in own.items() if not k.startswith(layer.path + ".")} | fallbacks
    with TensorFileReader(RemoteDir(uri, options) / manifest.tensor_file.path, num_readers=num_readers) as reader:
        got = dict(reader.stream(keys=chosen))
    assert sorted(got) == sorted(chosen)
    assert all(hash_tensor(got[k]) == t.hash for k, t in chosen.items())
