"""Verification records: evidence that a restorer gives the default loader's results on a kind of device.

``tensorizer-manifest verify-kernels`` writes one record per restorer it
exercised (saved processed, loaded back, processed tensors bitwise and greedy
tokens equal to vLLM's default loader, no post-load step run on those layers).
Records in this package's ``verified/`` folder and in the user's
(``$TENSORIZER_MANIFEST_VERIFIED_DIR``, default ``~/.config/tensorizer-manifest/verified``)
make a restorer verified on their device kind, beside the kinds this project's
own tests prove (``Restorer.verified_on``). A record is JSON, never code.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Literal

import msgspec

from ..errors import ManifestError
from .schema import PlainValue

VERIFIED_DIR_ENV = "TENSORIZER_MANIFEST_VERIFIED_DIR"
PACKAGE_RECORDS = Path(__file__).parent.parent / "verified"


class VerificationRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One restorer checked on one machine."""

    restorer: str
    result: Literal["pass", "fail"]
    device_type: str
    """``cpu``, ``cuda``...: the device kind the record verifies."""
    device_name: str
    device_capability: str | None = None
    cpu_features: list[str] = []
    vllm_version: str
    tensorizer_manifest_version: str
    model: str
    """What was saved and loaded (a tiny kind or the user's model path)."""
    layers: int
    """Layers this restorer replayed in the check."""
    kernel_classes: list[str] = []
    form: list[dict[str, PlainValue]] = []
    """The distinct layouts (``ModuleRecord.form``) the check covered."""
    date: str
    detail: str = ""


_decoder = msgspec.json.Decoder(list[VerificationRecord])


def user_records_dir() -> Path:
    configured = os.environ.get(VERIFIED_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "tensorizer-manifest" / "verified"


def read_records(path: Path) -> list[VerificationRecord]:
    """The records of one file (a JSON list); a damaged file is a ``ManifestError`` naming it."""
    try:
        return _decoder.decode(path.read_bytes())
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ManifestError(f"{path}: not a list of verification records ({exc}); fix or remove the file") from None


def load_records() -> list[VerificationRecord]:
    """Every record: the package's, then the user's, in file-name order."""
    records: list[VerificationRecord] = []
    for folder in (PACKAGE_RECORDS, user_records_dir()):
        if folder.is_dir():
            for path in sorted(folder.glob("*.json")):
                records += read_records(path)
    return records


@functools.lru_cache(maxsize=1)
def _passing() -> frozenset[tuple[str, str]]:
    return frozenset((r.restorer, r.device_type) for r in load_records() if r.result == "pass")


def recorded_verified(restorer: str, device_type: str) -> bool:
    """Whether a passing record verifies ``restorer`` on ``device_type`` (records read once per process)."""
    return (restorer, device_type) in _passing()


def write_records(records: list[VerificationRecord], path: Path) -> Path:
    """Write ``records`` as one JSON file (pretty, like manifests); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(records), indent=1) + b"\n")
    _passing.cache_clear()
    return path
