"""Checkpoints in object storage: ``s3://`` and ``http(s)://`` URIs, credentials, ranged reads, uploads, listing.

The one place that talks to remote storage. Bytes move through tensorizer's
``stream_io`` (curl for reads, presigned for S3; its S3 upload for writes), so
a tensor file streams into ``TensorDeserializer`` exactly as tensorizer's own
loaders stream it. An S3 object's size and a prefix's listing come from boto3
(tensorizer's own S3 client library), with the same credentials and endpoint.
A URI never holds a credential, and no message, log or repr made here shows one.

A package, so that each seam is a module of its own:

- ``uris``: the schemes, the URIs accepted, which files of a model directory are not weights;
- ``credentials``: ``RemoteOptions``, credentials and endpoint resolved as tensorizer resolves them, the stall
  timeout, one boto3 client per endpoint;
- ``failures``: the typed error of a failed request, and the retries of throttled ones;
- ``curl_stream``: tensorizer's streams (all the private stream names the package uses);
- ``objects``: ``RemoteFile`` and ``RemoteDir``, listing, the probe of conditional writes.

A whole checkpoint's upload and the fetch of its model files are beside the local checkpoint code, in
``storage/remote_checkpoint.py``. Other modules import the names below from here.
"""

from __future__ import annotations

from .credentials import CREDENTIAL_OPTIONS, RemoteOptions
from .failures import transfer_error
from .objects import (
    PROBE_SCRATCH_PREFIX,
    RemoteDir,
    RemoteFile,
    abort_upload,
    as_remote,
    is_remote,
    list_objects,
    locate,
    probe_conditional_writes,
    unfinished_uploads,
)
from .uris import HTTP_MODEL_FILES, is_model_file

__all__ = [
    "CREDENTIAL_OPTIONS",
    "PROBE_SCRATCH_PREFIX",
    "HTTP_MODEL_FILES",
    "RemoteDir",
    "RemoteFile",
    "RemoteOptions",
    "abort_upload",
    "as_remote",
    "locate",
    "is_model_file",
    "is_remote",
    "list_objects",
    "probe_conditional_writes",
    "transfer_error",
    "unfinished_uploads",
]
