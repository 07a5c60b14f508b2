"""``storage/remote/curl_stream.py``: tensorizer's streams with the stall timeout on curl's command line, and
one presigned URL per object (against moto's S3 server on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.remote import fresh_prefix, options_for, write_model_checkpoint

from tensorizer_manifest.storage.remote import RemoteDir, curl_stream
from tensorizer_manifest.storage.remote_checkpoint import upload_checkpoint


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return write_model_checkpoint(tmp_path / "ckpt")


def test_the_stall_timeout_is_curls_speed_limit():
    assert curl_stream.stall_limit(2.5).curl_flags == ("--speed-limit", "1", "--speed-time", "3")  # streams, ranges
    assert curl_stream.stall_limit(0.2).curl_flags[-1] == "1"


def test_an_objects_ranged_reads_share_one_presigned_url_until_it_is_old(moto_s3, checkpoint, monkeypatch):
    """Making a presigned URL builds a boto3 client (tenths of a second): the checks' ranged reads of one object
    make it once, and again only after ``PRESIGNED_URL_REUSE_S``; the bytes are right either way."""
    from tensorizer import stream_io

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
    monkeypatch.setattr(curl_stream, "PRESIGNED_URL_REUSE_S", 0.0)
    assert b"".join(tensors.read_range(10, 20)) == expected[10:20]
    assert made == [str(tensors)] * 2
