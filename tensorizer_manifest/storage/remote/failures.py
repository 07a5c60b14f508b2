"""What a failed remote request was, and whether it is worth another attempt: the typed errors of remote
storage, and the retries of throttled requests.

A failure is reported by kind (missing object, refused credentials, unreachable endpoint, throttling, a
replaced object, a stall, a transfer cut short) with the URI, never with the exception's own text: a
presigned URL carries the access key's id, and no message or log line made here shows a credential.

A fleet loading from one bucket meets throttling and flaky servers: a request the server answers
"slow down" or "unavailable" (HTTP 429, 500, 502, 503, 504; S3's ``SlowDown``) is retried with
exponential backoff and jitter, within ``RETRY_ATTEMPTS`` attempts and ``RETRY_TOTAL_S`` seconds, then
fails as a ``RemoteThrottledError`` (or a ``RemoteStorageError`` for a 5xx). Only requests that have
not delivered a byte are retried (a HEAD, a listing, a stream's opening, a parallel reader's opening):
a stream cut mid-transfer is never resumed, it fails with a typed error.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable
from typing import TypeVar

from ..._constants import STALL_TIMEOUT_ENV
from ...errors import (
    RemoteAccessError,
    RemoteChangedError,
    RemoteNotFoundError,
    RemoteStalledError,
    RemoteStorageError,
    RemoteThrottledError,
    RemoteUnreachableError,
    TensorizerManifestError,
)
from ..tensorizer_names import OPEN_EXIT_CODE, OPEN_FAILED, READ_EXIT_CODE, SHORT_READ

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Retries of a request the server answered "slow down" or "unavailable" (HTTP 429, 500, 502, 503, 504;
#: S3's SlowDown) before a byte of it was read: at most this many attempts in all ...
RETRY_ATTEMPTS = 5
#: ... waiting about this long before the first retry, twice as long before each next one (half of it
#: random, so a fleet's readers do not retry in step), at most ``RETRY_MAX_DELAY_S`` ...
RETRY_BASE_DELAY_S = 0.5
RETRY_MAX_DELAY_S = 8.0
#: ... and no retry that would start later than this many seconds after the first attempt.
RETRY_TOTAL_S = 30.0

#: The HTTP status line tensorizer puts after ``OPEN_FAILED`` (HTTP's wording), and S3 errors' own.
_HTTP_STATUS = re.compile(r"HTTP/[\d.]+ (\d{3})")
#: curl's exit code in tensorizer's messages (``tensorizer_names``' fragments) and in curl's own ``curl: (N)``.
_CURL_EXIT = re.compile(rf"{re.escape(OPEN_EXIT_CODE)}(\d+)|{re.escape(READ_EXIT_CODE)}(\d+)\)|curl: \((\d+)\)")
#: curl exit codes that mean the endpoint was never reached, and those of a transfer cut short.
_CURL_UNREACHABLE = {5, 6, 7, 35, 60}
_CURL_CUT_SHORT = {18, 52, 55, 56, 92}
#: curl's "operation timed out": with the stall limit (``curl_stream.stall_limit``), no byte for the stall timeout.
_CURL_STALLED = 28
#: S3 error codes and HTTP statuses of a server that asks to slow down or is busy: retried, then typed.
_THROTTLE_CODES = frozenset(
    {"SlowDown", "ServiceUnavailable", "RequestLimitExceeded", "Throttling", "ThrottlingException", "TooManyRequests"}
)
_THROTTLE_STATUS = frozenset({429, 503})
#: Other answers worth a retry: a server failing transiently (S3 asks clients to retry InternalError).
_TRANSIENT_STATUS = frozenset({500, 502, 504})
_TRANSIENT_CODES = frozenset({"InternalError", "RequestTimeout"})


def _messages(exc: BaseException) -> str:
    seen, text = set(), []
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        text.append(f"{type(link).__name__}: {link}")
        link = link.__cause__ or link.__context__
    return " | ".join(text)


def _chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    cursor: BaseException | None = exc
    while cursor is not None and cursor not in chain:
        chain.append(cursor)
        cursor = cursor.__cause__ or cursor.__context__
    return chain


def answer(exc: BaseException) -> tuple[str | None, int | None]:
    """The S3 error code and HTTP status a failed request got, as far as ``exc`` tells them."""
    import botocore.exceptions

    for item in _chain(exc):
        if isinstance(item, botocore.exceptions.ClientError):
            error = item.response.get("Error", {})
            return error.get("Code"), item.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    match = _HTTP_STATUS.search(_messages(exc))
    return None, int(match.group(1)) if match else None


def _transient(exc: BaseException) -> bool:
    """Whether a request that failed so, before delivering a byte, is worth another attempt."""
    import botocore.exceptions

    if isinstance(exc, RemoteThrottledError):
        return True
    if isinstance(exc, RemoteStorageError):
        return False
    if any(isinstance(item, botocore.exceptions.ConnectionClosedError) for item in _chain(exc)):
        return True  # the connection dropped before an answer (a HEAD or a listing: nothing consumed)
    code, status = answer(exc)
    return (
        str(code) in _THROTTLE_CODES
        or str(code) in _TRANSIENT_CODES
        or status in _THROTTLE_STATUS
        or status in _TRANSIENT_STATUS
    )


def _backoff(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (1, 2, ...): exponential, capped, half of it jitter."""
    delay = min(RETRY_MAX_DELAY_S, RETRY_BASE_DELAY_S * 2 ** (attempt - 1))
    return delay / 2 + random.uniform(0, delay / 2)


def retrying(
    uri: str,
    doing: str,
    attempt: Callable[[], _T],
    error: Callable[[BaseException, str], TensorizerManifestError],
) -> _T:
    """``attempt()``, again after a throttled or transient failure (``RETRY_*`` bound it), else typed:
    ``error(exc, doing)`` is raised (the object's own classification, ``RemoteFile._error``)."""
    start, tries = time.monotonic(), 0
    while True:
        tries += 1
        try:
            return attempt()
        except Exception as exc:
            if not _transient(exc):
                raise error(exc, doing) from None
            elapsed, delay = time.monotonic() - start, _backoff(tries)
            if tries >= RETRY_ATTEMPTS or elapsed + delay > RETRY_TOTAL_S:
                typed = error(exc, doing)
                raise type(typed)(f"{typed} ({tries} attempts over {elapsed:.1f} s)") from None
            code, status = answer(exc)
            logger.warning(
                "%s: the server answered %s while %s; retrying in %.1f s (attempt %d of %d)",
                uri,
                code or status or "with a dropped connection",
                doing,
                delay,
                tries + 1,
                RETRY_ATTEMPTS,
            )
            time.sleep(delay)


def transfer_error(
    exc: BaseException, uri: str, doing: str, stall_timeout_s: float | None = None
) -> RemoteStorageError | None:
    """The typed error for a failed remote transfer, or None when ``exc`` is not one.

    The message names the URI and the kind of failure, never the exception's own
    text (a presigned URL carries the access key's id). ``stall_timeout_s``: the stall
    timeout the read had, named in a ``RemoteStalledError``.
    """
    import botocore.exceptions

    for item in _chain(exc):  # ours, raised inside tensorizer by a stream's read (``_RemoteStream``)
        if isinstance(item, RemoteStorageError):
            return item
    code, status = None, None
    chain = _chain(exc)
    for item in chain:
        if isinstance(item, botocore.exceptions.ClientError):
            error = item.response.get("Error", {})
            code = error.get("Code")
            status = item.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            break
        if isinstance(item, botocore.exceptions.EndpointConnectionError | botocore.exceptions.ConnectTimeoutError):
            return RemoteUnreachableError(
                f"{uri}: the storage endpoint cannot be reached while {doing} (check s3_endpoint / "
                "AWS_ENDPOINT_URL / host_base in ~/.s3cfg, and the network)"
            )
        if isinstance(item, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError):
            return RemoteAccessError(f"{uri}: no usable S3 credentials while {doing}")
        if isinstance(item, botocore.exceptions.ReadTimeoutError | TimeoutError):  # a socket's read timeout
            return _stalled(uri, doing, stall_timeout_s)
    text = _messages(exc)
    if status is None:
        match = _HTTP_STATUS.search(text)
        if match:
            status = int(match.group(1))
    if status is None and code is None:
        curl = _CURL_EXIT.search(text)
        if curl is not None:
            exit_code = int(next(g for g in curl.groups() if g))
            if exit_code == _CURL_STALLED:
                return _stalled(uri, doing, stall_timeout_s)
            if exit_code in _CURL_UNREACHABLE:
                return RemoteUnreachableError(
                    f"{uri}: the server cannot be reached while {doing} (curl exit code {exit_code}): "
                    "check the endpoint and the network"
                )
            if exit_code == 22:  # curl -f: an HTTP error it did not show
                status = 400
            elif exit_code in _CURL_CUT_SHORT:
                return RemoteStorageError(
                    f"{uri}: the transfer was cut short while {doing} (curl exit code {exit_code}): "
                    "the server closed the connection or stopped answering"
                )
            else:
                return RemoteStorageError(
                    f"{uri}: the transfer failed while {doing} (curl exit code {exit_code}): "
                    "the server closed the connection or stopped answering"
                )
    if str(code) in ("PreconditionFailed", "412") or status == 412:
        return changed(uri, doing)
    if str(code) in _THROTTLE_CODES or status in _THROTTLE_STATUS:
        return RemoteThrottledError(
            f"{uri}: the server is throttling requests (it answered {code or status}, slow down) while {doing}: "
            "try again later, or lower the request rate (fewer readers at once, staggered starts)"
        )
    if str(code) in ("NoSuchKey", "NoSuchBucket", "404", "NotFound") or status == 404:
        what = "bucket" if code == "NoSuchBucket" else "object"
        return RemoteNotFoundError(f"{uri}: no such {what} (while {doing})")
    if str(code) in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden") or status in (
        401,
        403,
    ):
        reason = {
            "InvalidAccessKeyId": "the access key id is not known to the server",
            "SignatureDoesNotMatch": "the secret access key does not match the access key id",
        }.get(str(code), "the server refused the credentials, or they do not grant this access")
        return RemoteAccessError(
            f"{uri}: access denied while {doing} ({reason}); check s3_access_key_id / s3_secret_access_key, "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.s3cfg"
        )
    if status is not None or code is not None:
        return RemoteStorageError(f"{uri}: the server answered {code or status} while {doing}")
    if OPEN_FAILED in text:
        return RemoteStorageError(f"{uri}: the server gave no answer while {doing}")
    if isinstance(exc, OSError | EOFError) or SHORT_READ in text:
        return RemoteStorageError(
            f"{uri}: the transfer was cut short while {doing}: the server closed the connection or stopped answering"
        )
    return None


def _stalled(uri: str, doing: str, stall_timeout_s: float | None) -> RemoteStalledError:
    waited = f"{stall_timeout_s:g} s" if stall_timeout_s is not None else "the stall timeout"
    return RemoteStalledError(
        f"{uri}: the server sent nothing for {waited} while {doing}, its connection still open: check the "
        f"server and the network to it; if it is only slow, raise the stall timeout ({STALL_TIMEOUT_ENV}, "
        "or RemoteOptions.stall_timeout_s)"
    )


def changed(uri: str, doing: str) -> RemoteChangedError:
    """The error of an object replaced while it was read (another ETag than the one the read started with)."""
    return RemoteChangedError(
        f"{uri}: the object was replaced while {doing} (its ETag is not the one this read started with): "
        "nothing of the new version was mixed in, and the read is abandoned; load again once the upload "
        "that replaced it is complete"
    )
