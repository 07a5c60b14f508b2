"""Finding the package's own error in what vLLM raised around it (its engine wraps what loaders raise)."""

from __future__ import annotations


def our_error(exc: BaseException) -> BaseException | None:
    """The first ``TensorizerManifestError`` in ``exc``'s cause chain, or None."""
    from tensorizer_manifest.errors import TensorizerManifestError

    seen = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, TensorizerManifestError):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def error_summary(exc: BaseException) -> dict[str, str]:
    """``{"error": class name, "message": ...}`` of our error when there is one, else of ``exc`` itself."""
    found = our_error(exc) or exc
    return {"error": type(found).__name__, "message": str(found)}


def error_chain(exc: BaseException) -> list[str]:
    """Every ``"Class: message"`` in ``exc``'s chain, outermost first (for scenario results, which are JSON)."""
    chain, seen = [], set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        chain.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    return chain
