"""A long fuzzing run of the properties in tests/checks/test_validate_fuzz.py, outside pytest.

    .venv/bin/python scripts/fuzz_long.py --examples 5000
    .venv/bin/python scripts/fuzz_long.py --examples 500 --only tensor --seed 7
    .venv/bin/python scripts/fuzz_long.py --include-known-bugs      # also hit the open bugs the xfail tests pin
    .venv/bin/python scripts/fuzz_long.py --headroom-mb 1024        # the old address-space cap, as a diagnostic

The strategies and oracles are the test module's own; here they run with
more examples and a random (or given) seed instead of the derandomized CI
set. Each property prints how many examples it ran and how long it took;
a failure prints hypothesis' minimal falsifying example and its traceback,
and the run exits 1. There is no memory cap by default: every example asserts
that its peak memory growth stays within the recorded tensor bytes plus
``MEMORY_BOUND``, and the run prints the largest growth seen, by measure.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "checks"), str(ROOT / "tests"), str(ROOT)]

import test_validate_fuzz as tf  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

PROPERTIES = {
    "manifest-structure": (tf.manifest_edits, tf.check_manifest_edit),
    "manifest-protected": (tf.protected_edits, tf.check_protected_edit),
    "manifest-bytes": (tf.manifest_byte_edits, tf.check_manifest_bytes),
    "tensor-bytes": (lambda: tf.tensor_byte_edits(rebind=False), tf.check_tensor_bytes),
    "tensor-bytes-rebound": (lambda: tf.tensor_byte_edits(rebind=True), tf.check_tensor_bytes),
    "remote-tensor-bytes": (
        lambda: tf.tensor_byte_edits(rebind=False),
        lambda case: tf.check_tensor_bytes(case, remote=True),
    ),
    "remote-tensor-bytes-rebound": (
        lambda: tf.tensor_byte_edits(rebind=True),
        lambda case: tf.check_tensor_bytes(case, remote=True),
    ),
}


def run_property(name: str, examples: int, run_seed: int) -> bool:
    strategy, check = PROPERTIES[name]
    if name.startswith("remote"):
        tf.served()  # start the server and warm the remote path up before the clock starts
    calls = 0

    def body(case):
        nonlocal calls
        calls += 1
        check(case)

    test = seed(run_seed)(
        settings(
            max_examples=examples,
            deadline=None,
            database=None,
            print_blob=False,
            suppress_health_check=list(HealthCheck),
        )(given(strategy())(body))
    )
    start = time.perf_counter()
    try:
        test()
        failed = False
    except Exception:  # hypothesis re-raises the minimal failing example, with notes
        failed = True
        print(f"--- {name}: FAILURE ---", flush=True)
        traceback.print_exc(file=sys.stdout)
    elapsed = time.perf_counter() - start
    print(
        f"{name}: {calls} examples run (shrinking included), {elapsed:.1f} s, {'FAILED' if failed else 'ok'}",
        flush=True,
    )
    return not failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000, help="examples per property (default 2000)")
    parser.add_argument(
        "--remote-examples",
        type=int,
        default=None,
        help="examples per remote property (default: a fifth of --examples)",
    )
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random, printed)")
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        metavar="SUBSTRING",
        help=f"run the properties whose name contains one of these: {', '.join(PROPERTIES)}",
    )
    parser.add_argument(
        "--include-known-bugs", action="store_true", help="do not steer around the open bugs pinned by xfail tests"
    )
    parser.add_argument(
        "--headroom-mb",
        type=int,
        default=tf.MEMORY_HEADROOM >> 20,
        help="diagnostic: cap the address space a check may add (default 0: no cap; the memory bound is asserted)",
    )
    args = parser.parse_args()

    run_seed = args.seed if args.seed is not None else random.randrange(2**32)
    tf.SKIP_KNOWN_BUGS = not args.include_known_bugs
    tf.MEMORY_HEADROOM = args.headroom_mb << 20
    names = [n for n in PROPERTIES if not args.only or any(s in n for s in args.only)]
    print(
        f"fuzzing {', '.join(names)}: {args.examples} examples each, seed {run_seed}, "
        f"open bugs {'included' if args.include_known_bugs else 'steered around'}, "
        + (f"memory cap {args.headroom_mb} MiB" if args.headroom_mb else "no memory cap"),
        flush=True,
    )
    tf.pristine()  # build the checkpoint before the clock starts
    remote_examples = args.remote_examples if args.remote_examples is not None else max(1, args.examples // 5)
    ok = [
        run_property(name, remote_examples if name.startswith("remote") else args.examples, run_seed) for name in names
    ]
    print("outcomes:")
    for key, count in sorted(tf.STATS.items()):
        print(f"  {count:7d}  {key}")
    allowed = tf.pristine().recorded_bytes + tf.MEMORY_BOUND
    print(f"largest peak memory growth of an example (allowed {allowed / 2**20:.1f} MiB):")
    for key, peak in sorted(tf.PEAKS.items()):
        print(f"  {peak / 2**20:9.2f} MiB  {key}")
    print(
        f"{sum(ok)}/{len(ok)} properties held"
        + ("" if all(ok) else f"; failed: {', '.join(n for n, good in zip(names, ok, strict=True) if not good)}")
    )
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
