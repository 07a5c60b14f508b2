"""How much validation costs, next to the load it protects. Prints figures; asserts nothing.

    .venv/bin/python benchmarks/bench_validate.py            # 256 MB, under ~2 minutes on 2 cores
    .venv/bin/python benchmarks/bench_validate.py --mb 1024 --repeat 5

1. Hashing throughput over ``--mb`` MB of bfloat16 tensor bytes: ``hash_tensor``
   (blake3, the manifest's content hash), blake3 with ``max_threads=1`` and with
   ``blake3.AUTO``, and hashlib's sha256 and blake2b for comparison.
2. A checkpoint of about ``--mb`` MB written by ``write_checkpoint``: the time of
   ``validate_checkpoint(verify_hashes=False)`` (metadata only: what the loader's
   ``check_files`` does), ``validate_checkpoint(verify_hashes=True)``, and reading
   every tensor with ``TensorFileReader`` (the load itself, without a model), as
   ratios measured in the same run. The file was just written, so it is read from
   the page cache: these are CPU costs, not disk costs.

Each figure is the best of ``--repeat`` interleaved runs (this is a shared, noisy machine).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import blake3  # noqa: E402

# torch and the package's tensor modules (which bring torch: seconds) are imported where used, so that --help
# is fast; main() imports them before the clock starts.
if TYPE_CHECKING:
    import torch

    from tensorizer_manifest.save.capture import Capture

MB = 1 << 20
GB = 1e9


def best_of(repeat: int, fns: list) -> list[float]:
    """The best time of each function over ``repeat`` rounds, interleaved so that all see the same load."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def random_bf16(numel: int, seed: int = 0) -> torch.Tensor:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator, dtype=torch.float32).to(torch.bfloat16)


def bench_hashing(mb: int, repeat: int) -> None:
    from tensorizer_manifest.live_model.tensors import hash_tensor, tensor_bytes

    rows = max(1, mb * MB // (4096 * 2))
    tensor = random_bf16(rows * 4096).reshape(rows, 4096)
    data = tensor_bytes(tensor)
    size = data.nbytes
    print(f"\n1. hashing {size / MB:.0f} MB of bfloat16 [{rows}, 4096] tensor bytes (best of {repeat})")
    cases = [
        ("hash_tensor (blake3, as the manifest uses it)", lambda: hash_tensor(tensor), "1"),
        ("blake3(max_threads=1)", lambda: blake3.blake3(data, max_threads=1).digest(), "1"),
        (
            "blake3(max_threads=blake3.AUTO)",
            lambda: blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest(),
            f"up to {os.cpu_count()}",
        ),
        ("hashlib.sha256", lambda: hashlib.sha256(data).digest(), "1"),
        ("hashlib.blake2b", lambda: hashlib.blake2b(data).digest(), "1"),
    ]
    seconds = best_of(repeat, [fn for _, fn, _ in cases])
    results = [(name, threads, s, size / s / GB) for (name, _, threads), s in zip(cases, seconds, strict=True)]
    base = results[3][3]  # sha256
    print(f"   {'hash':<48} {'threads':>8} {'seconds':>9} {'GB/s':>7} {'x sha256':>9}")
    for name, threads, seconds, rate in results:
        print(f"   {name:<48} {threads:>8} {seconds:9.3f} {rate:7.2f} {rate / base:9.1f}")


def big_capture(mb: int) -> Capture:
    """Layers of bfloat16 [rows, 4096] weights (and a float32 scale each), about ``mb`` MB in all."""
    import torch
    from helpers.synthetic import FINGERPRINT

    from tensorizer_manifest.save.capture import Capture, CapturedLayer, TensorSlot

    per_layer = 32 * MB  # a 4096 x 4096 bfloat16 matrix
    n_layers = max(1, round(mb * MB / per_layer))
    rows = max(1, mb * MB // n_layers // (4096 * 2))
    layers = []
    for i in range(n_layers):
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(random_bf16(rows * 4096, seed=i).reshape(rows, 4096), requires_grad=False)
        module.weight_scale = torch.nn.Parameter(torch.rand(rows, 1), requires_grad=False)
        slots = {name: TensorSlot(p, "parameter", True, (id(p), 0, 0)) for name, p in module._parameters.items()}
        layers.append(CapturedLayer(f"model.layers.{i}.mlp.down_proj", module, "processed", "none", slots, [], [], ""))
    return Capture(fingerprint=FINGERPRINT, layers=layers)


def read_all(directory: Path) -> int:
    from tensorizer_manifest.storage.tensor_file import TensorFileReader

    tensor_path = next(directory.glob("*.tensors"))
    reader = TensorFileReader(tensor_path)
    total = 0
    try:
        for key in sorted(reader.keys):
            tensor = reader.read(key)
            total += tensor.numel() * tensor.element_size()
    finally:
        reader.close()
    return total


def read_and_hash_all(directory: Path) -> None:
    from tensorizer_manifest.live_model.tensors import hash_tensor
    from tensorizer_manifest.storage.tensor_file import TensorFileReader

    tensor_path = next(directory.glob("*.tensors"))
    reader = TensorFileReader(tensor_path)
    try:
        for key in sorted(reader.keys):
            hash_tensor(reader.read(key))
    finally:
        reader.close()


def bench_checkpoint(mb: int, repeat: int, workdir: Path) -> None:
    from tensorizer_manifest.checks.validate import validate_checkpoint
    from tensorizer_manifest.save.write import write_checkpoint

    capture = big_capture(mb)
    directory = workdir / "ckpt"
    start = time.perf_counter()
    manifest = write_checkpoint(capture, directory, "model")
    write_s = time.perf_counter() - start
    del capture
    size = manifest.tensor_file.size
    stored = manifest.tensor_file.tensor_count
    report = validate_checkpoint(directory)
    assert report.ok, report.problems  # a benchmark of a failing validation would mean nothing
    print(
        f"\n2. checkpoint of {size / MB:.0f} MB, {stored} stored tensors, written in {write_s:.1f} s "
        f"(page cache warm; best of {repeat})"
    )
    loaded = read_all(directory)
    rows = [
        ("validate_checkpoint(verify_hashes=False)", lambda: validate_checkpoint(directory, verify_hashes=False)),
        ("validate_checkpoint(verify_hashes=True)", lambda: validate_checkpoint(directory, verify_hashes=True)),
        ("load: TensorFileReader.read every tensor", lambda: read_all(directory)),
        ("load + hash_tensor of every tensor", lambda: read_and_hash_all(directory)),
    ]
    results = list(zip([name for name, _ in rows], best_of(repeat, [fn for _, fn in rows]), strict=True))
    load_s = results[2][1]
    print(f"   {'step':<48} {'seconds':>9} {'GB/s':>7} {'x load':>8}")
    for i, (name, seconds) in enumerate(results):
        rate = "-" if i == 0 else f"{loaded / seconds / GB:.2f}"  # metadata only reads no tensor bytes
        print(f"   {name:<48} {seconds:9.4f} {rate:>7} {seconds / load_s:8.3f}")
    meta = results[0][1]
    print(
        f"   metadata-only validation: {meta * 1e3:.1f} ms ({meta / load_s:.1%} of the load); "
        f"full validation: {results[1][1] / load_s:.2f}x the load"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--mb", type=int, default=256, help="MB of tensor bytes to hash and to write as a checkpoint (default 256)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure; the best is shown (default 3)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where to write the checkpoint (default: a temporary directory)"
    )
    args = parser.parse_args()
    import torch

    import tensorizer_manifest.checks.validate  # noqa: F401

    # Imported before the clock starts, as they were at the top of the module (the total includes no import).
    import tensorizer_manifest.save.capture  # noqa: F401
    import tensorizer_manifest.save.write  # noqa: F401

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, blake3 {blake3.__version__}, "
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"
    )
    start = time.perf_counter()
    bench_hashing(args.mb, args.repeat)
    workdir = Path(tempfile.mkdtemp(prefix="tm-bench-", dir=args.workdir))
    try:
        bench_checkpoint(args.mb, args.repeat, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
