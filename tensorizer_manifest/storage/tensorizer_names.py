"""Every private tensorizer name this package touches, each behind one small function, and the wording of
tensorizer's error messages that it reads.

tensorizer does not promise these names across releases. Kept here, a tensorizer upgrade that moves one shows
in one place: ``missing_private_names`` lists what this tensorizer lacks (a test runs it), a name the package
cannot do without is refused where it is needed with ``UnsupportedTensorizerError`` (naming the tensorizer
version, the name and the tested range), and a feature the package can do without (the conditional reads, the
retried re-opens of parallel readers, the dropping of tensorizer's cached tensors) is given up with one warning
that names what is lost, never silently.

The twin of ``_vllm_compat`` for tensorizer: the only module that imports tensorizer (an import-linter contract in
``pyproject.toml``). The public names the others use are its attributes (``PUBLIC_NAMES``:
``tensorizer_names.TensorDeserializer``), imported on each use, never at this module's import: importing it is free.
``storage/tensor_file.py``, ``storage/remote/`` (``curl_stream``, ``failures``) and ``checks/fingerprint.py`` use
it; it imports nothing of the package but ``errors``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedTensorizerError

logger = logging.getLogger(__name__)

#: The tensorizer releases a test ran (also in README.md and ``pyproject.toml``). Others are not refused as
#: such: a private name gone or changed is, where it is needed (or the feature it serves is given up).
SUPPORTED_TENSORIZER = ">=2.10.1,<2.13"

#: tensorizer's public names the package uses, as attributes of this module: (module, name; empty for the module).
PUBLIC_NAMES: dict[str, tuple[str, str]] = {
    "TensorSerializer": ("tensorizer", "TensorSerializer"),
    "TensorDeserializer": ("tensorizer", "TensorDeserializer"),
    "TensorType": ("tensorizer", "TensorType"),
    "EncryptionParams": ("tensorizer", "EncryptionParams"),
    "DecryptionParams": ("tensorizer", "DecryptionParams"),
    "CryptographyError": ("tensorizer.serialization", "CryptographyError"),
    "stream_io": ("tensorizer.stream_io", ""),
}


def __getattr__(name: str) -> Any:
    if name in PUBLIC_NAMES:
        module_name, attr = PUBLIC_NAMES[name]
        module = importlib.import_module(module_name)
        return getattr(module, attr) if attr else module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: (module, name, parameters) of every private tensorizer name used below. ``Class.name`` is an attribute of the
#: class (a method: its parameters are the names this package passes it, which its signature must still have);
#: ``Class().name`` is an attribute its instances set, which the class's source must still name as
#: ``self.name``.
PRIVATE_NAMES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # The index an open deserializer parsed (``tensor_index``): needed, refused without it.
    ("tensorizer.serialization", "TensorDeserializer()._metadata", ()),
    # The tensors a lazy deserializer keeps (``forget_cached``): without it, peak memory is higher.
    ("tensorizer.serialization", "TensorDeserializer()._cache", ()),
    # ``retrying_stream_class``: a parallel reader's fork and a backward seek's re-open retried, a read's failure
    # typed by curl's exit code; without them, plain ``open_stream`` streams.
    ("tensorizer.stream_io", "CURLStreamFile._fork", ("self", "begin", "end")),
    ("tensorizer.stream_io", "CURLStreamFile._create_read_error_from_context", ("self",)),
    ("tensorizer.stream_io", "CURLStreamFile._read_until", ("self",)),  # calls the one above on a short read
    ("tensorizer.stream_io", "CURLStreamFile()._curr", ()),
    ("tensorizer.stream_io", "CURLStreamFile()._curl", ()),
    # tensorizer's presigned URL of an S3 object (``s3_download_url``): without it, no conditional reads on S3.
    ("tensorizer.stream_io", "_s3_download_url",
     ("path_uri", "s3_access_key_id", "s3_secret_access_key", "s3_endpoint")),
)  # fmt: skip

# The wording of tensorizer's error messages that the package matches: each as tensorizer 2.10.1 words it (2.11.1
# and 2.12.1 word it the same); a test finds each in the source of the function that raises it
# (``MESSAGE_FRAGMENTS``).

#: ``TensorDeserializer.__init__``'s ``CryptographyError`` for an encrypted file opened without a key (2.10.1).
DECRYPTION_NOT_REQUESTED = "decryption was not requested"
#: ``TensorDeserializer.__init__``'s ``CryptographyError`` for a key given for a plain file (2.10.1).
NOT_FLAGGED_ENCRYPTED = "not flagged as encrypted"
#: ``TensorDeserializer.__init__``'s ``CryptographyError`` for a key given for a file older than encryption (2.10.1).
PREDATING_ENCRYPTION = "predating encryption"
#: ``CURLStreamFile.__init__``'s ``IOError`` when a request gets no 2xx answer; ``: <the HTTP status line>`` or
#: ``: cURL exit code N; ...`` follows when tensorizer knows more (2.10.1).
OPEN_FAILED = "Failed to open stream"
#: ``CURLStreamFile.__init__``'s explanation when curl exited before an answer: then the exit code (2.10.1).
OPEN_EXIT_CODE = "cURL exit code "
#: ``CURLStreamFile._create_read_error_from_context``'s text when curl failed mid-read: then the exit code and
#: ``)`` (2.10.1); ``retrying_stream_class``'s streams word their read errors so too.
READ_EXIT_CODE = "curl error: ("
#: ``CURLStreamFile._read_until``'s ``IOError`` when curl's output ends before the bytes asked for (2.10.1).
SHORT_READ = "Requested"

#: Each fragment above and the function of tensorizer that raises it: (fragment, module, qualified name).
MESSAGE_FRAGMENTS: tuple[tuple[str, str, str], ...] = (
    (DECRYPTION_NOT_REQUESTED, "tensorizer.serialization", "TensorDeserializer.__init__"),
    (NOT_FLAGGED_ENCRYPTED, "tensorizer.serialization", "TensorDeserializer.__init__"),
    (PREDATING_ENCRYPTION, "tensorizer.serialization", "TensorDeserializer.__init__"),
    (OPEN_FAILED, "tensorizer.stream_io", "CURLStreamFile.__init__"),
    (OPEN_EXIT_CODE, "tensorizer.stream_io", "CURLStreamFile.__init__"),
    (READ_EXIT_CODE, "tensorizer.stream_io", "CURLStreamFile._create_read_error_from_context"),
    (SHORT_READ, "tensorizer.stream_io", "CURLStreamFile._read_until"),
)

_MISSING = object()
#: The names whose loss was logged in this process (one warning each).
_WARNED: set[str] = set()


def tensorizer_version() -> str:
    import tensorizer

    return str(getattr(tensorizer, "__version__", "(unknown version)"))


def _takes_anything(signature: Any) -> bool:
    """A signature with ``*args`` and ``**kwargs`` (a wrapper) takes any call."""
    import inspect

    kinds = {p.kind for p in signature.parameters.values()}
    return {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds


def _problem(module_name: str, name: str, parameters: tuple[str, ...]) -> tuple[Any, str | None]:
    """The private name (for ``Class().name``, the class) and None, or ``_MISSING`` and what is wrong with it in
    this tensorizer."""
    import inspect

    try:
        target: Any = importlib.import_module(module_name)
    except ImportError:
        return _MISSING, f"{module_name} (module)"
    owner, instance, attribute = name.rpartition("().")
    for part in (owner if instance else name).split("."):
        target = getattr(target, part, _MISSING)
        if target is _MISSING:
            return _MISSING, f"{module_name}.{name}"
    if instance:
        sources = []
        for cls in getattr(target, "__mro__", ()):
            if cls.__module__.split(".")[0] == "tensorizer":
                try:
                    sources.append(inspect.getsource(cls))
                except (OSError, TypeError):
                    return _MISSING, f"{module_name}.{name} (no source to check)"
        if not any(re.search(rf"\bself\.{re.escape(attribute)}\b", source) for source in sources):
            return _MISSING, f"{module_name}.{name}"
        return target, None
    if parameters:
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return _MISSING, f"{module_name}.{name} (no signature to check)"
        lacking = [p for p in parameters if p not in signature.parameters]
        if lacking and not _takes_anything(signature):
            return _MISSING, f"{module_name}.{name} (takes no {', '.join(lacking)})"
    return target, None


def missing_private_names() -> list[str]:
    """The private names above that this tensorizer lacks or calls otherwise (empty when all are there)."""
    return [problem for entry in PRIVATE_NAMES if (problem := _problem(*entry)[1]) is not None]


def _entry(module_name: str, name: str) -> tuple[str, str, tuple[str, ...]]:
    return next(entry for entry in PRIVATE_NAMES if entry[:2] == (module_name, name))


def _unsupported(problem: str) -> UnsupportedTensorizerError:
    return UnsupportedTensorizerError(
        f"tensorizer {tensorizer_version()} has no {problem}, which tensorizer-manifest needs; use a tensorizer it "
        f"was tested with ({SUPPORTED_TENSORIZER}) or upgrade tensorizer-manifest"
    )


def _lost(problem: str, lost: str) -> None:
    """One warning per process that this tensorizer lacks ``problem``, and what is given up without it."""
    if problem in _WARNED:
        return
    _WARNED.add(problem)
    logger.warning(
        "tensorizer %s has no %s: %s (tested: tensorizer%s)", tensorizer_version(), problem, lost, SUPPORTED_TENSORIZER
    )


def optional(module_name: str, name: str, lost: str) -> Any:
    """One of ``PRIVATE_NAMES``, checked; None, and one warning naming ``lost``, when this tensorizer lacks it."""
    target, problem = _problem(*_entry(module_name, name))
    if problem is not None:
        _lost(problem, lost)
        return None
    return target


# --- serialization -------------------------------------------------------------------------------


def tensor_index(deserializer: Any) -> Mapping[Any, Any]:
    """The index an open ``TensorDeserializer`` parsed: its entries (``TensorEntry``) by tensor path.
    ``UnsupportedTensorizerError`` when this tensorizer keeps it elsewhere (the checks cannot run without it)."""
    index = getattr(deserializer, "_metadata", _MISSING)
    if not isinstance(index, Mapping):
        raise _unsupported("tensorizer.serialization.TensorDeserializer()._metadata (the index it parsed)")
    return index


#: What is lost when ``forget_cached`` cannot drop tensorizer's reference.
_CACHE_LOST = (
    "tensors handed out stay cached by the reader until it closes, so a raw layer's pre-step weights outlive "
    "vLLM's post-load step (higher peak memory while loading)"
)


def forget_cached(deserializer: Any, key: str) -> None:
    """Drop a lazy ``TensorDeserializer``'s own reference to the tensor ``key`` (its ``_cache``, keyed by tensor
    path), so the caller's is the only one. Without that cache (another tensorizer), one warning, and loading goes
    on."""
    cache = getattr(deserializer, "_cache", None)
    if isinstance(cache, dict):
        cache.pop((key,), None)
    else:
        _lost("tensorizer.serialization.TensorDeserializer()._cache", _CACHE_LOST)


# --- stream_io -----------------------------------------------------------------------------------


def s3_download_url() -> Callable[..., str] | None:
    """tensorizer's maker of an S3 object's presigned URL (``stream_io._s3_download_url``, called as
    ``(uri, access_key_id, secret_access_key, endpoint)``), looked up on each call; None, and one warning, when
    this tensorizer lacks it: S3 reads then go through ``open_stream`` without conditional reads."""
    return optional(
        "tensorizer.stream_io",
        "_s3_download_url",
        "s3:// reads go through tensorizer's open_stream: no If-Match conditional reads (a replaced object is "
        "caught by the content hashes only), no retried re-opens of parallel readers, a presigned URL per request",
    )


@dataclass(frozen=True)
class StreamHooks:
    """What a stream of ``retrying_stream_class`` asks of the object it reads."""

    retry_opening: Callable[[Callable[[], Any]], Any]
    """``retry_opening(attempt)``: ``attempt()``, again after a throttled or transient failure, else typed."""
    check_version: Callable[[Any], None]
    """``check_version(stream)``: a fresh stream's answer is of the version first read (else it raises)."""
    read_error: Callable[[BaseException], BaseException]
    """``read_error(failure)``: the typed error for a read that failed (tensorizer raises it)."""


_STREAM_LOST = (
    "remote reads use tensorizer's plain streams: no If-Match conditional reads, no retried re-opens of parallel "
    "readers and backward seeks, read failures typed from curl's message rather than its exit code"
)


@functools.cache
def retrying_stream_class() -> type | None:
    """tensorizer's ``CURLStreamFile`` with the hooks of ``StreamHooks`` (set on a stream as ``hooks``); None, and
    one warning, when this tensorizer lacks a name it needs (``PRIVATE_NAMES``' ``CURLStreamFile`` entries).

    ``TensorDeserializer`` forks a stream for each parallel reader (``_fork``, same class, same headers, so an
    ``If-Match`` goes along) and re-opens it on a backward seek: both open a new request before a byte of it is
    consumed, so both go through ``retry_opening``. A read that fails is classified by curl's own exit code
    (waited for, not guessed from a re-run of the request as tensorizer does) and raised as ``read_error`` makes
    it, which tensorizer passes on.
    """
    try:
        from tensorizer.stream_io import CURLStreamFile
    except ImportError:  # pragma: no cover - tensorizer without curl streams
        _lost("tensorizer.stream_io.CURLStreamFile", _STREAM_LOST)
        return None
    for module_name, name, parameters in PRIVATE_NAMES:
        if name.startswith("CURLStreamFile"):
            problem = _problem(module_name, name, parameters)[1]
            if problem is not None:
                _lost(problem, _STREAM_LOST)
                return None

    class RetryingCurlStream(CURLStreamFile):
        hooks: StreamHooks | None = None

        # An opening with no answer (curl exited: refused, stalled) closes the stream at once (tensorizer's
        # ``__init__`` calls ``close``), and tensorizer asks curl's exit code before curl has always finished
        # exiting: then the code is waited for here.
        def __init__(self, *args: Any, **kwargs: Any) -> None:  # also a backward seek's re-open, and a fork's
            self._opened = False
            try:
                super().__init__(*args, **kwargs)
            except OSError as exc:
                code = getattr(self, "_exit_code", None)
                if str(exc) == OPEN_FAILED and code and code > 0:
                    raise OSError(f"{OPEN_FAILED}: {OPEN_EXIT_CODE}{code}") from None
                raise
            self._opened = True

        def close(self):
            curl = getattr(self, "_curl", None)
            if curl is not None and not getattr(self, "_opened", True) and curl.poll() is None:
                try:  # its opening failed: curl has closed its output and is exiting, with its own code
                    curl.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
            super().close()
            if curl is not None:
                self._exit_code = curl.returncode

        def _fork(self, begin: int | None = None, end: int | None = None):
            hooks = self.hooks
            if hooks is None:
                return super()._fork(begin, end)

            def once():
                clone = CURLStreamFile._fork(self, begin, end)
                clone.hooks = hooks
                hooks.check_version(clone)
                return clone

            return hooks.retry_opening(once)

        def seek(self, position, whence=0):
            hooks, current = self.hooks, self._curr
            target = position + current if whence == 1 else position
            if hooks is None or whence == 2 or target >= current:
                return super().seek(position, whence)  # forward: reads on, never retried
            # Backward: tensorizer closes this request and opens another from ``target``.
            hooks.retry_opening(lambda: CURLStreamFile.seek(self, target))
            hooks.check_version(self)

        def _create_read_error_from_context(self):
            curl = getattr(self, "_curl", None)
            code = None
            if curl is not None:
                code = curl.poll()
                if code is None:
                    try:
                        code = curl.wait(timeout=1)  # curl that closed its output is exiting: its own code
                    except subprocess.TimeoutExpired:
                        curl.terminate()
                        code = curl.wait()
            failure = OSError(f"{READ_EXIT_CODE}{code})" if code and code > 0 else "the transfer ended early")
            return failure if self.hooks is None else self.hooks.read_error(failure)

    return RetryingCurlStream
