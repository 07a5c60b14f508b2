"""Remote objects and prefixes: ``RemoteFile`` (size, ranged reads, uploads, conditional writes) and
``RemoteDir`` (a checkpoint's prefix, listed on S3), and the probe of a server's conditional writes.

An S3 object's size and a prefix's listing come from boto3 (tensorizer's own S3 client library), with the same
credentials and endpoint as the bytes, which move through tensorizer's ``stream_io`` (``curl_stream``).
Every request that has not delivered a byte is retried within ``failures.RETRY_*``; every failure is typed
(``failures.transfer_error``, else a probe of the server: unreachable or not).

A ``RemoteFile`` reads one version of its S3 object: the ETag of its first answer is kept, every later read
carries ``If-Match`` with it, so an object replaced between two requests of one load (the checks' ranged
reads, the stream, tensorizer's parallel readers) fails at once as a ``RemoteChangedError`` instead of
mixing two versions' bytes; within one response the content hashes catch anything else.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar
from urllib.parse import urlsplit

from ...errors import (
    ConcurrentWriteError,
    ConfigurationError,
    RemoteChangedError,
    RemoteNotFoundError,
    RemoteStorageError,
    RemoteUnreachableError,
    TensorizerManifestError,
    UnsafeStorageError,
)
from ...format.schema import MANIFEST_SUFFIX, TENSORS_SUFFIX
from . import curl_stream
from .credentials import RemoteOptions, resolve, s3_client
from .failures import answer, changed, retrying, transfer_error
from .uris import SCHEMES, check_uri

_T = TypeVar("_T")

#: Reads of an S3 object carry ``If-Match`` with the ETag first seen (its HEAD or first GET), and a later
#: answer with another ETag is refused, so a replaced object fails (HTTP 412) rather than being read as a
#: mix of two versions. False: no version is kept, as before (the content hashes still catch a mix).
CONDITIONAL_READS = True


def is_remote(location: object) -> bool:
    """Whether ``location`` is an ``s3://``, ``http://`` or ``https://`` URI (a string, or a remote object)."""
    if isinstance(location, RemoteFile | RemoteDir):
        return True
    if not isinstance(location, str):
        return False
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def _etag_value(etag: str) -> str:
    return etag.strip().removeprefix("W/").strip('"')


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
        check_uri(self.uri)

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
            raise changed(self.uri, doing)

    def _check_version(self, stream: Any) -> None:
        """A stream's answer must be of the pinned version (a server that ignores ``If-Match``)."""
        headers = getattr(stream, "response_headers", None) or {}
        try:
            self._pin(headers.get("etag"), "opening it")
        except RemoteChangedError:
            stream.close()
            raise

    def _retrying(self, doing: str, attempt: Callable[[], _T]) -> _T:
        """``attempt()``, again after a throttled or transient failure (``failures.retrying``), else typed."""
        return retrying(self.uri, doing, attempt, self._error)

    @property
    def name(self) -> str:
        return self.uri.rstrip("/").rpartition("/")[2]

    @property
    def parent(self) -> RemoteDir:
        return RemoteDir(self.uri.rstrip("/").rpartition("/")[0], self.options)

    def _bucket_key(self) -> tuple[str, str]:
        _, netloc, path = check_uri(self.uri)
        return netloc, path.lstrip("/")

    def _reachable(self) -> bool:
        """Whether a TCP connection to the server (the S3 endpoint, or the URI's host) can be made."""
        import socket

        try:
            target = urlsplit(resolve(self.options).endpoint if self.scheme == "s3" else self.uri)
            port = target.port or (443 if target.scheme == "https" else 80)
            with socket.create_connection((target.hostname or "", port), timeout=5):
                return True
        except (OSError, ValueError):
            return False

    def size(self) -> int:
        """The object's size in bytes; a typed error when it is missing or cannot be reached."""
        if self.scheme == "s3":
            bucket, key = self._bucket_key()
            client = self._retrying("reading its size", lambda: s3_client(resolve(self.options)))
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

    def last_modified(self) -> float | None:
        """When the object was last written, as seconds since the epoch by the server's clock (a HEAD; S3 only);
        None when there is none."""
        if self.scheme != "s3":
            raise ConfigurationError(f"{self.uri}: only an s3:// object says when it was written")
        bucket, key = self._bucket_key()
        client = self._retrying("reading its time", lambda: s3_client(resolve(self.options)))
        try:
            head = self._retrying("reading its time", lambda: client.head_object(Bucket=bucket, Key=key))
        except RemoteNotFoundError:
            return None
        return head["LastModified"].timestamp()

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
        """One attempt at opening (``curl_stream.open_read``); the stream's re-opens and forks are retried, their
        answers' version checked and a failed read typed here, as this object's own."""
        return curl_stream.open_read(
            self.uri,
            self.options,
            begin,
            end,
            if_match=self.etag if CONDITIONAL_READS else None,
            presigned=self._presigned,
            retry_opening=lambda attempt: self._retrying("opening it", attempt),
            check_version=self._check_version,
            read_error=lambda failure: self._error(failure, "reading it"),
        )

    def read_range(self, begin: int, end: int) -> Iterator[bytes]:
        """Bytes ``begin`` to ``end`` in chunks; a transfer cut short is a ``RemoteStorageError``."""
        if end <= begin:
            return
        stream = self.open(begin, end)
        try:
            remaining = end - begin
            while remaining:
                try:
                    chunk = stream.read(min(remaining, curl_stream.CHUNK_BYTES))
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
        try:
            curl_stream.upload(self.uri, self.options, source)
        except Exception as exc:
            raise self._error(exc, "uploading it") from None

    def put_bytes(self, body: bytes) -> None:
        """Write ``body`` (small: one request) to this S3 object, whatever is there (the top level's copies of a
        generation's model files: never what a load trusts)."""
        if self.scheme != "s3":
            raise ConfigurationError(f"{self.uri}: only s3:// checkpoints can be written; http(s) is read-only")
        bucket, key = self._bucket_key()
        client = self._retrying("uploading it", lambda: s3_client(resolve(self.options, write=True)))
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
        client = self._retrying("uploading it", lambda: s3_client(resolve(self.options, write=True)))
        written: dict[str, str | None] = {}

        def put() -> bool:  # False: the condition failed (another writer's version is there)
            import botocore.exceptions

            try:
                response = client.put_object(Bucket=bucket, Key=key, Body=body, **condition)
            except botocore.exceptions.ClientError as exc:
                code, status = answer(exc)
                if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return False
                raise
            written["etag"] = response.get("ETag")
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
        client = self._retrying("reading its version", lambda: s3_client(resolve(self.options)))
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
        client = self._retrying("removing it", lambda: s3_client(resolve(self.options, write=True)))
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
        check_uri(self.uri)
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
        _, bucket, path = check_uri(self.uri)
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        here = RemoteFile(self.uri, self.options)

        def listing() -> list[str]:  # whole, from its first page, on each attempt
            names: list[str] = []
            paginator = s3_client(resolve(self.options)).get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
                names += [item["Key"][len(prefix) :] for item in page.get("Contents", ())]
            return names

        return sorted(n for n in here._retrying("listing it", listing) if n and "/" not in n)


def list_objects(location: RemoteDir) -> list[tuple[str, float]]:
    """Every object under the prefix, at any depth: (its name below the prefix, its ``LastModified`` as seconds
    since the epoch, by the server's clock) (S3 only)."""
    if location.scheme != "s3":
        raise ConfigurationError(f"{location.uri}: an http(s) location cannot be listed; name the file instead")
    _, bucket, path = check_uri(location.uri)
    prefix = path.strip("/") + "/" if path.strip("/") else ""
    here = RemoteFile(location.uri, location.options)

    def listing() -> list[tuple[str, float]]:
        found: list[tuple[str, float]] = []
        paginator = s3_client(resolve(location.options)).get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            found += [
                (item["Key"][len(prefix) :], item["LastModified"].timestamp()) for item in page.get("Contents", ())
            ]
        return found

    return sorted(here._retrying("listing it", listing))


def unfinished_uploads(location: RemoteDir) -> list[tuple[str, str, float]]:
    """The multipart uploads begun under the prefix and never completed nor aborted (a writer killed while it
    uploaded a large file): each one's name below the prefix, its upload id, and when it was last written to (its
    newest part, else its start) by the server's clock (S3 only). S3 keeps their parts, and bills them, until they
    are aborted."""
    _, bucket, path = check_uri(location.uri)
    prefix = path.strip("/") + "/" if path.strip("/") else ""
    here = RemoteFile(location.uri, location.options)

    def listing() -> list[tuple[str, str, float]]:
        client = s3_client(resolve(location.options))
        found: list[tuple[str, str, float]] = []
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Uploads", ()):
                written = item["Initiated"].timestamp()
                parts = client.get_paginator("list_parts")
                for part_page in parts.paginate(Bucket=bucket, Key=item["Key"], UploadId=item["UploadId"]):
                    written = max([written, *(part["LastModified"].timestamp() for part in part_page.get("Parts", ()))])
                found.append((item["Key"][len(prefix) :], item["UploadId"], written))
        return found

    return sorted(here._retrying("listing its unfinished uploads", listing))


def abort_upload(location: RemoteDir, name: str, upload_id: str) -> None:
    """Abort one unfinished multipart upload (``unfinished_uploads``): its parts are removed."""
    target = location / name
    bucket, key = target._bucket_key()
    client = target._retrying("aborting its upload", lambda: s3_client(resolve(location.options, write=True)))
    target._retrying(
        "aborting its upload", lambda: client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    )


#: Endpoints and buckets whose conditional writes were probed in this process: what the probe found, and when
#: (by this host's monotonic clock). A finding older than ``PROBE_TTL_S`` is probed again: a server's
#: configuration can change under a long-lived process.
_PROBED: dict[tuple[str | None, str], tuple[bool, float]] = {}
PROBE_TTL_S = 3600.0
#: The scratch keys a probe writes at the prefix's top (a killed process leaves one; ``gc`` removes it later).
PROBE_SCRATCH_PREFIX = ".tensorizer-manifest-probe-"


def probe_conditional_writes(location: RemoteDir, allow_unconditional: bool = False) -> None:
    """Refuse to write where the server ignores conditional writes (``UnsafeStorageError``), unless
    ``allow_unconditional``: a second ``If-None-Match: *`` PUT of a scratch key under the prefix, and an
    ``If-Match`` PUT with a wrong ETag, must both be refused. Once per endpoint and bucket in a process."""
    _, bucket, _ = check_uri(location.uri)
    endpoint = resolve(location.options, write=True).endpoint
    probed = _PROBED.get((endpoint, bucket))
    if probed is None or time.monotonic() - probed[1] > PROBE_TTL_S:
        scratch = location / f"{PROBE_SCRATCH_PREFIX}{os.urandom(8).hex()}"
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
        _PROBED[(endpoint, bucket)] = (honoured, time.monotonic())
    if not _PROBED[(endpoint, bucket)][0] and not allow_unconditional:
        raise UnsafeStorageError(
            f"{location.uri}: this S3 server ({endpoint or 'the default endpoint'}) ignores conditional writes "
            "(If-Match, If-None-Match), so two writers of one checkpoint could silently undo each other; nothing was "
            "written. Use a server that honours them, or pass allow_unconditional_writes "
            "(--allow-unconditional-writes) to accept that the last writer wins"
        )


def locate(
    location: str | os.PathLike[str] | RemoteFile | RemoteDir, options: RemoteOptions | None = None
) -> Path | RemoteFile | RemoteDir:
    """Where ``location`` is: a URI (or a remote object) as a remote file or prefix (``as_remote``), else a path."""
    if isinstance(location, RemoteFile | RemoteDir) or (isinstance(location, str) and is_remote(location)):
        return as_remote(location, options)
    return Path(location)


def as_remote(location: str | RemoteFile | RemoteDir, options: RemoteOptions | None = None) -> RemoteFile | RemoteDir:
    """A URI as a file (its name ends in ``.manifest.json`` or ``.tensors``) or as a checkpoint prefix."""
    if isinstance(location, RemoteFile | RemoteDir):
        return location
    options = options or RemoteOptions()
    if location.rstrip("/").endswith((MANIFEST_SUFFIX, TENSORS_SUFFIX)):
        return RemoteFile(location.rstrip("/"), options)
    return RemoteDir(location, options)
