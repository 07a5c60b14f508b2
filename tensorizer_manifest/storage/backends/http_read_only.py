"""``HttpReadOnlyBackend``: a checkpoint served over ``http(s)://`` (a static server, a CDN), read through
``storage.remote``'s objects (tensorizer's streams, ranged reads). Plain HTTP has no listing, no timestamps a
store can trust and no conditional writes: each of those is refused with the typed error, and the words, that
reading such a checkpoint elsewhere gives. A version token is the content hash of the bytes read. No torch."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from ...errors import ConfigurationError, RemoteNotFoundError
from ...format.schema import blake3_hex
from .base import SMALL_OBJECT_BYTES, RemoteObjects


class HttpReadOnlyBackend(RemoteObjects):
    """The objects under ``root`` (an ``http://`` or ``https://`` URI); a key is a path below it."""

    def _read_only(self, key: str) -> ConfigurationError:
        return ConfigurationError(f"{self._object(key)}: only s3:// checkpoints can be written; http(s) is read-only")

    def _unlisted(self, prefix: str) -> ConfigurationError:
        where = f"{self.root.uri}/{prefix.strip('/')}" if prefix.strip("/") else self.root.uri
        return ConfigurationError(f"{where}: an http(s) location cannot be listed; name the file instead")

    def _no_clock(self, key: str) -> ConfigurationError:
        return ConfigurationError(f"{self._object(key)}: only an s3:// object says when it was written")

    # --- reading ---------------------------------------------------------------------------------------------

    def read(self, key: str) -> bytes | None:
        try:
            return self._object(key).read_bytes(SMALL_OBJECT_BYTES)
        except RemoteNotFoundError:
            return None

    def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        data = self.read(key)
        return None if data is None else (data, blake3_hex(data))

    def files(self, prefix: str) -> list[tuple[str, float]]:
        raise self._unlisted(prefix)

    def names(self, prefix: str = "") -> list[str]:
        raise self._unlisted(prefix)

    def modified(self, key: str) -> float | None:
        raise self._no_clock(key)

    def clock(self) -> float:
        raise ConfigurationError(f"{self.root}: only an s3:// checkpoint has a clock gc can read; http(s) is read-only")

    # --- writing: refused ------------------------------------------------------------------------------------

    def create(self, key: str, data: bytes) -> bool:
        raise self._read_only(key)

    def upload(self, key: str, source: Path) -> None:
        raise self._read_only(key)

    def replace(self, key: str, data: bytes) -> None:
        raise self._read_only(key)

    def swap(self, key: str, data: bytes, replaces: str | None, check: Callable[[], None]) -> bool:
        raise self._read_only(key)

    def delete(self, key: str) -> None:
        raise ConfigurationError(f"{self._object(key)}: only s3:// objects can be removed; http(s) is read-only")

    def lock(self, key: str) -> AbstractContextManager[None]:
        return nullcontext()

    def tidy(self, prefix: str, orphan_grace_s: float) -> list[str]:
        return []  # nothing was removed (removals are refused)
