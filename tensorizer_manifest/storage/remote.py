"""Checkpoints in object storage: ``s3://`` and ``http(s)://`` URIs, credentials, ranged reads, uploads, listing.

The one module that talks to remote storage. Bytes move through tensorizer's
``stream_io`` (curl for reads, presigned for S3; its S3 upload for writes), so
a tensor file streams into ``TensorDeserializer`` exactly as tensorizer's own
loaders stream it. An S3 object's size and a prefix's listing come from boto3
(tensorizer's own S3 client library), with the same credentials and endpoint.

Credentials and endpoint are resolved the way tensorizer resolves them: given
options first (``s3_access_key_id``, ``s3_secret_access_key``, ``s3_endpoint``),
then ``~/.s3cfg`` (``access_key``, ``secret_key``, ``host_base``,
``use_https``), then boto3's chain (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, profiles) and ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL`` for the endpoint; no credentials at all reads a public
bucket unsigned. A URI never holds a credential, and no message, log or repr
this module makes shows one: failures are reported by kind (missing object,
refused credentials, unreachable endpoint, transfer cut short) with the URI.

A fleet loading from one bucket meets throttling and flaky servers: a request the server answers
"slow down" or "unavailable" (HTTP 429, 500, 502, 503, 504; S3's ``SlowDown``) is retried with
exponential backoff and jitter, within ``RETRY_ATTEMPTS`` attempts and ``RETRY_TOTAL_S`` seconds, then
fails as a ``RemoteThrottledError`` (or a ``RemoteStorageError`` for a 5xx). Only requests that have
not delivered a byte are retried (a HEAD, a listing, a stream's opening, a parallel reader's opening):
a stream cut mid-transfer is never resumed, it fails with a typed error. A ``RemoteFile`` reads one
version of its S3 object: the ETag of its first answer is kept, every later read carries
``If-Match`` with it, so an object replaced between two requests of one load (the checks' ranged
reads, the stream, tensorizer's parallel readers) fails at once as a ``RemoteChangedError`` instead of
mixing two versions' bytes; within one response the content hashes catch anything else. Every read
has a stall timeout (``STALL_TIMEOUT_S``, ``TENSORIZER_MANIFEST_STALL_TIMEOUT_S``, or
``RemoteOptions.stall_timeout_s``): a server that sends no byte for that long, its connection still open,
fails the read as a ``RemoteStalledError`` instead of hanging it.
"""

from __future__ import annotations

import configparser
import functools
import logging
import math
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar
from urllib.parse import urlsplit

from .._constants import STALL_TIMEOUT_ENV
from ..errors import (
    ConcurrentWriteError,
    ConfigurationError,
    IntegrityError,
    RemoteAccessError,
    RemoteChangedError,
    RemoteNotFoundError,
    RemoteStalledError,
    RemoteStorageError,
    RemoteThrottledError,
    RemoteUnreachableError,
    TensorizerManifestError,
    UnsafeStorageError,
)
from ..format.generation import POINTER_NAME, decode_pointer, generation_named
from ..format.schema import MANIFEST_SUFFIX, TENSORS_SUFFIX, blake3_hex
from . import tensorizer_names
from .tensorizer_names import OPEN_EXIT_CODE, OPEN_FAILED, READ_EXIT_CODE, SHORT_READ, StreamHooks

#: A pointer, generation document or model file fetched whole is refused above this (they hold no weights).
_MAX_DOCUMENT_BYTES = 64 << 20

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Option names that hold credentials (in ``model_loader_extra_config`` and save options): never logged.
CREDENTIAL_OPTIONS = frozenset({"s3_access_key_id", "s3_secret_access_key"})

#: URI schemes read (all) and written (``s3`` only) by this module.
SCHEMES = ("s3", "http", "https")

#: Files of a model directory that are weights, not configuration: never copied or fetched.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", TENSORS_SUFFIX, ".gguf", ".msgpack", ".h5", ".ckpt")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

#: Config and tokenizer files looked for over plain HTTP(S), which cannot list a directory.
HTTP_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)

#: Retries of a request the server answered "slow down" or "unavailable" (HTTP 429, 500, 502, 503, 504;
#: S3's SlowDown) before a byte of it was read: at most this many attempts in all ...
RETRY_ATTEMPTS = 5
#: ... waiting about this long before the first retry, twice as long before each next one (half of it
#: random, so a fleet's readers do not retry in step), at most ``RETRY_MAX_DELAY_S`` ...
RETRY_BASE_DELAY_S = 0.5
RETRY_MAX_DELAY_S = 8.0
#: ... and no retry that would start later than this many seconds after the first attempt.
RETRY_TOTAL_S = 30.0
#: Reads of an S3 object carry ``If-Match`` with the ETag first seen (its HEAD or first GET), and a later
#: answer with another ETag is refused, so a replaced object fails (HTTP 412) rather than being read as a
#: mix of two versions. False: no version is kept, as before (the content hashes still catch a mix).
CONDITIONAL_READS = True
#: A presigned S3 URL is made once per object and reused for this long (tensorizer's are valid a day or
#: more): making one builds a boto3 client, about 0.3 s on two busy cores, and the checks' ranged reads
#: make one request per run of tensor headers.
PRESIGNED_URL_REUSE_S = 3600.0
#: A read fails (``RemoteStalledError``, never retried) when the server sends no byte for this many seconds:
#: curl's ``--speed-limit 1 --speed-time`` (whole seconds) for streams and ranged reads, botocore's
#: ``read_timeout`` for HEADs and listings. curl averages its speed over the last 5 seconds, so a stream that
#: stops mid-transfer fails up to about 6 s later than that. ``TENSORIZER_MANIFEST_STALL_TIMEOUT_S`` or
#: ``RemoteOptions.stall_timeout_s`` set another (``RemoteOptions.stall_timeout`` is the one in effect).
STALL_TIMEOUT_S = 60.0

_CHUNK = 1 << 20
#: tensorizer's default endpoint (CoreWeave) when nothing names one, as ``stream_io`` does.
_DEFAULT_READ_ENDPOINT = "https://accel-object.ord1.coreweave.com"
_DEFAULT_WRITE_ENDPOINT = "https://object.ord1.coreweave.com"


def is_remote(location: object) -> bool:
    """Whether ``location`` is an ``s3://``, ``http://`` or ``https://`` URI (a string, or a remote object)."""
    if isinstance(location, RemoteFile | RemoteDir):
        return True
    if not isinstance(location, str):
        return False
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def is_model_file(name: str) -> bool:
    """A config, tokenizer or other non-weight file of a model directory (not a manifest, a pointer, hidden)."""
    return not (
        name.startswith(".")
        or name == POINTER_NAME
        or name.endswith(WEIGHT_SUFFIXES)
        or name in WEIGHT_INDEXES
        or name.endswith(MANIFEST_SUFFIX)
    )


@dataclass(frozen=True)
class RemoteOptions:
    """How to reach remote storage: credentials and endpoint given by the user (None: resolved as tensorizer does).

    Its repr shows whether each credential is set, never its value.
    """

    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    endpoint: str | None = None
    s3_config_path: str | None = None
    """An s3cmd config file to read instead of ``~/.s3cfg``."""
    stall_timeout_s: float | None = None
    """Seconds without a byte from the server before a read fails (None: ``TENSORIZER_MANIFEST_STALL_TIMEOUT_S``,
    else ``STALL_TIMEOUT_S``)."""

    def __post_init__(self) -> None:
        if self.stall_timeout_s is not None:
            _stall_seconds(self.stall_timeout_s, "stall_timeout_s")

    def __repr__(self) -> str:
        stall = "" if self.stall_timeout_s is None else f", stall_timeout_s={self.stall_timeout_s!r}"
        return (
            f"RemoteOptions(access_key_id={'<set>' if self.access_key_id else None}, "
            f"secret_access_key={'<set>' if self.secret_access_key else None}, endpoint={self.endpoint!r}{stall})"
        )

    __str__ = __repr__

    def secrets(self) -> tuple[str, ...]:
        """The credential values given, for tests and callers that scrub text."""
        return tuple(s for s in (self.access_key_id, self.secret_access_key) if s)

    def stall_timeout(self) -> float:
        """The stall timeout in effect: ``stall_timeout_s``, else ``TENSORIZER_MANIFEST_STALL_TIMEOUT_S``, else
        ``STALL_TIMEOUT_S`` (60 s). The one place that decides it."""
        if self.stall_timeout_s is not None:
            return float(self.stall_timeout_s)
        given = os.environ.get(STALL_TIMEOUT_ENV, "").strip()
        return _stall_seconds(given, STALL_TIMEOUT_ENV) if given else STALL_TIMEOUT_S


def _stall_seconds(value: object, name: str) -> float:
    """``value`` as a stall timeout: a finite number of seconds above 0, else a ``ConfigurationError`` naming it."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(f"{name}: a stall timeout is a number of seconds above 0, not {value!r}")
    return seconds


@dataclass(frozen=True)
class _Resolved:
    access_key_id: str | None = field(repr=False)
    secret_access_key: str | None = field(repr=False)
    endpoint: str
    stall_timeout_s: float = STALL_TIMEOUT_S

    def __repr__(self) -> str:
        return f"_Resolved(endpoint={self.endpoint!r})"


def _read_s3cfg(path: str | None) -> dict[str, str]:
    candidates = [path] if path else [os.path.expanduser("~/.s3cfg")]
    parser = configparser.ConfigParser()
    for candidate in candidates:
        try:
            if parser.read(candidate) and parser.has_section("default"):
                return dict(parser["default"])
        except configparser.Error:
            raise ConfigurationError(f"{candidate}: not a valid s3cmd config file") from None
    if path:
        raise ConfigurationError(f"{path}: no such s3cmd config file (or no [default] section)")
    return {}


def _with_scheme(endpoint: str, use_https: bool | None = None) -> str:
    if "://" in endpoint:
        return endpoint
    return ("http://" if use_https is False else "https://") + endpoint


def _resolve(options: RemoteOptions, write: bool = False) -> _Resolved:
    key_id, secret, endpoint = options.access_key_id, options.secret_access_key, options.endpoint
    if key_id is None or secret is None:
        cfg = _read_s3cfg(options.s3_config_path)
        key_id = key_id if key_id is not None else cfg.get("access_key") or None
        secret = secret if secret is not None else cfg.get("secret_key") or None
        if not endpoint and cfg.get("host_base"):
            use_https = {"True": True, "False": False}.get(cfg.get("use_https", ""))
            endpoint = _with_scheme(cfg["host_base"], use_https)
    if key_id is None or secret is None:
        import botocore.session

        found = botocore.session.Session().get_credentials()  # AWS_ACCESS_KEY_ID..., profiles
        if found is not None:
            frozen = found.get_frozen_credentials()
            key_id = key_id if key_id is not None else frozen.access_key
            secret = secret if secret is not None else frozen.secret_key
    if not endpoint:
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    if not endpoint:
        endpoint = _DEFAULT_WRITE_ENDPOINT if write else _DEFAULT_READ_ENDPOINT
    return _Resolved(key_id, secret, _with_scheme(endpoint), options.stall_timeout())


#: boto3 clients made in this process, by what they were made for (``_s3_client``).
_CLIENTS: dict[tuple[_Resolved, int], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _s3_client(resolved: _Resolved):
    """One boto3 client per endpoint, credentials and stall timeout in a process: making one takes about 0.3 s,
    and a client is safe to share between threads. A forked process makes its own (its parent's connections are
    not its own)."""
    key = (resolved, os.getpid())
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = _new_s3_client(resolved)
    return client


def _new_s3_client(resolved: _Resolved):
    import boto3
    import botocore
    from botocore.config import Config

    unsigned = not resolved.access_key_id and not resolved.secret_access_key
    config = Config(
        retries={"total_max_attempts": 1, "mode": "standard"},  # retried here (``_retrying``), in RETRY_* bounds
        connect_timeout=10,
        read_timeout=resolved.stall_timeout_s,  # no byte for this long: ReadTimeoutError, a RemoteStalledError
        **({"signature_version": botocore.UNSIGNED} if unsigned else {}),
    )
    return boto3.session.Session().client(
        "s3",
        endpoint_url=resolved.endpoint,
        config=config,
        **(
            {}
            if unsigned
            else {"aws_access_key_id": resolved.access_key_id, "aws_secret_access_key": resolved.secret_access_key}
        ),
    )


def _check_uri(uri: str) -> tuple[str, str, str]:
    """(scheme, netloc, path) of a URI this module accepts: no credentials, query or fragment in it."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigurationError(f"{uri!r}: not an s3://, http:// or https:// URI")
    if "@" in parts.netloc:
        raise ConfigurationError(
            f"{scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}: credentials may not be part of the URI; "
            "give them as options, environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or ~/.s3cfg"
        )
    if parts.query or parts.fragment:
        raise ConfigurationError(f"{scheme}://{parts.netloc}{parts.path}: a checkpoint URI has no query or fragment")
    if not parts.netloc:
        raise ConfigurationError(f"{uri!r}: no {'bucket' if scheme == 's3' else 'host'} in the URI")
    return scheme, parts.netloc, parts.path


# -- classifying failures ---------------------------------------------------------------------------------------

#: The HTTP status line tensorizer puts after ``OPEN_FAILED`` (HTTP's wording), and S3 errors' own.
_HTTP_STATUS = re.compile(r"HTTP/[\d.]+ (\d{3})")
#: curl's exit code in tensorizer's messages (``tensorizer_names``' fragments) and in curl's own ``curl: (N)``.
_CURL_EXIT = re.compile(rf"{re.escape(OPEN_EXIT_CODE)}(\d+)|{re.escape(READ_EXIT_CODE)}(\d+)\)|curl: \((\d+)\)")
#: curl exit codes that mean the endpoint was never reached, and those of a transfer cut short.
_CURL_UNREACHABLE = {5, 6, 7, 35, 60}
_CURL_CUT_SHORT = {18, 52, 55, 56, 92}
#: curl's "operation timed out": with the stall limit (``_stall_limit``), no byte for the stall timeout.
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
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " | ".join(text)


def _chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    cursor: BaseException | None = exc
    while cursor is not None and cursor not in chain:
        chain.append(cursor)
        cursor = cursor.__cause__ or cursor.__context__
    return chain


def _answer(exc: BaseException) -> tuple[str | None, int | None]:
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
    code, status = _answer(exc)
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
        return _changed(uri, doing)
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


def _changed(uri: str, doing: str) -> RemoteChangedError:
    return RemoteChangedError(
        f"{uri}: the object was replaced while {doing} (its ETag is not the one this read started with): "
        "nothing of the new version was mixed in, and the read is abandoned; load again once the upload "
        "that replaced it is complete"
    )


def _etag_value(etag: str) -> str:
    return etag.strip().removeprefix("W/").strip('"')


# -- streams ----------------------------------------------------------------------------------------------------


@functools.cache
def _curl_flags_class() -> type:
    """tensorizer's public way to put flags on curl's command line: ``stream_io.CAInfo``, given as
    ``certificate_handling`` (its ``curl_flags`` go on every curl a stream runs, kept by its forks and
    re-opens). A subclass whose flags are ours, not a certificate option: curl verifies certificates as
    by default."""
    from tensorizer import stream_io

    base = getattr(stream_io, "CAInfo", None)
    if not isinstance(base, type) or not isinstance(getattr(base, "curl_flags", None), property):
        raise ConfigurationError(  # pragma: no cover - another tensorizer
            "this tensorizer has no stream_io.CAInfo with curl_flags, through which remote reads get their "
            "stall timeout; install tensorizer>=2.10.1"
        )

    class _CurlFlags(base):  # type: ignore[valid-type, misc]
        __slots__ = ("_flags",)

        def __init__(self, *flags: str) -> None:  # CAInfo's asks for one certificate option; none is wanted
            self._flags = flags

        @property
        def curl_flags(self) -> tuple[str, ...]:
            return self._flags

        def __hash__(self) -> int:
            return hash(self._flags)

    return _CurlFlags


def _stall_limit(seconds: float) -> Any:
    """The ``certificate_handling`` of a stream with a stall timeout: curl exits with code 28 (``RemoteStalledError``)
    when fewer than 1 byte a second arrive for ``seconds`` (whole seconds, curl counts no finer; at least 1)."""
    return _curl_flags_class()("--speed-limit", "1", "--speed-time", str(max(1, math.ceil(seconds))))


# -- objects and prefixes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    """One object at a URI, and how to reach it; ``str()`` is its URI (never a credential)."""

    uri: str
    options: RemoteOptions = field(default_factory=RemoteOptions)
    _version: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    """The S3 ETag of the version this object reads (its first HEAD's or GET's), under ``"etag"``."""
    _presigned: dict[str, tuple[str, float]] = field(default_factory=dict, init=False, repr=False, compare=False)
    """The presigned URL of its GETs (a secret: never shown) and when it was made, under ``"url"``."""

    def __post_init__(self) -> None:
        _check_uri(self.uri)

    def __str__(self) -> str:
        return self.uri

    @property
    def scheme(self) -> str:
        return urlsplit(self.uri).scheme.lower()

    @property
    def etag(self) -> str | None:
        """The ETag of the version read (S3 only; None before the first request)."""
        return self._version.get("etag")

    def _pin(self, etag: str | None, doing: str) -> None:
        """Keep the first ETag seen; a later one that differs means the object was replaced."""
        if not etag or self.scheme != "s3" or not CONDITIONAL_READS:
            return
        pinned = self._version.setdefault("etag", etag)
        if _etag_value(pinned) != _etag_value(etag):  # a cache in between may mark it weak, or drop the quotes
            self._version.pop("etag", None)  # a later read (a new load) reads the new version
            raise _changed(self.uri, doing)

    def _check_version(self, stream: Any) -> None:
        """A stream's answer must be of the pinned version (a server that ignores ``If-Match``)."""
        headers = getattr(stream, "response_headers", None) or {}
        try:
            self._pin(headers.get("etag"), "opening it")
        except RemoteChangedError:
            stream.close()
            raise

    def _retrying(self, doing: str, attempt: Callable[[], _T]) -> _T:
        """``attempt()``, again after a throttled or transient failure (``RETRY_*`` bound it), else typed."""
        start, tries = time.monotonic(), 0
        while True:
            tries += 1
            try:
                return attempt()
            except Exception as exc:
                if not _transient(exc):
                    raise self._error(exc, doing) from None
                elapsed, delay = time.monotonic() - start, _backoff(tries)
                if tries >= RETRY_ATTEMPTS or elapsed + delay > RETRY_TOTAL_S:
                    typed = self._error(exc, doing)
                    raise type(typed)(f"{typed} ({tries} attempts over {elapsed:.1f} s)") from None
                code, status = _answer(exc)
                logger.warning(
                    "%s: the server answered %s while %s; retrying in %.1f s (attempt %d of %d)",
                    self.uri,
                    code or status or "with a dropped connection",
                    doing,
                    delay,
                    tries + 1,
                    RETRY_ATTEMPTS,
                )
                time.sleep(delay)

    @property
    def name(self) -> str:
        return self.uri.rstrip("/").rpartition("/")[2]

    @property
    def parent(self) -> RemoteDir:
        return RemoteDir(self.uri.rstrip("/").rpartition("/")[0], self.options)

    def _bucket_key(self) -> tuple[str, str]:
        _, netloc, path = _check_uri(self.uri)
        return netloc, path.lstrip("/")

    def _stream_kwargs(self, write: bool = False) -> dict[str, Any]:
        if self.scheme != "s3":
            return {}
        resolved = _resolve(self.options, write)
        unsigned = not resolved.access_key_id and not resolved.secret_access_key
        return {
            "s3_access_key_id": "" if unsigned else resolved.access_key_id,
            "s3_secret_access_key": "" if unsigned else resolved.secret_access_key,
            "s3_endpoint": resolved.endpoint,
            "force_http": resolved.endpoint.lower().startswith("http://"),
        }

    def _reachable(self) -> bool:
        """Whether a TCP connection to the server (the S3 endpoint, or the URI's host) can be made."""
        import socket

        try:
            target = urlsplit(_resolve(self.options).endpoint if self.scheme == "s3" else self.uri)
            port = target.port or (443 if target.scheme == "https" else 80)
            with socket.create_connection((target.hostname or "", port), timeout=5):
                return True
        except (OSError, ValueError):
            return False

    def size(self) -> int:
        """The object's size in bytes; a typed error when it is missing or cannot be reached."""
        if self.scheme == "s3":
            bucket, key = self._bucket_key()
            client = self._retrying("reading its size", lambda: _s3_client(_resolve(self.options)))
            head = self._retrying("reading its size", lambda: client.head_object(Bucket=bucket, Key=key))
            self._pin(head.get("ETag"), "reading its size")
            return int(head["ContentLength"])
        with self.open(0, 1) as stream:
            headers = getattr(stream, "response_headers", None) or {}
            total = (headers.get("content-range") or "").rpartition("/")[2]
            if total.isdigit():
                return int(total)
            length = headers.get("content-length")
            if length and length.isdigit() and int(length) != 1:  # the server ignored the range
                return int(length)
        raise RemoteStorageError(f"{self.uri}: the server does not say how large the object is")

    def exists(self) -> bool:
        try:
            self.size()
        except RemoteNotFoundError:
            return False
        return True

    def open(self, begin: int | None = None, end: int | None = None) -> BinaryIO:
        """A stream of the object (bytes ``begin`` to ``end``, end exclusive) from tensorizer's ``stream_io``.

        A range the server does not honour is refused (a reader must never get other bytes than it asked for).
        Opening is retried when the server throttles (``RETRY_*``); an S3 read asks for the version first
        seen (``If-Match``), so a replaced object is a ``RemoteChangedError``.
        """
        stream = self._retrying("opening it", lambda: self._open_once(begin, end))
        if begin:
            headers = getattr(stream, "response_headers", None) or {}
            if not headers.get("content-range"):
                stream.close()
                raise RemoteStorageError(
                    f"{self.uri}: the server ignores HTTP range requests, which reading a checkpoint needs"
                )
        return stream

    def _open_once(self, begin: int | None, end: int | None) -> BinaryIO:
        from tensorizer import stream_io

        cls = tensorizer_names.retrying_stream_class()
        presign = tensorizer_names.s3_download_url() if self.scheme == "s3" else None
        stall = _stall_limit(self.options.stall_timeout())
        if cls is None or (self.scheme == "s3" and presign is None):  # another tensorizer (warned): its plain stream
            return stream_io.open_stream(
                self.uri, "rb", begin=begin, end=end, certificate_handling=stall, **self._stream_kwargs()
            )
        headers = None
        url = self.uri
        if self.scheme == "s3":
            url = self._presigned_url(presign)
            etag = self.etag if CONDITIONAL_READS else None
            headers = {"If-Match": etag} if etag and not etag.startswith("W/") else None  # If-Match is strong
        stream = cls(url, begin=begin, end=end, headers=headers, certificate_handling=stall)
        stream.hooks = self._stream_hooks()
        self._check_version(stream)
        return stream

    def _stream_hooks(self) -> StreamHooks:
        """What a stream of this object asks of it: its re-opens and forks retried, their answers' version
        checked, a failed read typed (``tensorizer_names.retrying_stream_class``)."""
        return StreamHooks(
            retry_opening=lambda attempt: self._retrying("opening it", attempt),
            check_version=self._check_version,
            read_error=lambda failure: self._error(failure, "reading it"),
        )

    def _presigned_url(self, presign: Callable[..., str]) -> str:
        """What ``open_stream`` does for s3:// (tensorizer's presigned URL), made once per ``PRESIGNED_URL_REUSE_S``."""
        cached = self._presigned.get("url")
        if cached is not None and time.monotonic() - cached[1] < PRESIGNED_URL_REUSE_S:
            return cached[0]
        kwargs = self._stream_kwargs()
        url = presign(self.uri, kwargs["s3_access_key_id"], kwargs["s3_secret_access_key"], kwargs["s3_endpoint"])
        self._presigned["url"] = (url, time.monotonic())
        return url

    def read_range(self, begin: int, end: int) -> Iterator[bytes]:
        """Bytes ``begin`` to ``end`` in chunks; a transfer cut short is a ``RemoteStorageError``."""
        if end <= begin:
            return
        stream = self.open(begin, end)
        try:
            remaining = end - begin
            while remaining:
                try:
                    chunk = stream.read(min(remaining, _CHUNK))
                except Exception as exc:
                    raise self._error(exc, "reading it") from None
                if not chunk:
                    raise RemoteStorageError(
                        f"{self.uri}: the transfer ended {remaining} bytes early: the server closed the connection"
                    )
                remaining -= len(chunk)
                yield chunk
        finally:
            stream.close()

    def read_bytes(self, limit: int | None = None) -> bytes:
        """The whole object (at most ``limit`` bytes: a larger one is refused before it is read)."""
        size = self.size()
        if limit is not None and size > limit:
            raise RemoteStorageError(f"{self.uri}: {size} bytes, over the {limit} byte limit")
        return b"".join(self.read_range(0, size))

    def download(self, target: Path) -> None:
        """Copy the object to a local file, renamed into place when complete."""
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                for chunk in self.read_range(0, self.size()):
                    f.write(chunk)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    def upload(self, source: Path) -> None:
        """Write a local file to this S3 object through tensorizer's ``stream_io`` (visible once complete)."""
        if self.scheme != "s3":
            raise ConfigurationError(f"{self.uri}: only s3:// checkpoints can be written; http(s) is read-only")
        from tensorizer import stream_io

        try:
            stream = stream_io.open_stream(self.uri, "wb", **self._stream_kwargs(write=True))
            with open(source, "rb") as f:
                shutil.copyfileobj(f, stream, _CHUNK)
            stream.close()  # uploads
        except Exception as exc:
            raise self._error(exc, "uploading it") from None

    def put_bytes(self, body: bytes) -> None:
        """Write ``body`` (small: one request) to this S3 object, whatever is there (the top level's copies of a
        generation's model files: never what a load trusts)."""
        if self.scheme != "s3":
            raise ConfigurationError(f"{self.uri}: only s3:// checkpoints can be written; http(s) is read-only")
        bucket, key = self._bucket_key()
        client = self._retrying("uploading it", lambda: _s3_client(_resolve(self.options, write=True)))
        self._retrying("uploading it", lambda: client.put_object(Bucket=bucket, Key=key, Body=body))

    def upload_if(self, source: Path, replaces: str | None) -> None:
        """Write a small local file (a manifest) to this S3 object only if the object is still the version the
        writer started from: ``put_if`` with the file's bytes."""
        self.put_if(Path(source).read_bytes(), replaces)

    def put_if(self, body: bytes, replaces: str | None) -> str | None:
        """Write ``body`` (small: one request) to this S3 object only if the object is still the version the writer
        started from: ETag ``replaces``, or none at all when ``replaces`` is None (create only) (S3's conditional
        writes, ``If-Match`` / ``If-None-Match: *``). Otherwise ``ConcurrentWriteError``, and nothing is written.
        Returns the new version's ETag. A server that ignores the conditions writes unconditionally: the last
        writer wins (``probe_conditional_writes`` finds such a server before a checkpoint is written)."""
        if self.scheme != "s3":
            raise ConfigurationError(f"{self.uri}: only s3:// checkpoints can be written; http(s) is read-only")
        bucket, key = self._bucket_key()
        condition = {"IfNoneMatch": "*"} if replaces is None else {"IfMatch": replaces}
        client = self._retrying("uploading it", lambda: _s3_client(_resolve(self.options, write=True)))
        written: dict[str, str | None] = {}

        def put() -> bool:  # False: the condition failed (another writer's version is there)
            import botocore.exceptions

            try:
                answer = client.put_object(Bucket=bucket, Key=key, Body=body, **condition)
            except botocore.exceptions.ClientError as exc:
                code, status = _answer(exc)
                if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return False
                raise
            written["etag"] = answer.get("ETag")
            return True

        if not self._retrying("uploading it", put):
            raise ConcurrentWriteError(
                f"{self.uri}: another writer replaced it since this one read it ("
                + ("there was none then" if replaces is None else f"ETag {replaces} then")
                + "); nothing of this write was committed: read the checkpoint again and re-run it"
            )
        return written.get("etag")

    def current_etag(self) -> str | None:
        """The object's ETag now (a HEAD; None when there is none): what a conditional write replaces."""
        bucket, key = self._bucket_key()
        client = self._retrying("reading its version", lambda: _s3_client(_resolve(self.options)))
        try:
            head = self._retrying("reading its version", lambda: client.head_object(Bucket=bucket, Key=key))
        except RemoteNotFoundError:
            return None
        return head.get("ETag")

    def delete(self) -> None:
        """Remove this S3 object (S3 says nothing when it was already gone)."""
        if self.scheme != "s3":
            raise ConfigurationError(f"{self.uri}: only s3:// objects can be removed; http(s) is read-only")
        bucket, key = self._bucket_key()
        client = self._retrying("removing it", lambda: _s3_client(_resolve(self.options, write=True)))
        self._retrying("removing it", lambda: client.delete_object(Bucket=bucket, Key=key))

    def _error(self, exc: BaseException, doing: str) -> TensorizerManifestError:
        typed = transfer_error(exc, self.uri, doing, self.options.stall_timeout())
        if type(typed) is RemoteStorageError and not self._reachable():
            return RemoteUnreachableError(
                f"{self.uri}: the server cannot be reached while {doing}: check the endpoint and the network"
            )
        if typed is not None:
            return typed
        if isinstance(exc, ConfigurationError):
            return exc
        if isinstance(exc, ValueError) and "endpoint" in str(exc).lower():
            return ConfigurationError(f"{self.uri}: the S3 endpoint is not usable: {exc}")
        return RemoteStorageError(f"{self.uri}: {doing} failed ({type(exc).__name__})")


@dataclass(frozen=True)
class RemoteDir:
    """A prefix (``s3://bucket/prefix``, ``https://host/path``) holding a checkpoint's files."""

    uri: str
    options: RemoteOptions = field(default_factory=RemoteOptions)

    def __post_init__(self) -> None:
        _check_uri(self.uri)
        object.__setattr__(self, "uri", self.uri.rstrip("/"))

    def __str__(self) -> str:
        return self.uri

    def __truediv__(self, name: str) -> RemoteFile:
        return RemoteFile(f"{self.uri}/{name}", self.options)

    @property
    def scheme(self) -> str:
        return urlsplit(self.uri).scheme.lower()

    def list_names(self) -> list[str]:
        """The names of the objects directly under the prefix, sorted (S3 only: HTTP cannot list)."""
        if self.scheme != "s3":
            raise ConfigurationError(f"{self.uri}: an http(s) location cannot be listed; name the file instead")
        _, bucket, path = _check_uri(self.uri)
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        here = RemoteFile(self.uri, self.options)

        def listing() -> list[str]:  # whole, from its first page, on each attempt
            names: list[str] = []
            paginator = _s3_client(_resolve(self.options)).get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
                names += [item["Key"][len(prefix) :] for item in page.get("Contents", ())]
            return names

        return sorted(n for n in here._retrying("listing it", listing) if n and "/" not in n)


def list_objects(location: RemoteDir) -> list[tuple[str, float]]:
    """Every object under the prefix, at any depth: (its name below the prefix, its ``LastModified`` as seconds
    since the epoch, by the server's clock) (S3 only)."""
    if location.scheme != "s3":
        raise ConfigurationError(f"{location.uri}: an http(s) location cannot be listed; name the file instead")
    _, bucket, path = _check_uri(location.uri)
    prefix = path.strip("/") + "/" if path.strip("/") else ""
    here = RemoteFile(location.uri, location.options)

    def listing() -> list[tuple[str, float]]:
        found: list[tuple[str, float]] = []
        paginator = _s3_client(_resolve(location.options)).get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            found += [
                (item["Key"][len(prefix) :], item["LastModified"].timestamp()) for item in page.get("Contents", ())
            ]
        return found

    return sorted(here._retrying("listing it", listing))


#: Endpoints and buckets whose conditional writes were probed in this process, and what the probe found.
_PROBED: dict[tuple[str | None, str], bool] = {}


def probe_conditional_writes(location: RemoteDir, allow_unconditional: bool = False) -> None:
    """Refuse to write where the server ignores conditional writes (``UnsafeStorageError``), unless
    ``allow_unconditional``: a second ``If-None-Match: *`` PUT of a scratch key under the prefix, and an
    ``If-Match`` PUT with a wrong ETag, must both be refused. Once per endpoint and bucket in a process."""
    _, bucket, _ = _check_uri(location.uri)
    endpoint = _resolve(location.options, write=True).endpoint
    if (endpoint, bucket) not in _PROBED:
        scratch = location / f".tensorizer-manifest-probe-{os.urandom(8).hex()}"
        scratch.put_if(b"probe", None)
        honoured = True
        try:
            for replaces in (None, '"00000000000000000000000000000000"'):
                try:
                    scratch.put_if(b"probe again", replaces)
                    honoured = False
                except ConcurrentWriteError:
                    pass
        finally:
            scratch.delete()
        _PROBED[(endpoint, bucket)] = honoured
    if not _PROBED[(endpoint, bucket)] and not allow_unconditional:
        raise UnsafeStorageError(
            f"{location.uri}: this S3 server ({endpoint or 'the default endpoint'}) ignores conditional writes "
            "(If-Match, If-None-Match), so two writers of one checkpoint could silently undo each other; nothing was "
            "written. Use a server that honours them, or pass allow_unconditional_writes "
            "(--allow-unconditional-writes) to accept that the last writer wins"
        )


def as_remote(location: str | RemoteFile | RemoteDir, options: RemoteOptions | None = None) -> RemoteFile | RemoteDir:
    """A URI as a file (its name ends in ``.manifest.json`` or ``.tensors``) or as a checkpoint prefix."""
    if isinstance(location, RemoteFile | RemoteDir):
        return location
    options = options or RemoteOptions()
    if location.rstrip("/").endswith((MANIFEST_SUFFIX, TENSORS_SUFFIX)):
        return RemoteFile(location.rstrip("/"), options)
    return RemoteDir(location, options)


# -- whole checkpoints ------------------------------------------------------------------------------------------


def upload_checkpoint(
    local_dir: Path, uri: str, options: RemoteOptions | None = None, allow_unconditional_writes: bool = False
) -> list[str]:
    """Upload a saved checkpoint: tensor files first, then config and tokenizer files, manifests last.

    So a reader that finds a manifest finds its tensor file beside it. Then the tensor files an earlier
    save to the same prefix left (same stem, another content digest, named by no manifest any more) are
    removed, as a local re-save removes them. Returns the names uploaded.
    """
    target = RemoteDir(uri, options or RemoteOptions())
    if target.scheme != "s3":
        raise ConfigurationError(f"{uri}: only s3:// checkpoints can be written; http(s) is read-only")
    if (Path(local_dir) / "tensorizer-manifest.json").is_file():
        raise ConfigurationError(
            f"{local_dir}: a checkpoint of format version 3; save it to {uri} directly "
            "(`tensorizer-manifest save SRC s3://... --format-version 3`), which commits its generation there"
        )
    probe_conditional_writes(target, allow_unconditional_writes)
    files = sorted(p for p in Path(local_dir).iterdir() if p.is_file() and not p.name.startswith("."))
    tensors = [p for p in files if p.name.endswith(TENSORS_SUFFIX)]
    manifests = [p for p in files if p.name.endswith(MANIFEST_SUFFIX)]
    others = [p for p in files if p not in tensors and p not in manifests]
    replaces = {p.name: (target / p.name).current_etag() for p in manifests}  # what this upload may replace
    for path in [*tensors, *others]:
        (target / path.name).upload(path)
    for path in manifests:  # each a compare-and-swap on the one found above
        (target / path.name).upload_if(path, replaces[path.name])
    uploaded = {p.name for p in tensors}
    for name in target.list_names():
        if name not in uploaded and any(_same_stem(name, new) for new in uploaded):
            (target / name).delete()
    return [p.name for p in [*tensors, *others, *manifests]]


def _same_stem(name: str, tensor_file: str) -> bool:
    """Whether ``name`` is a tensor file of the same rank as ``tensor_file`` (``{stem}.{16 hex}.tensors``, or
    ``{stem}.{16 hex}-{16 hex}.tensors`` when encrypted)."""
    pattern = r"(.+)\.[0-9a-f]{16}(?:-[0-9a-f]{16})?" + re.escape(TENSORS_SUFFIX)
    ours, theirs = re.fullmatch(pattern, tensor_file), re.fullmatch(pattern, name)
    return bool(ours and theirs and ours.group(1) == theirs.group(1))


def model_file_names(location: RemoteDir) -> Iterable[str]:
    """Config and tokenizer files to look for under a prefix: listed on S3, the usual names over HTTP."""
    if location.scheme == "s3":
        return [n for n in location.list_names() if is_model_file(n)]
    return HTTP_MODEL_FILES


def fetch_model_files(uri: str, cache_dir: str | os.PathLike, options: RemoteOptions | None = None) -> Path:
    """Download a remote checkpoint's config and tokenizer files (no weights, no manifest) into ``cache_dir``.

    vLLM's ``model`` must be a local directory or a Hugging Face id; start it with
    ``LLM(model=<this directory>, load_format="tensorizer_manifest",
    model_loader_extra_config={"checkpoint_dir": uri})``. Returns ``cache_dir``.
    """
    location = RemoteDir(uri, options or RemoteOptions())
    cache = Path(cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    if _fetch_generation_model_files(location, cache):
        return cache
    fetched = []
    for name in model_file_names(location):
        try:
            (location / name).download(cache / name)
        except RemoteNotFoundError:
            if location.scheme == "s3":
                raise
            continue  # over HTTP the names are guesses
        fetched.append(name)
    if "config.json" not in fetched:
        raise RemoteNotFoundError(f"{location}: no config.json there; is it a checkpoint saved with its config?")
    return cache


def _fetch_generation_model_files(location: RemoteDir, cache: Path) -> bool:
    """A checkpoint of format version 3: its current generation's own model files, each checked against the hash
    the generation records (the copies at the top are never trusted). False: no pointer there (versions 1, 2)."""
    pointer_file = location / POINTER_NAME
    try:
        pointer = decode_pointer(pointer_file.read_bytes(_MAX_DOCUMENT_BYTES), str(pointer_file))
    except RemoteNotFoundError:
        return False
    document = location / pointer.document
    generation = generation_named(pointer, document.read_bytes(_MAX_DOCUMENT_BYTES), str(document))
    for model_file in generation.model_files:
        source = location / model_file.file.path
        data = source.read_bytes(_MAX_DOCUMENT_BYTES)
        if blake3_hex(data) != model_file.file.hash:
            raise IntegrityError(
                f"{source}: not the bytes generation {generation.id} records for {model_file.name} (damaged, or "
                "replaced): save the checkpoint again"
            )
        tmp = cache / f".{model_file.name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, cache / model_file.name)
    return True
