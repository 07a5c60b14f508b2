"""What a check found: one ``Problem`` (the error the loader would raise, where, what), and the frozen
``ValidationReport`` of a whole checkpoint, which the loader turns back into the first problem's error."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import (
    TensorizerManifestError,
)
from ..storage.checkpoint import (
    FileLocation,
)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint, and the error the loader would raise for it."""

    kind: type[TensorizerManifestError]
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"

    def to_dict(self) -> dict:
        return {"error": self.kind.__name__, "where": self.where, "message": self.message}


@dataclass(frozen=True)
class ValidationReport:
    """What ``validate_checkpoint`` checked and found; ``ok`` when it found nothing."""

    manifest_path: FileLocation | None
    tensor_path: FileLocation | None
    records: int = 0
    stored: int = 0
    hashes_checked: int = 0
    problems: tuple[Problem, ...] = field(default_factory=tuple)
    warnings: tuple[str, ...] = field(default_factory=tuple)
    """What is not wrong but weaker than it should be (an unsealed manifest); ``ok`` ignores them."""
    encrypted: bool = False
    """The tensor file is encrypted (its content hashes are checked only with its key)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        """Raise the first problem's error, naming the others (up to five) in its message."""
        if self.problems:
            first, rest = self.problems[0], self.problems[1:]
            more = f" (and {len(rest)} more: " + "; ".join(map(str, rest[:5])) + ")" if rest else ""
            raise first.kind(f"{first}{more}")

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "manifest": str(self.manifest_path) if self.manifest_path else None,
            "tensor_file": str(self.tensor_path) if self.tensor_path else None,
            "records": self.records,
            "stored": self.stored,
            "hashes_checked": self.hashes_checked,
            "encrypted": self.encrypted,
            "problems": [p.to_dict() for p in self.problems],
            "warnings": list(self.warnings),
        }
