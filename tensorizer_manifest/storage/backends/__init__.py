"""Where a checkpoint's bytes live, behind one protocol: ``base`` (``Backend``: reads, listing with the storage's
timestamps, create-once, the pointer's compare-and-swap, removal), one module per storage: ``local`` (a directory,
through ``storage.files``), ``s3`` (an ``s3://`` prefix, through ``storage.remote``) and ``http_read_only`` (an
``http(s)://`` one: reads only, writes refused by type). ``backend_for`` picks one for a location. A new storage
(GCS, Azure, an HTTP server with conditional writes) is one more module here, passing the same tests
(``tests/storage/backends``). Imports ``storage.files`` and ``storage.remote``; no torch, no pydantic.
"""

from __future__ import annotations

from pathlib import Path

from ..remote import RemoteDir
from .base import SMALL_OBJECT_BYTES, Backend
from .http_read_only import HttpReadOnlyBackend
from .local import LocalBackend
from .s3 import S3Backend


def backend_for(location: Path | RemoteDir, allow_unconditional_writes: bool = False) -> Backend:
    """The backend of a checkpoint's root: a local directory, an ``s3://`` prefix, or an ``http(s)://`` one.
    ``allow_unconditional_writes``: S3 only (see ``S3Backend``)."""
    if isinstance(location, RemoteDir):
        if location.scheme == "s3":
            return S3Backend(location, allow_unconditional_writes)
        return HttpReadOnlyBackend(location)
    return LocalBackend(location)


__all__ = ["SMALL_OBJECT_BYTES", "Backend", "HttpReadOnlyBackend", "LocalBackend", "S3Backend", "backend_for"]
