"""How to reach remote storage: ``RemoteOptions`` (credentials, endpoint, stall timeout), how they are resolved,
and the boto3 clients made with them.

Credentials and endpoint are resolved the way tensorizer resolves them: given
options first (``s3_access_key_id``, ``s3_secret_access_key``, ``s3_endpoint``),
then ``~/.s3cfg`` (``access_key``, ``secret_key``, ``host_base``,
``use_https``), then boto3's chain (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, profiles) and ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL`` for the endpoint; no credentials at all reads a public
bucket unsigned. No repr made here shows a credential, only whether it is set.

Every read has a stall timeout (``STALL_TIMEOUT_S``, ``TENSORIZER_MANIFEST_STALL_TIMEOUT_S``, or
``RemoteOptions.stall_timeout_s``; ``RemoteOptions.stall_timeout`` decides which): a boto3 client made here
has it as its read timeout, a stream as curl's (``curl_stream.stall_limit``).
"""

from __future__ import annotations

import configparser
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from ..._constants import STALL_TIMEOUT_ENV
from ...errors import ConfigurationError

#: Option names that hold credentials (in ``model_loader_extra_config`` and save options): never logged.
CREDENTIAL_OPTIONS = frozenset({"s3_access_key_id", "s3_secret_access_key"})

#: The S3 options' help, declared once: the option models' descriptions (``storage.option_models.S3Options``) and the
#: light commands' ``--s3-*`` options (``cli.parameters.remote_options``), which must not import pydantic.
S3_OPTIONS_HELP = {
    "s3_access_key_id": "S3 access key id for an s3:// checkpoint (else ~/.s3cfg, else $AWS_ACCESS_KEY_ID).",
    "s3_secret_access_key": "S3 secret access key (else ~/.s3cfg, else $AWS_SECRET_ACCESS_KEY; prefer those: "
    "a command line is visible to other users).",
    "s3_endpoint": "S3 endpoint URL (else host_base in ~/.s3cfg, else $AWS_ENDPOINT_URL).",
}

#: A read fails (``RemoteStalledError``, never retried) when the server sends no byte for this many seconds:
#: curl's ``--speed-limit 1 --speed-time`` (whole seconds) for streams and ranged reads, botocore's
#: ``read_timeout`` for HEADs and listings. curl averages its speed over the last 5 seconds, so a stream that
#: stops mid-transfer fails up to about 6 s later than that. ``TENSORIZER_MANIFEST_STALL_TIMEOUT_S`` or
#: ``RemoteOptions.stall_timeout_s`` set another (``RemoteOptions.stall_timeout`` is the one in effect).
STALL_TIMEOUT_S = 60.0

#: tensorizer's default endpoint (CoreWeave) when nothing names one, as ``stream_io`` does.
_DEFAULT_READ_ENDPOINT = "https://accel-object.ord1.coreweave.com"
_DEFAULT_WRITE_ENDPOINT = "https://object.ord1.coreweave.com"


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


def resolve(options: RemoteOptions, write: bool = False) -> _Resolved:
    """The credentials, endpoint and stall timeout ``options`` come to, resolved as tensorizer resolves them."""
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


#: boto3 clients made in this process, by what they were made for (``s3_client``).
_CLIENTS: dict[tuple[_Resolved, int], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def s3_client(resolved: _Resolved):
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
        retries={"total_max_attempts": 1, "mode": "standard"},  # retried by ``failures.retrying``, in RETRY_* bounds
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
