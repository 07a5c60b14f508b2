"""``storage/remote/failures.py``: each failure its own typed error naming the URI (curl's messages and exit
codes, S3's answers, timeouts), which of them are retried, and the backoff between attempts."""

from __future__ import annotations

import pytest

from tensorizer_manifest.errors import (
    RemoteAccessError,
    RemoteChangedError,
    RemoteNotFoundError,
    RemoteStalledError,
    RemoteStorageError,
    RemoteThrottledError,
    RemoteUnreachableError,
)
from tensorizer_manifest.storage.remote import failures, transfer_error


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


@pytest.mark.parametrize(
    "message, kind",
    [
        ("Failed to open stream: HTTP/1.1 503 Slow Down\r\n", RemoteThrottledError),
        ("Failed to open stream: HTTP/1.1 503 Service Unavailable\r\n", RemoteThrottledError),
        ("Failed to open stream: HTTP/1.1 429 Too Many Requests\r\n", RemoteThrottledError),
        ("Failed to open stream: HTTP/1.1 412 Precondition Failed\r\n", RemoteChangedError),
        ("Failed to open stream: HTTP/1.1 500 Internal Server Error\r\n", RemoteStorageError),
    ],
)
def test_throttling_and_replacement_answers_are_classified(message, kind):
    error = transfer_error(OSError(message), "s3://b/x.tensors", "opening it")
    assert type(error) is kind and str(error).startswith("s3://b/x.tensors: ")
    assert failures._transient(OSError(message)) == (kind is not RemoteChangedError)


def test_a_boto_slowdown_is_throttling():
    import botocore.exceptions

    answer = {"Error": {"Code": "SlowDown", "Message": "reduce"}, "ResponseMetadata": {"HTTPStatusCode": 503}}
    exc = botocore.exceptions.ClientError(answer, "HeadObject")
    assert failures._transient(exc)
    error = transfer_error(exc, "s3://b/x", "reading its size")
    assert isinstance(error, RemoteThrottledError) and "request rate" in str(error)
    denied = {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}
    assert not failures._transient(botocore.exceptions.ClientError(denied, "HeadObject"))


def test_backoff_grows_is_capped_and_jittered():
    delays = [failures._backoff(n) for n in range(1, 12)]
    assert all(failures.RETRY_BASE_DELAY_S / 2 <= d <= failures.RETRY_MAX_DELAY_S for d in delays)
    assert failures._backoff(3) >= failures.RETRY_BASE_DELAY_S * 2  # 4x base, half of it jitter
    assert len({round(failures._backoff(5), 6) for _ in range(20)}) > 1
    worst = sum(
        min(failures.RETRY_MAX_DELAY_S, failures.RETRY_BASE_DELAY_S * 2**n) for n in range(failures.RETRY_ATTEMPTS)
    )
    assert worst <= failures.RETRY_TOTAL_S  # the default attempts fit in the total time


@pytest.mark.parametrize(
    "message",
    [
        "curl error: (28)",
        "Failed to open stream: cURL exit code 28; see https://curl.se/docs/manpage.html#28",
        "socket",
        "boto",
    ],
)
def test_timeouts_are_stalls_and_never_retried(message):
    import botocore.exceptions

    exc: BaseException = OSError(message)
    if message == "socket":
        exc = TimeoutError("timed out")
    elif message == "boto":
        exc = botocore.exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:9/b/x?X-Amz-Signature=abc")
    error = transfer_error(exc, "s3://b/x.tensors", "reading it", 7.5)
    assert type(error) is RemoteStalledError and isinstance(error, RemoteStorageError)
    assert str(error).startswith("s3://b/x.tensors: the server sent nothing for 7.5 s while reading it"), error
    assert "X-Amz" not in str(error) and "Signature" not in str(error)
    assert not failures._transient(exc)
