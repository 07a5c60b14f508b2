"""One exception hierarchy for everything tensorizer_manifest raises on purpose.

    TensorizerManifestError
    ├── ManifestError (ValueError)            the manifest itself is unreadable or malformed
    │   └── ManifestVersionError               written by a newer format version
    ├── CheckpointNotFoundError (FileNotFoundError)
    │   └── NoManifestError                     a tensorizer file with no manifest (stock vLLM's)
    ├── ConfigurationError (ValueError)         an option the user passed is invalid
    ├── IntegrityError (ValueError)            tensor file and manifest disagree (size, hash, records)
    ├── CompatibilityError (ValueError)        the engine that loads differs from the one that saved
    ├── NotReproducibleError (ValueError)      a running engine's state is not its source's: not saved
    ├── UnsupportedModelError (NotImplementedError)  something we refuse to guess about
    │   ├── UnsupportedVLLMError                this vLLM lacks or changed a private name we call
    │   └── UnsupportedTensorizerError          this tensorizer lacks or changed a private name we need
    ├── ReplayError (RuntimeError)             restoring runtime state failed; the model is not served
    ├── ConcurrentWriteError (RuntimeError)    another writer changed the manifest since this one read it
    └── RemoteStorageError (OSError)           s3:// or http(s):// storage failed; a transfer cut short
        ├── RemoteNotFoundError (CheckpointNotFoundError too)   no object at that URI
        ├── RemoteAccessError (PermissionError)                 the credentials were refused
        ├── RemoteUnreachableError (ConnectionError)            the endpoint cannot be reached
        ├── RemoteThrottledError                                 still throttled (503 SlowDown) after retries
        ├── RemoteChangedError                                   the object was replaced mid-read
        ├── RemoteStalledError                                   the server sent nothing for the stall timeout
        └── UnsafeStorageError                                   the server ignores conditional writes

Each class also inherits the builtin it refines (as huggingface_hub does), so
callers that only know builtins still catch them. Messages say what is wrong
and what to do; the CLI prints them as one line, never a traceback.
"""

from __future__ import annotations


class TensorizerManifestError(Exception):
    """Base class of every error this package raises on purpose."""


class ManifestError(TensorizerManifestError, ValueError):
    """The manifest is not valid JSON, or does not match the schema."""


class ManifestVersionError(ManifestError):
    """The manifest was written by a format version this package cannot read (or, for one added form, a form
    another version wrote that this one does not use: the form alone is skipped)."""


class CheckpointNotFoundError(TensorizerManifestError, FileNotFoundError):
    """A checkpoint directory, manifest or tensor file is missing."""


class NoManifestError(CheckpointNotFoundError):
    """A tensorizer file with no manifest beside it, as stock vLLM writes (``save_tensorized_model``).

    Without a manifest nothing says how its layers were saved, raw or processed: it is refused before a
    byte of it is read, with the command that re-saves it from its source model. ``tensor_file``: that file.
    """

    tensor_file: object = None


class ConfigurationError(TensorizerManifestError, ValueError):
    """An option is invalid: ``model_loader_extra_config``, save options, a CLI flag.

    A mistake in how the package was called, not a fault of the checkpoint or the engine.
    """


class IntegrityError(TensorizerManifestError, ValueError):
    """The tensor file does not match what the manifest says it holds."""


class CompatibilityError(TensorizerManifestError, ValueError):
    """The loading engine differs from the saving engine in a way that matters.

    ``differences`` lists ``(field, saved, current)`` for every mismatch.
    """

    def __init__(self, message: str, differences: list[tuple[str, object, object]] | None = None):
        super().__init__(message)
        self.differences = differences or []


class NotReproducibleError(TensorizerManifestError, ValueError):
    """A running engine's state is not what its source weights give through vLLM's load and post-load step
    (a weight changed after loading: a LoRA merged, an RLHF update): saving it would write something else."""


class UnsupportedModelError(TensorizerManifestError, NotImplementedError):
    """The model does something at load time that the manifest cannot describe."""


class UnsupportedVLLMError(UnsupportedModelError):
    """This vLLM lacks a private name tensorizer-manifest calls, or calls it another way (its signature
    changed): raised before anything is read or written, naming the vLLM version, the name and the supported
    range."""


class UnsupportedTensorizerError(UnsupportedModelError):
    """This tensorizer lacks a private name tensorizer-manifest needs, or calls it another way (its signature
    changed): raised where the name is needed, before the read that needs it, naming the tensorizer version, the
    name and the tested range. (A private name that serves a feature the package can do without is not an error:
    the feature is given up with one warning naming it.)"""


class ReplayError(TensorizerManifestError, RuntimeError):
    """Rebuilding a layer's runtime state failed, or left it incomplete."""


class ConcurrentWriteError(TensorizerManifestError, RuntimeError):
    """Another writer (a save, a re-save, an add-form) committed a manifest since this writer read the one it
    started from: nothing of this write is committed; read the checkpoint again and re-run it."""


class RemoteStorageError(TensorizerManifestError, OSError):
    """Remote storage (``s3://``, ``http(s)://``) failed: a transfer cut short, an unexpected answer.

    Messages name the URI and the kind of failure, never a credential.
    """


class RemoteNotFoundError(RemoteStorageError, CheckpointNotFoundError):
    """No object (or bucket) at that URI."""


class RemoteAccessError(RemoteStorageError, PermissionError):
    """The server refused the credentials (unknown key id, wrong secret, no permission)."""


class RemoteUnreachableError(RemoteStorageError, ConnectionError):
    """The endpoint cannot be reached (refused connection, unknown host, timeout)."""


class RemoteThrottledError(RemoteStorageError):
    """The server kept asking to slow down (HTTP 503 ``SlowDown``, 429) through every retry
    (``remote.failures.RETRY_*``)."""


class RemoteChangedError(RemoteStorageError):
    """The object was replaced while it was being read (its ETag changed): the read is abandoned, never mixed."""


class RemoteStalledError(RemoteStorageError):
    """The server sent no byte for the stall timeout (``remote.credentials.STALL_TIMEOUT_S``, 60 s, or
    ``TENSORIZER_MANIFEST_STALL_TIMEOUT_S``): it kept the connection open and stopped answering. Never retried."""


class UnsafeStorageError(RemoteStorageError):
    """The S3 server ignores conditional writes (``If-Match``, ``If-None-Match``), so writers of one checkpoint
    could silently undo each other: writing is refused unless the user accepts that the last writer wins."""


__all__ = [
    "TensorizerManifestError",
    "ManifestError",
    "ManifestVersionError",
    "CheckpointNotFoundError",
    "NoManifestError",
    "ConfigurationError",
    "IntegrityError",
    "CompatibilityError",
    "NotReproducibleError",
    "UnsupportedModelError",
    "UnsupportedVLLMError",
    "UnsupportedTensorizerError",
    "ReplayError",
    "ConcurrentWriteError",
    "RemoteStorageError",
    "RemoteNotFoundError",
    "RemoteAccessError",
    "RemoteUnreachableError",
    "RemoteThrottledError",
    "RemoteChangedError",
    "RemoteStalledError",
    "UnsafeStorageError",
]
