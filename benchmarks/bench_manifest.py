"""How manifest cost scales with model size, against the issue's targets. Prints figures; asserts nothing.

    .venv/bin/python benchmarks/bench_manifest.py                      # 1k, 10k, 100k modules: minutes on 2 cores
    .venv/bin/python benchmarks/bench_manifest.py --sizes 1000,10000   # under a minute
    .venv/bin/python benchmarks/bench_manifest.py --rounds 9 --json-out figures.json

Targets: a 100k-module manifest decoded and validated in under 100 ms; ``inspect`` answers in under 0.3 s.
The first is out of reach of a JSON format (the untyped parse of those 130 MB alone takes about 2 s here), so
the benchmark also prints decode + check as a ratio to the untyped parse of the same bytes, paired per round:
what validating costs beyond reading the document at all, on the same machine state (docs/performance.md
proposes 25 us per module up to 10k modules, the largest manifests of today's models).

1. Synthetic manifests built directly as msgspec structs (no torch, no tensor file) with ``--sizes``
   module records shaped like a vLLM Llama (norms, qkv/o/gate_up/down projections with vLLM's
   Parameter classes and ``input_dim``/``output_dim`` attributes, attention layers with scale buffers,
   kernels and runtime state, raw and processed layers, a tied ``lm_head``), with the right digest and
   tensor count and a ``digest`` seal (as saved without keys), so that ``check_manifest`` finds nothing.
   For each size: ``encode_manifest``, ``decode_manifest`` (from bytes), ``check_manifest`` (the seal, the
   record-level checks and the digest), and
   decode + check, as the loader and ``validate`` do them; then, to show where decode and check spend
   their time, the untyped ``msgspec.json.decode`` of the same bytes (labelled "peek": ``decode_manifest``
   parsed the document that way first, to read ``format_version``, until it learned to read it alone only
   when the full decode fails), the typed decode alone, ``digest_records`` alone and ``check_seal`` alone.
2. ``tensorizer-manifest inspect DIR --json`` as a fresh process on the smallest and the largest
   manifest, next to a bare ``python -c pass`` (the floor no CLI can beat).

Each figure is the median (with min and max) of ``--rounds`` rounds; within a round every size and
phase runs once, interleaved, so that all see the same load on this shared, noisy machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import blake3  # noqa: E402
import msgspec  # noqa: E402

# helpers.synthetic and tensorizer_manifest.checks.validate bring torch (seconds): imported where used, so --help
# is fast.
from tensorizer_manifest.format.schema import (  # noqa: E402
    FORMAT_VERSION,
    KernelRecord,
    Manifest,
    ModuleRecord,
    RuntimeAttr,
    TensorFileRef,
    TensorRecord,
    decode_manifest,
    digest_records,
    encode_manifest,
    seal_manifest,
)

DECODE_TARGET_S, INSPECT_TARGET_S = 0.100, 0.300
HIDDEN, INTER, QKV, VOCAB = 4096, 14336, 6144, 128256
VLLM_PARAM = "vllm.model_executor.parameter.ModelWeightParameter"
TORCH_PARAM = "torch.nn.parameter.Parameter"
GEMM, SCALES = "cpu_unquantized_gemm", "attention_scales"
LAYERS = "vllm.model_executor.layers."
UNTYPED = "  untyped json.decode (peek)"


def tensor(path: str, name: str, shape: list[int], cls: str | None, attrs: dict, dtype: str = "bfloat16"):
    stride, step = [], 1
    for d in reversed(shape):
        stride.insert(0, step)
        step *= d
    full, itemsize = f"{path}.{name}", 4 if dtype == "float32" else 2
    digest = "blake3:" + blake3.blake3(full.encode()).hexdigest()
    form = dict(name=name, kind="parameter" if cls else "buffer", dtype=dtype, shape=shape, stride=stride)
    return TensorRecord(**form, param_class=cls, param_attrs=attrs, nbytes=step * itemsize, hash=digest, key=full)


def module(path: str, cls: str, tensors: list, replay: str = "none", **kw) -> ModuleRecord:
    state = "raw" if replay == "post_load" else "processed"
    return ModuleRecord(path=path, module_class=LAYERS + cls, state=state, replay=replay, tensors=tensors, **kw)


def linear(path: str, out: int, inp: int, raw: bool, cls: str = "linear.RowParallelLinear") -> ModuleRecord:
    tensors = [tensor(path, "weight", [out, inp], VLLM_PARAM, {"input_dim": 1, "output_dim": 0})]
    if cls.startswith("linear.QKV"):
        tensors.append(tensor(path, "bias", [out], TORCH_PARAM, {"output_dim": 0}))
    method = LAYERS + "linear.UnquantizedLinearMethod"
    if raw:  # vLLM's post-load step runs at load: nothing to restore
        return module(path, cls, tensors, "post_load", quant_method=method)
    kernel = KernelRecord(owner="layer", attr="cpu_linear", kernel_class="torch.nn.functional.linear")
    runtime = RuntimeAttr(owner="layer", name="cpu_linear", type="builtins.function", rebuilt_by=GEMM)
    return module(path, cls, tensors, GEMM, quant_method=method, kernels=[kernel], runtime_state=[runtime])


def norm(path: str) -> ModuleRecord:
    return module(path, "layernorm.RMSNorm", [tensor(path, "weight", [HIDDEN], TORCH_PARAM, {})])


def attention(path: str) -> ModuleRecord:
    scales = [tensor(path, s, [], None, {}, "float32") for s in ("_k_scale", "_v_scale", "_q_scale")]
    kernel = KernelRecord(owner="layer", attr="impl", kernel_class="vllm.v1.attention.backends.cpu_attn.Impl")
    floats = dict(owner="layer", type="builtins.float", rebuilt_by=SCALES, value=1.0)
    runtime = [RuntimeAttr(name=t.name + "_float", **floats) for t in scales[:2]]
    method = LAYERS + "quantization.kv_cache.BaseKVCacheMethod"
    return module(
        path, "attention.Attention", scales, SCALES, quant_method=method, kernels=[kernel], runtime_state=runtime
    )


def build_manifest(n_modules: int) -> Manifest:
    """``n_modules`` (>= 3) records: embedding, decoder layers of 7 modules (every 8th raw), norm, tied lm_head."""
    from helpers.synthetic import FINGERPRINT

    embed = "model.embed_tokens"
    weight = tensor(embed, "weight", [VOCAB, HIDDEN], VLLM_PARAM, {"input_dim": 1, "output_dim": 0})
    modules = [module(embed, "vocab_parallel_embedding.VocabParallelEmbedding", [weight])]
    i = 0
    while len(modules) < n_modules - 2:
        p, raw = f"model.layers.{i}", i % 8 == 7
        modules += [
            norm(f"{p}.input_layernorm"),
            linear(f"{p}.self_attn.qkv_proj", QKV, HIDDEN, raw, "linear.QKVParallelLinear"),
            attention(f"{p}.self_attn.attn"),
            linear(f"{p}.self_attn.o_proj", HIDDEN, HIDDEN, raw),
            norm(f"{p}.post_attention_layernorm"),
            linear(f"{p}.mlp.gate_up_proj", 2 * INTER, HIDDEN, raw),
            linear(f"{p}.mlp.down_proj", HIDDEN, INTER, raw),
        ]
        i += 1
    modules = modules[: n_modules - 2] + [norm("model.norm")]
    head = linear("lm_head", VOCAB, HIDDEN, False, "vocab_parallel_embedding.ParallelLMHead")
    head.tensors[0].key, head.tensors[0].alias_of, head.tensors[0].hash = None, weight.key, weight.hash  # tied
    modules.append(head)
    stored = [t for m in modules for t in m.tensors if t.key is not None]
    ref = TensorFileRef(path="model.tensors", size=sum(t.nbytes for t in stored), tensor_count=len(stored), digest="")
    manifest = Manifest(
        format_version=FORMAT_VERSION, producer="bench", fingerprint=FINGERPRINT, tensor_file=ref, modules=modules
    )
    ref.digest = digest_records(manifest.ordered_records())
    manifest.seal = seal_manifest(manifest)  # every manifest saved since 0.3.0 has one, and loading checks it
    return manifest


def timed(fn) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def stats(seconds: list[float], per: int = 1) -> dict:
    ms = [s * 1e3 for s in seconds]
    med = statistics.median(ms)
    return {"median_ms": med, "min_ms": min(ms), "max_ms": max(ms), "us_per_module": med * 1e3 / per}


def bench_phases(sizes: list[int], rounds: int) -> list[dict]:
    from tensorizer_manifest.checks.records import check_manifest
    from tensorizer_manifest.checks.seal import check_seal

    typed = msgspec.json.Decoder(Manifest)
    cases = []
    for n in sizes:
        manifest = build_manifest(n)
        data = encode_manifest(manifest)
        problems, _ = check_manifest(decode_manifest(data), Path("m.json"))
        assert not problems, problems[:3]  # a benchmark of a failing check would mean nothing
        phases = {
            "encode_manifest": lambda m=manifest: encode_manifest(m),
            "decode_manifest": lambda d=data: decode_manifest(d),
            "check_manifest": lambda m=manifest: check_manifest(m, Path("m.json")),
            "decode + check": lambda d=data: check_manifest(decode_manifest(d), Path("m.json")),
            UNTYPED: lambda d=data: msgspec.json.decode(d),
            "  typed Decoder(Manifest)": lambda d=data: typed.decode(d),
            "  digest_records": lambda m=manifest: digest_records(m.ordered_records()),
            "  check_seal": lambda m=manifest: check_seal(m, None),
        }
        tensors = sum(len(m.tensors) for m in manifest.modules)
        cases.append({"modules": n, "tensors": tensors, "json_bytes": len(data), "phases": phases, "data": data})
    times: list[dict[str, list[float]]] = [{} for _ in cases]
    for _ in range(rounds):
        for case, case_times in zip(cases, times, strict=True):
            for name, fn in case["phases"].items():
                case_times.setdefault(name, []).append(timed(fn))
    for case, case_times in zip(cases, times, strict=True):
        case["phases"] = {name: stats(t, case["modules"]) for name, t in case_times.items()}
        # Paired per round: what checking costs beyond reading the document at all, on the same machine state.
        paired = [a / b for a, b in zip(case_times["decode + check"], case_times[UNTYPED], strict=True)]
        case["decode_check_over_untyped_parse"] = {
            "median": statistics.median(paired),
            "min": min(paired),
            "max": max(paired),
        }
    return cases


def bench_inspect(manifests: dict[int, bytes], runs: int, workdir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    commands = {"python -c pass": [sys.executable, "-c", "pass"]}
    for n in sorted({min(manifests), max(manifests)}):
        directory = workdir / f"ckpt-{n}"
        directory.mkdir()
        (directory / "model.manifest.json").write_bytes(manifests[n])
        (directory / "model.tensors").touch()  # never read by inspect
        cli = [sys.executable, "-m", "tensorizer_manifest.cli", "inspect", str(directory), "--json"]
        commands[f"inspect --json ({n} modules)"] = cli
    for name, cmd in commands.items():  # warm-up: bytecode caches, page cache; and a sanity check
        out = subprocess.run(cmd, env=env, capture_output=True, check=True).stdout
        if "inspect" in name:
            assert len(json.loads(out)["layers"]) == int(name.split("(")[1].split()[0])
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, cmd in commands.items():
            start = time.perf_counter()
            subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
            times[name].append(time.perf_counter() - start)
    return {name: stats(t) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,100000", help="module counts (default 1000,10000,100000)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per figure (default 5)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write every figure to this JSON file")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    env = f"python {platform.python_version()}, msgspec {msgspec.__version__}, {os.cpu_count()} CPUs"
    print(f"{env} ({platform.processor() or platform.machine()}); median [min, max] of {args.rounds} rounds")
    start = time.perf_counter()
    results = bench_phases(sizes, args.rounds)
    print(f"\n1. manifest phases (in-process)\n   {'modules':>7} {'tensors':>7} {'JSON MB':>7}  {'phase':<28}", end="")
    print(f" {'median ms':>9} {'min':>8} {'max':>8} {'us/module':>9}")
    for r in results:
        for i, (name, s) in enumerate(r["phases"].items()):
            head = f"{r['modules']:>7} {r['tensors']:>7} {r['json_bytes'] / 1e6:7.2f}" if i == 0 else " " * 23
            print(f"   {head}  {name:<28} {s['median_ms']:9.2f} {s['min_ms']:8.2f} {s['max_ms']:8.2f}", end="")
            print(f" {s['us_per_module']:9.2f}")
    big = results[-1]
    both = big["phases"]["decode + check"]["median_ms"] / 1e3
    verdict = "meets it" if both <= DECODE_TARGET_S else f"misses by {(both - DECODE_TARGET_S) * 1e3:.0f} ms"
    ratio = f"{both / DECODE_TARGET_S:.2f}x the {DECODE_TARGET_S * 1e3:.0f} ms target"
    print(f"   {big['modules']} modules, decode + check: {both * 1e3:.0f} ms = {ratio} ({verdict})")
    for r in results:
        paired = r["decode_check_over_untyped_parse"]
        print(
            f"   {r['modules']:>7} modules, decode + check / untyped JSON parse of the same bytes, paired per "
            f"round: {paired['median']:.2f} x [{paired['min']:.2f}-{paired['max']:.2f}]"
        )

    with tempfile.TemporaryDirectory(prefix="tm-bench-manifest-") as tmp:
        inspect = bench_inspect({r["modules"]: r.pop("data") for r in results}, args.rounds, Path(tmp))
    print(f"\n2. fresh processes\n   {'command':<36} {'median ms':>9} {'min':>8} {'max':>8} {'x 0.3 s':>8}")
    for name, s in inspect.items():
        ratio = s["median_ms"] / 1e3 / INSPECT_TARGET_S
        print(f"   {name:<36} {s['median_ms']:9.1f} {s['min_ms']:8.1f} {s['max_ms']:8.1f} {ratio:8.2f}")
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    if args.json_out:
        doc = {
            "environment": env,
            "rounds": args.rounds,
            "targets": {"decode_check_s": DECODE_TARGET_S, "inspect_s": INSPECT_TARGET_S},
            "manifests": results,
            "processes": inspect,
        }
        args.json_out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
