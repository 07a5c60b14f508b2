"""``verify-kernels``: prove on this machine that each restorer a model uses gives vLLM's own result.

For one model and one set of engine options: save it processed (unverified
restorers included), start vLLM's default loader on the original and the
manifest loader on the checkpoint, each in this process, and compare: the
greedy tokens; every tensor of every processed layer, bitwise (dtype, shape,
stride, bytes); and the number of ``process_weights_after_loading`` calls per
class, counted by wrapping vLLM's own methods (raw layers once, processed
never). One ``VerificationRecord`` per restorer comes out, pass or fail.
"""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import _vllm_compat
from .._constants import __version__
from ..embedded_models.tiny import DEMO_PROMPTS
from ..format.schema import Manifest, full_name
from ..format.verification_records import VerificationRecord
from ..restorers import RESTORERS
from ..save.from_source import save_checkpoint, shutdown
from ..storage.checkpoint import load_manifest


@dataclass
class VerifyResult:
    """What ``verify_kernels`` found; ``records`` holds one verdict per restorer."""

    checkpoint: Path
    reference_tokens: list[list[int]]
    manifest_tokens: list[list[int]]
    stepped_processed: list[str] = field(default_factory=list)
    """Processed layers that a ``process_weights_after_loading`` ran on at load (must be none)."""
    mismatches: dict[str, list[str]] = field(default_factory=dict)
    """Per restorer: processed tensors that differ from the default loader's."""
    records: list[VerificationRecord] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.records) and all(r.result == "pass" for r in self.records)


def _engine(model: str | Path, load_format: str, engine_args: dict[str, Any]):
    options = dict(
        enforce_eager=True, max_num_seqs=1, seed=0, max_model_len=256, kv_cache_memory_bytes=256 << 20, dtype="auto"
    )
    options.update(engine_args)
    return _vllm_compat.LLM(model=str(model), load_format=load_format, **options)


def _tensors_of(manifest: Manifest) -> Callable[[Any], dict[str, torch.Tensor]]:
    """A worker-side function returning a copy of every processed layer's tensors, by full name."""
    wanted = {m.path: [t.name for t in m.tensors] for m in manifest.modules if m.state == "processed"}

    def collect(worker) -> dict[str, torch.Tensor]:
        model = _vllm_compat.worker_model(worker)
        out = {}
        for path, names in wanted.items():
            module = model.get_submodule(path)
            for name in names:
                tensor = getattr(module, name, None)
                if isinstance(tensor, torch.Tensor):
                    out[full_name(path, name)] = tensor.detach().clone()
        return out

    return collect


def _run(model, load_format, engine_args, collect, max_tokens, also=None) -> tuple[list[list[int]], dict, Any]:
    """Start an engine, copy the tensors ``collect`` picks, generate greedily; ``also`` runs on the worker too."""
    llm = _engine(model, load_format, engine_args)
    try:
        tensors = _vllm_compat.collective_rpc(llm, collect)[0]
        extra = _vllm_compat.collective_rpc(llm, also)[0] if also is not None else None
        tokens, _ = _vllm_compat.greedy_token_ids(llm, DEMO_PROMPTS, max_tokens)
        return tokens, tensors, extra
    finally:
        shutdown(llm)


@contextmanager
def recording_post_load(classes: set[type[Any]]) -> Iterator[set[int]]:
    """Record the ``id`` of every layer a ``process_weights_after_loading`` of these classes ran on."""
    stepped: set[int] = set()
    undo = []
    for cls in classes:
        original = cls.__dict__.get("process_weights_after_loading")

        def recording(self, *args, __fn=cls.process_weights_after_loading, **kwargs):
            stepped.add(id(args[0] if args and isinstance(args[0], torch.nn.Module) else self))
            return __fn(self, *args, **kwargs)

        cls.process_weights_after_loading = recording
        undo.append((cls, original))
    try:
        yield stepped
    finally:
        for cls, original in reversed(undo):
            if original is None:
                del cls.process_weights_after_loading
            else:
                cls.process_weights_after_loading = original


def _step_classes(manifest: Manifest) -> set[type[Any]]:
    """vLLM classes whose post-load step a layer of this model may run: quant methods and attention layers."""
    classes: set[type[Any]] = set()
    for m in manifest.modules:
        for qualified in (m.quant_method, m.module_class):
            cls = _vllm_compat.class_named(qualified or "")
            if cls is not None and hasattr(cls, "process_weights_after_loading"):
                classes.add(cls)
    return classes


def _layer_ids(worker) -> dict[int, str]:
    model = _vllm_compat.worker_model(worker)
    return {id(module): path for path, module in model.named_modules()}


def _compare(manifest: Manifest, reference: dict, loaded: dict) -> dict[str, list[str]]:
    """Bitwise, per restorer; a non-persistent buffer each engine computes (a rotary cache) may differ by 2 ulp."""
    out: dict[str, list[str]] = {}
    for m in manifest.modules:
        if m.state != "processed":
            continue
        problems = out.setdefault(m.replay, [])
        for t in m.tensors:
            name = full_name(m.path, t.name)
            ref, got = reference.get(name), loaded.get(name)
            if ref is None or got is None:
                problems.append(f"{name}: missing from the {'default' if ref is None else 'manifest'} engine")
            elif (ref.dtype, ref.shape, ref.stride()) != (got.dtype, got.shape, got.stride()):
                problems.append(f"{name}: {ref.dtype}{tuple(ref.shape)} vs {got.dtype}{tuple(got.shape)}")
            elif not torch.equal(ref.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8)):
                ulp = torch.finfo(ref.dtype).eps if ref.is_floating_point() else 0.0
                if not (t.kind == "buffer" and not t.persistent and torch.allclose(ref, got, rtol=0, atol=2 * ulp)):
                    problems.append(f"{name}: bytes differ")
    return out


def _device() -> tuple[str, str, str | None]:
    if _vllm_compat.on_cpu():
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        return "cpu", name, None
    cap = _vllm_compat.device_capability()
    return (*_vllm_compat.device_description(), cap and f"{cap[0]}.{cap[1]}")


def verify_kernels(
    model: str | Path, work_dir: str | Path, *, engine_args: dict[str, Any] | None = None, max_tokens: int = 16
) -> VerifyResult:
    """Save ``model`` processed, load it both ways in this process, compare; one record per restorer used."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # both engines in this process: their tensors are compared
    engine_args = dict(engine_args or {})
    checkpoint = Path(work_dir).expanduser().resolve() / "checkpoint"
    save_checkpoint(model, checkpoint, allow_unverified=True, engine_args=engine_args)
    manifest, _ = load_manifest(checkpoint)
    collect = _tensors_of(manifest)
    reference_tokens, reference, _ = _run(model, "auto", engine_args, collect, max_tokens)

    with recording_post_load(_step_classes(manifest)) as stepped:
        manifest_tokens, loaded, paths = _run(
            checkpoint, "tensorizer_manifest", engine_args, collect, max_tokens, _layer_ids
        )
    stepped_paths = {paths[i] for i in stepped if i in paths}
    processed = {m.path for m in manifest.modules if m.state == "processed"}
    mismatches = _compare(manifest, reference, loaded)
    result = VerifyResult(checkpoint, reference_tokens, manifest_tokens, sorted(stepped_paths & processed), mismatches)
    result.records = _records(manifest, result, str(model))
    return result


def _records(manifest: Manifest, result: VerifyResult, model: str) -> list[VerificationRecord]:
    device_type, device_name, capability = _device()
    tokens_equal = result.manifest_tokens == result.reference_tokens
    records = []
    for name in sorted({m.replay for m in manifest.modules if m.replay in RESTORERS}):
        layers = [m for m in manifest.modules if m.replay == name]
        stepped = [m.path for m in layers if m.path in result.stepped_processed]
        problems = result.mismatches.get(name, [])
        detail = []
        if not tokens_equal:
            detail.append("greedy tokens differ from vLLM's default loader")
        if problems:
            detail.append(f"{len(problems)} processed tensors differ, e.g. {problems[0]}")
        if stepped:
            detail.append(f"vLLM's post-load step ran on {len(stepped)} processed layers, e.g. {stepped[0]}")
        forms = []
        for m in layers:
            if m.form and m.form not in forms:
                forms.append(dict(m.form))
        records.append(
            VerificationRecord(
                restorer=name,
                result="fail" if detail else "pass",
                device_type=device_type,
                device_name=device_name,
                device_capability=capability,
                cpu_features=list(manifest.fingerprint.cpu_features),
                vllm_version=manifest.fingerprint.vllm_version,
                tensorizer_manifest_version=__version__,
                model=model,
                layers=len(layers),
                kernel_classes=sorted({k.kernel_class for m in layers for k in m.kernels}),
                form=forms,
                date=datetime.date.today().isoformat(),
                detail="; ".join(detail),
            )
        )
    return records
