"""The main job on the embedded default: tiny model -> save with manifest -> inspect -> load -> compare."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .. import _vllm_compat
from .._constants import LOAD_FORMAT, WORKER_EXTENSION
from ..embedded_models.tiny import DEMO_PROMPTS, build_tiny_model, engine_args
from ..save.from_source import save_checkpoint, shutdown
from ..storage.checkpoint import load_manifest
from .summary import render


def engine_options(**engine: Any) -> dict[str, Any]:
    """The settings of the demo's and the tests' engines: a tiny model's (a short context, one sequence,
    64 MiB of KV cache, eager); ``engine`` (a kind's own: another dtype, an fp8 KV cache) wins."""
    options: dict[str, Any] = dict(
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=1,
        seed=0,
        kv_cache_memory_bytes=64 << 20,
    )
    return options | engine


def generate_tokens(
    model_dir: str | Path,
    load_format: str = "auto",
    max_tokens: int = 16,
    report: dict | None = None,
    loader_config: dict | None = None,
    **engine: Any,
):
    """Greedy token ids for the demo prompts, from a fresh engine; also the seconds it took to start.

    With ``report`` (a dict), the manifest loader's report of rank 0 is stored into it;
    ``loader_config`` is the loader's ``model_loader_extra_config``.
    """
    options = engine_options(**engine)
    if report is not None:
        options.setdefault("worker_extension_cls", WORKER_EXTENSION)
    if loader_config:
        options["model_loader_extra_config"] = loader_config
    started = time.perf_counter()
    llm = _vllm_compat.LLM(model=str(model_dir), load_format=load_format, **options)
    startup = time.perf_counter() - started
    try:
        if report is not None:
            report.update(_vllm_compat.collective_rpc(llm, "tensorizer_manifest_report")[0] or {})
        tokens, prompt_lengths = greedy_tokens(llm, max_tokens)
    finally:
        shutdown(llm)
    return tokens, prompt_lengths, startup


def greedy_tokens(llm: Any, max_tokens: int = 16) -> tuple[list[list[int]], list[int]]:
    """Greedy token ids for the demo prompts from an engine already started, and the prompts' lengths."""
    return _vllm_compat.greedy_token_ids(llm, DEMO_PROMPTS, max_tokens)


def run_demo(work_dir: Path, kind: str, max_tokens: int, console, progress: bool = False) -> bool:
    """The demo's story on ``console``; ``progress`` draws bars of the save's write and the load's read."""
    work_dir = Path(work_dir).resolve()
    t0 = time.perf_counter()
    model_dir = build_tiny_model(work_dir / f"tiny-{kind}", kind)
    console.rule(f"1. tiny {kind} model at {model_dir} ({time.perf_counter() - t0:.1f}s, cached)")

    engine = engine_args(kind)
    ref_tokens, prompt_lengths, ref_start = generate_tokens(model_dir, "auto", max_tokens, **engine)
    console.rule(f"2. vLLM default loader (safetensors): engine up in {ref_start:.1f}s")

    out_dir = work_dir / f"tiny-{kind}-tensorized"
    t0 = time.perf_counter()
    save_checkpoint(model_dir, out_dir, dtype="bfloat16", engine_args=engine, progress=progress)
    console.rule(f"3. saved with a manifest to {out_dir} in {time.perf_counter() - t0:.1f}s")

    manifest, manifest_path = load_manifest(out_dir)
    render(manifest, str(manifest_path), console)

    report: dict = {}
    tm_tokens, _, tm_start = generate_tokens(
        out_dir, LOAD_FORMAT, max_tokens, report=report, loader_config={"progress": progress}, **engine
    )
    console.rule(f"4. loaded with load_format='tensorizer_manifest': engine up in {tm_start:.1f}s")
    laps = report.get("seconds", {})
    console.print(
        f"replay: vLLM's post-load step ran once on {len(report.get('post_load', []))} raw layer step(s); "
        f"{len(report.get('restored', {}))} processed layer(s) restored without it"
    )
    console.print(
        "load: "
        + ", ".join(f"{name} {seconds * 1000:.1f} ms" for name, seconds in laps.items())
        + f"; {report.get('bytes_read', 0):,} bytes read, "
        + f"hashes {'verified' if report.get('verify_hashes') else 'not verified'}"
    )

    ok = tm_tokens == ref_tokens
    for i, (prompt_len, ref, got) in enumerate(zip(prompt_lengths, ref_tokens, tm_tokens, strict=True)):
        mark = "[green]match[/green]" if ref == got else "[red]DIFFER[/red]"
        console.print(f"prompt {i} ({prompt_len} tokens): {mark}\n  default : {ref}\n  manifest: {got}")
    console.rule(
        "[green]token-for-token identical to vLLM's default loader[/green]" if ok else "[red]tokens differ[/red]"
    )
    return ok
