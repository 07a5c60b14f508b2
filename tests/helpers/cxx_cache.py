"""A compiler cache for the test session's C++ compiles (``CXX``; ccache's idea, in the standard library).

On CPU, inductor turns every graph it compiles into C++ and builds it with g++: about 4 s a kernel on these
machines, 30-40 s of a tiny model's cold start. The compile-form tests start many engines that compile cold on
purpose (the reference, each form that is refused), each in an empty vLLM cache, so they build the same sources
again and again. This keeps each built library by the hash of what built it (the compiler's arguments, the source
and every file it is told to include) and hands a copy back when asked again.

What the tests prove is not touched: inductor still misses its own cache and compiles the graph (its counters and
vLLM's log say so, as they would cold), and tokens come from the same code built by the same compiler. Only the
test session uses it (``tests/conftest.py``): the benchmarks measure real cold starts.

Run as the compiler: ``python3 cxx_cache.py ARGS...`` with ``TM_CXX_CACHE_DIR`` set; anything it does not cache
(a precompiled header, ``--version``, a compile without ``-o``) goes to the real compiler unchanged.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

REAL_COMPILER = os.environ.get("TM_CXX_REAL", "/usr/bin/g++")
_SOURCES = (".cpp", ".cc", ".cxx", ".c")
_BUILT = (".so", ".o")


def _file_hash(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def cache_key(args: list[str]) -> tuple[str, str] | None:
    """(key, output path) of a compile this cache may answer, or None: exactly one output (a shared library or an
    object), at least one source, no header being precompiled. Files the compile reads are keyed by content, so
    the same source under another cache directory is the same compile; the output's own path is not part of it."""
    if "-o" not in args or "c++-header" in args:
        return None
    out_at = args.index("-o") + 1
    if out_at >= len(args) or not args[out_at].endswith(_BUILT):
        return None
    digest = hashlib.sha256(REAL_COMPILER.encode())
    sources = 0
    for i, arg in enumerate(args):
        if i in (out_at - 1, out_at):
            continue
        if arg.endswith(_SOURCES) and os.path.isfile(arg):
            sources += 1
            digest.update(b"source:" + _file_hash(arg).encode())
        elif i > 0 and args[i - 1] == "-include" and os.path.isfile(arg):
            digest.update(b"include:" + _file_hash(arg).encode())
        else:
            digest.update(b"arg:" + arg.encode())
    return (digest.hexdigest(), args[out_at]) if sources else None


def main(args: list[str]) -> int:
    cache_dir = os.environ.get("TM_CXX_CACHE_DIR")
    key = cache_key(args) if cache_dir else None
    if key is None:
        return subprocess.call([REAL_COMPILER, *args])
    digest, output = key
    kept = os.path.join(cache_dir, digest + os.path.splitext(output)[1])
    if os.path.isfile(kept):
        shutil.copyfile(kept, output)
        shutil.copymode(kept, output)
        return 0
    code = subprocess.call([REAL_COMPILER, *args])
    if code == 0 and os.path.isfile(output):
        scratch = f"{kept}.{os.getpid()}.partial"
        shutil.copyfile(output, scratch)
        shutil.copymode(output, scratch)
        os.replace(scratch, kept)  # whole or absent: the other worker may be building the same source
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
