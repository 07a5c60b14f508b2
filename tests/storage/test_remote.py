"""Remote storage against real servers on 127.0.0.1: moto's S3 server (started and stopped by the session's
fixtures) and a plain HTTP server with Range support (a thread per test). Credentials from options,
from ~/.s3cfg and from AWS_* variables; each failure (missing object, refused credentials, unreachable
endpoint, a transfer cut short) its own typed error; no credential in a message or a repr."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from helpers.servers import BUCKET, RangeHTTPServer, closed_endpoint
from helpers.synthetic import write_synthetic_checkpoint

from tensorizer_manifest.errors import (
    CheckpointNotFoundError,
    ConcurrentWriteError,
    ConfigurationError,
    RemoteAccessError,
    RemoteNotFoundError,
    RemoteStorageError,
    RemoteUnreachableError,
)
from tensorizer_manifest.storage import remote
from tensorizer_manifest.storage.remote import (
    RemoteDir,
    RemoteFile,
    RemoteOptions,
    fetch_model_files,
    is_model_file,
    is_remote,
    transfer_error,
    upload_checkpoint,
)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    out = tmp_path / "ckpt"
    write_synthetic_checkpoint(out)
    (out / "config.json").write_text('{"model_type": "llama"}')
    (out / "tokenizer.json").write_text("{}")
    return out


def fresh_prefix(name: str = "t") -> str:
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


def options_for(server) -> RemoteOptions:
    return RemoteOptions(server.key_id, server.secret, server.endpoint)


def test_uris_are_recognised_and_refused_with_credentials_inside():
    assert is_remote("s3://bucket/p") and is_remote("HTTPS://host/p") and is_remote("http://h/x")
    assert not is_remote("./s3/bucket") and not is_remote(Path("s3://x")) and not is_remote("file:///x")
    with pytest.raises(ConfigurationError) as exc:
        RemoteDir("https://user:hunter2-password@host/prefix")
    assert "hunter2" not in str(exc.value) and "credentials may not be part of the URI" in str(exc.value)
    with pytest.raises(ConfigurationError):
        RemoteFile("https://host/model.manifest.json?X-Amz-Signature=abc")
    with pytest.raises(ConfigurationError):
        RemoteDir("s3:///no-bucket")


def test_remote_paths_behave_like_paths():
    d = RemoteDir("s3://bucket/a/b/")
    f = d / "model.manifest.json"
    assert str(d) == "s3://bucket/a/b" and str(f) == "s3://bucket/a/b/model.manifest.json"
    assert f.name == "model.manifest.json" and f.parent == d
    assert isinstance(remote.as_remote("s3://bucket/a/model.manifest.json"), RemoteFile)
    assert isinstance(remote.as_remote("s3://bucket/a"), RemoteDir)


def test_model_files_are_config_not_weights():
    assert is_model_file("config.json") and is_model_file("tokenizer.model")
    for name in ("model.safetensors", "model.abc.tensors", "model.manifest.json", ".hidden", "pytorch_model.bin"):
        assert not is_model_file(name)


def test_no_repr_or_str_shows_a_credential():
    options = RemoteOptions("AKIAEXAMPLEKEYID", "wJalrXUtnFEMI-secret", "http://127.0.0.1:1")
    for text in (repr(options), str(options), repr(RemoteFile("s3://b/x", options)), str(RemoteDir("s3://b", options))):
        assert "AKIAEXAMPLEKEYID" not in text and "wJalrXUtnFEMI-secret" not in text
    assert "<set>" in repr(options)


@pytest.mark.parametrize(
    "message, kind",
    [
        ("Failed to open stream: HTTP/1.1 404 Not Found", RemoteNotFoundError),
        ("Failed to open stream: HTTP/1.1 403 Forbidden", RemoteAccessError),
        ("Failed to open stream: cURL exit code 7; see https://curl.se/docs/manpage.html#7", RemoteUnreachableError),
        ("curl error: (18), see https://curl.se/docs/manpage.html#18", RemoteStorageError),
        ("Requested 1048576 != 5000", RemoteStorageError),
    ],
)
def test_curl_failures_are_classified(message, kind):
    error = transfer_error(OSError(message), "https://host/x", "reading it")
    assert type(error) is kind
    assert str(error).startswith("https://host/x: ")
    assert transfer_error(ValueError("not a transfer"), "https://host/x", "reading it") is None


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


def test_an_objects_ranged_reads_share_one_presigned_url_until_it_is_old(moto_s3, checkpoint, monkeypatch):
    """Making a presigned URL builds a boto3 client (tenths of a second): the checks' ranged reads of one object
    make it once, and again only after ``PRESIGNED_URL_REUSE_S``; the bytes are right either way."""
    from tensorizer import stream_io

    from tensorizer_manifest.storage import remote

    uri, options = fresh_prefix(), options_for(moto_s3)
    names = upload_checkpoint(checkpoint, uri, options)
    made: list[str] = []
    presign = stream_io._s3_download_url
    monkeypatch.setattr(stream_io, "_s3_download_url", lambda *a, **k: made.append(a[0]) or presign(*a, **k))
    tensors = RemoteDir(uri, options) / names[0]
    expected = (checkpoint / names[0]).read_bytes()
    for begin in (0, 1000, 2000):
        assert b"".join(tensors.read_range(begin, begin + 500)) == expected[begin : begin + 500]
    assert made == [str(tensors)]
    monkeypatch.setattr(remote, "PRESIGNED_URL_REUSE_S", 0.0)
    assert b"".join(tensors.read_range(10, 20)) == expected[10:20]
    assert made == [str(tensors)] * 2


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
    from tensorizer_manifest.storage.remote import _same_stem

    new = "model.1111111111111111.tensors"
    assert _same_stem("model.0123456789abcdef-fedcba9876543210.tensors", new)
    assert _same_stem("model.0123456789abcdef.tensors", "model.2222222222222222-3333333333333333.tensors")
    assert not _same_stem("model-tp1-of-2.0123456789abcdef-fedcba9876543210.tensors", new)  # another rank's


def test_credentials_from_s3cfg_and_from_the_environment(moto_s3, checkpoint, tmp_path, monkeypatch):
    uri = fresh_prefix()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / ".s3cfg").write_text(
        f"[default]\naccess_key = {moto_s3.key_id}\nsecret_key = {moto_s3.secret}\n"
        f"host_base = {moto_s3.endpoint.removeprefix('http://')}\nuse_https = False\n"
    )
    upload_checkpoint(checkpoint, uri)  # nothing given: ~/.s3cfg
    assert RemoteDir(uri).list_names()
    (home / ".s3cfg").unlink()
    for name, value in moto_s3.env().items():
        monkeypatch.setenv(name, value)
    assert (RemoteDir(uri) / "config.json").read_bytes() == (checkpoint / "config.json").read_bytes()


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


def test_writing_to_http_is_refused(checkpoint):
    with pytest.raises(ConfigurationError, match="only s3://"):
        upload_checkpoint(checkpoint, "https://host/prefix")


@pytest.mark.parametrize("num_readers", [1, 2])
def test_a_remote_read_of_one_form_skips_the_other(moto_s3, tmp_path, num_readers):
    """The loader names the tensors of each layer's chosen form; over S3 too only those arrive, intact."""
    from tensorizer_manifest.model.tensors import hash_tensor
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
