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
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from .errors import (
    ConfigurationError,
    RemoteAccessError,
    RemoteNotFoundError,
    RemoteStorageError,
    RemoteUnreachableError,
    TensorizerManifestError,
)
from .schema import MANIFEST_SUFFIX, TENSORS_SUFFIX

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
    """A config, tokenizer or other non-weight file of a model directory (not a manifest, not hidden)."""
    return not (
        name.startswith(".")
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

    def __repr__(self) -> str:
        return (
            f"RemoteOptions(access_key_id={'<set>' if self.access_key_id else None}, "
            f"secret_access_key={'<set>' if self.secret_access_key else None}, endpoint={self.endpoint!r})"
        )

    __str__ = __repr__

    def secrets(self) -> tuple[str, ...]:
        """The credential values given, for tests and callers that scrub text."""
        return tuple(s for s in (self.access_key_id, self.secret_access_key) if s)


@dataclass(frozen=True)
class _Resolved:
    access_key_id: str | None = field(repr=False)
    secret_access_key: str | None = field(repr=False)
    endpoint: str

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
    return _Resolved(key_id, secret, _with_scheme(endpoint))


def _s3_client(resolved: _Resolved):
    import boto3
    import botocore
    from botocore.config import Config

    unsigned = not resolved.access_key_id and not resolved.secret_access_key
    config = Config(
        retries={"max_attempts": 2, "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
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

_HTTP_STATUS = re.compile(r"HTTP/[\d.]+ (\d{3})")
_CURL_EXIT = re.compile(r"cURL exit code (\d+)|curl error: \((\d+)\)|curl: \((\d+)\)")
#: curl exit codes that mean the endpoint was never reached, and those of a transfer cut short.
_CURL_UNREACHABLE = {5, 6, 7, 28, 35, 60}
_CURL_CUT_SHORT = {18, 52, 55, 56, 92}


def _messages(exc: BaseException) -> str:
    seen, text = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " | ".join(text)


def transfer_error(exc: BaseException, uri: str, doing: str) -> RemoteStorageError | None:
    """The typed error for a failed remote transfer, or None when ``exc`` is not one.

    The message names the URI and the kind of failure, never the exception's own
    text (a presigned URL carries the access key's id).
    """
    import botocore.exceptions

    if isinstance(exc, RemoteStorageError):
        return exc
    code, status = None, None
    chain: list[BaseException] = []
    cursor: BaseException | None = exc
    while cursor is not None and cursor not in chain:
        chain.append(cursor)
        cursor = cursor.__cause__ or cursor.__context__
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
    text = _messages(exc)
    if status is None:
        match = _HTTP_STATUS.search(text)
        if match:
            status = int(match.group(1))
    if status is None and code is None:
        curl = _CURL_EXIT.search(text)
        if curl is not None:
            exit_code = int(next(g for g in curl.groups() if g))
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
    if "Failed to open stream" in text:
        return RemoteStorageError(f"{uri}: the server gave no answer while {doing}")
    if isinstance(exc, OSError | EOFError) or "Requested" in text:
        return RemoteStorageError(
            f"{uri}: the transfer was cut short while {doing}: the server closed the connection or stopped answering"
        )
    return None


# -- objects and prefixes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    """One object at a URI, and how to reach it; ``str()`` is its URI (never a credential)."""

    uri: str
    options: RemoteOptions = field(default_factory=RemoteOptions)

    def __post_init__(self) -> None:
        _check_uri(self.uri)

    def __str__(self) -> str:
        return self.uri

    @property
    def scheme(self) -> str:
        return urlsplit(self.uri).scheme.lower()

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
            try:
                head = _s3_client(_resolve(self.options)).head_object(Bucket=bucket, Key=key)
            except Exception as exc:
                raise self._error(exc, "reading its size") from None
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
        """
        from tensorizer import stream_io

        try:
            stream = stream_io.open_stream(self.uri, "rb", begin=begin, end=end, **self._stream_kwargs())
        except Exception as exc:
            raise self._error(exc, "opening it") from None
        if begin:
            headers = getattr(stream, "response_headers", None) or {}
            if not headers.get("content-range"):
                stream.close()
                raise RemoteStorageError(
                    f"{self.uri}: the server ignores HTTP range requests, which reading a checkpoint needs"
                )
        return stream

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

    def delete(self) -> None:
        """Remove this S3 object (S3 says nothing when it was already gone)."""
        if self.scheme != "s3":
            raise ConfigurationError(f"{self.uri}: only s3:// objects can be removed; http(s) is read-only")
        bucket, key = self._bucket_key()
        try:
            _s3_client(_resolve(self.options, write=True)).delete_object(Bucket=bucket, Key=key)
        except Exception as exc:
            raise self._error(exc, "removing it") from None

    def _error(self, exc: BaseException, doing: str) -> TensorizerManifestError:
        typed = transfer_error(exc, self.uri, doing)
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
        names: list[str] = []
        try:
            client = _s3_client(_resolve(self.options))
            paginator = client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
                names += [item["Key"][len(prefix) :] for item in page.get("Contents", ())]
        except Exception as exc:
            raise RemoteFile(self.uri, self.options)._error(exc, "listing it") from None
        return sorted(n for n in names if n and "/" not in n)


def as_remote(location: str | RemoteFile | RemoteDir, options: RemoteOptions | None = None) -> RemoteFile | RemoteDir:
    """A URI as a file (its name ends in ``.manifest.json`` or ``.tensors``) or as a checkpoint prefix."""
    if isinstance(location, RemoteFile | RemoteDir):
        return location
    options = options or RemoteOptions()
    if location.rstrip("/").endswith((MANIFEST_SUFFIX, TENSORS_SUFFIX)):
        return RemoteFile(location.rstrip("/"), options)
    return RemoteDir(location, options)


# -- whole checkpoints ------------------------------------------------------------------------------------------


def upload_checkpoint(local_dir: Path, uri: str, options: RemoteOptions | None = None) -> list[str]:
    """Upload a saved checkpoint: tensor files first, then config and tokenizer files, manifests last.

    So a reader that finds a manifest finds its tensor file beside it. Then the tensor files an earlier
    save to the same prefix left (same stem, another content digest, named by no manifest any more) are
    removed, as a local re-save removes them. Returns the names uploaded.
    """
    target = RemoteDir(uri, options or RemoteOptions())
    if target.scheme != "s3":
        raise ConfigurationError(f"{uri}: only s3:// checkpoints can be written; http(s) is read-only")
    files = sorted(p for p in Path(local_dir).iterdir() if p.is_file() and not p.name.startswith("."))
    tensors = [p for p in files if p.name.endswith(TENSORS_SUFFIX)]
    manifests = [p for p in files if p.name.endswith(MANIFEST_SUFFIX)]
    others = [p for p in files if p not in tensors and p not in manifests]
    for path in [*tensors, *others, *manifests]:
        (target / path.name).upload(path)
    uploaded = {p.name for p in tensors}
    for name in target.list_names():
        if name not in uploaded and any(_same_stem(name, new) for new in uploaded):
            (target / name).delete()
    return [p.name for p in [*tensors, *others, *manifests]]


def _same_stem(name: str, tensor_file: str) -> bool:
    """Whether ``name`` is a tensor file of the same rank as ``tensor_file`` (``{stem}.{16 hex}.tensors``)."""
    pattern = r"(.+)\.[0-9a-f]{16}" + re.escape(TENSORS_SUFFIX)
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
