"""Bytes through tensorizer's ``stream_io``: a remote object's reads (curl, presigned for S3) and its uploads.

A tensor file streams into ``TensorDeserializer`` exactly as tensorizer's own loaders stream it. This is the one
module of the ``remote`` package that touches tensorizer's stream classes and their private names (each behind a
function of ``tensorizer_names``): the retrying stream and its ``StreamHooks``, the presigned URL maker, and
``stream_io.CAInfo``, through which every curl a stream runs gets the stall timeout (``stall_limit``).
"""

from __future__ import annotations

import functools
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from ...errors import ConfigurationError
from .. import tensorizer_names
from ..tensorizer_names import StreamHooks
from .credentials import RemoteOptions, resolve

#: Bytes a read or an upload moves at a time.
CHUNK_BYTES = 1 << 20
#: A presigned S3 URL is made once per object and reused for this long (tensorizer's are valid a day or
#: more): making one builds a boto3 client, about 0.3 s on two busy cores, and the checks' ranged reads
#: make one request per run of tensor headers.
PRESIGNED_URL_REUSE_S = 3600.0


@functools.cache
def _curl_flags_class() -> type:
    """tensorizer's public way to put flags on curl's command line: ``stream_io.CAInfo``, given as
    ``certificate_handling`` (its ``curl_flags`` go on every curl a stream runs, kept by its forks and
    re-opens). A subclass whose flags are ours, not a certificate option: curl verifies certificates as
    by default."""
    stream_io = tensorizer_names.stream_io
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


def stall_limit(seconds: float) -> Any:
    """The ``certificate_handling`` of a stream with a stall timeout: curl exits with code 28 (``RemoteStalledError``)
    when fewer than 1 byte a second arrive for ``seconds`` (whole seconds, curl counts no finer; at least 1)."""
    return _curl_flags_class()("--speed-limit", "1", "--speed-time", str(max(1, math.ceil(seconds))))


def _is_s3(uri: str) -> bool:
    return urlsplit(uri).scheme.lower() == "s3"


def stream_kwargs(uri: str, options: RemoteOptions, write: bool = False) -> dict[str, Any]:
    """What ``stream_io`` is given to reach ``uri``: for s3://, the resolved credentials and endpoint."""
    if not _is_s3(uri):
        return {}
    resolved = resolve(options, write)
    unsigned = not resolved.access_key_id and not resolved.secret_access_key
    return {
        "s3_access_key_id": "" if unsigned else resolved.access_key_id,
        "s3_secret_access_key": "" if unsigned else resolved.secret_access_key,
        "s3_endpoint": resolved.endpoint,
        "force_http": resolved.endpoint.lower().startswith("http://"),
    }


def open_read(
    uri: str,
    options: RemoteOptions,
    begin: int | None,
    end: int | None,
    *,
    if_match: str | None,
    presigned: dict[str, tuple[str, float]],
    retry_opening: Callable[[Callable[[], Any]], Any],
    check_version: Callable[[Any], None],
    read_error: Callable[[BaseException], BaseException],
) -> BinaryIO:
    """One attempt at opening a stream of ``uri`` (bytes ``begin`` to ``end``, end exclusive).

    tensorizer's retrying stream (``tensorizer_names.retrying_stream_class``) where this tensorizer has it: an
    S3 read asks for version ``if_match`` (``If-Match``) of a presigned URL kept in ``presigned`` (the object's
    own, a secret: never shown), and the stream's re-opens and forks ask the object through ``StreamHooks``
    (``retry_opening``, ``check_version``, ``read_error``). Otherwise tensorizer's plain ``open_stream``.
    """
    stream_io = tensorizer_names.stream_io
    s3 = _is_s3(uri)
    cls = tensorizer_names.retrying_stream_class()
    presign = tensorizer_names.s3_download_url() if s3 else None
    stall = stall_limit(options.stall_timeout())
    if cls is None or (s3 and presign is None):  # another tensorizer (warned): its plain stream
        return stream_io.open_stream(
            uri, "rb", begin=begin, end=end, certificate_handling=stall, **stream_kwargs(uri, options)
        )
    headers = None
    url = uri
    if s3:
        assert presign is not None  # an S3 stream without it took tensorizer's plain stream above
        url = _presigned_url(uri, options, presign, presigned)
        headers = {"If-Match": if_match} if if_match and not if_match.startswith("W/") else None  # If-Match is strong
    stream = cls(url, begin=begin, end=end, headers=headers, certificate_handling=stall)
    stream.hooks = StreamHooks(retry_opening=retry_opening, check_version=check_version, read_error=read_error)
    check_version(stream)
    return stream


def _presigned_url(
    uri: str, options: RemoteOptions, presign: Callable[..., str], cache: dict[str, tuple[str, float]]
) -> str:
    """What ``open_stream`` does for s3:// (tensorizer's presigned URL), made once per ``PRESIGNED_URL_REUSE_S``."""
    cached = cache.get("url")
    if cached is not None and time.monotonic() - cached[1] < PRESIGNED_URL_REUSE_S:
        return cached[0]
    kwargs = stream_kwargs(uri, options)
    url = presign(uri, kwargs["s3_access_key_id"], kwargs["s3_secret_access_key"], kwargs["s3_endpoint"])
    cache["url"] = (url, time.monotonic())
    return url


def upload(uri: str, options: RemoteOptions, source: Path) -> None:
    """Write a local file to an S3 object through ``stream_io``'s upload (visible once complete)."""
    stream_io = tensorizer_names.stream_io
    stream = stream_io.open_stream(uri, "wb", **stream_kwargs(uri, options, write=True))
    with open(source, "rb") as f:
        shutil.copyfileobj(f, stream, CHUNK_BYTES)
    stream.close()  # uploads
