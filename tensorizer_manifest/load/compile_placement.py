"""Compile forms at load: what a cold engine would compile, placed where vLLM looks before it compiles.

A compile form is code (pickles, generated Python and C++, shared objects) that vLLM would run without a check of
its own, and its cache key does not cover the CPU's instruction set. So one is used only where all of these hold,
and otherwise the engine compiles as it would have, after one log line that says why (never a refusal):

- the engine compiles at all (``enforce_eager`` engines never read a form's files);
- the generation's seal was checked with the user's signing key, or the user trusts whoever can write the
  checkpoint by name (``trust_compile_forms``);
- the machine kind (``machine_kind``: the ISA the generated kernels use), vLLM, torch and the engine's settings
  that shape the compiled graph (``compile_settings_hash``) all equal the form's;
- the archive and every file in it match their hashes, checked before one is written into a fresh private
  directory.

All of it is decided before the model is built (``use_compile_form``), so an engine whose form is not used compiles
exactly as it would have.

A form holds one of two things. vLLM's AOT artifacts (``CompileForm.aot``, what ``add-form --compile`` makes where
vLLM makes them): for each module vLLM compiles, its traced and compiled function for each rank
(``aot/<module>/rank<r>/model``) and the kernels that function runs (``aot/<module>/inductor_cache``), loaded into
the module once its weights are in (``load_aot_artifacts``), so that the engine neither traces nor compiles; vLLM's
own load of them fails on CPU (``_vllm_compat.load_aot_artifact`` says why), so the loader loads them itself. Or,
made with ``VLLM_USE_AOT_COMPILE=0``, inductor's cache alone (``TORCHINDUCTOR_CACHE_DIR``, and with vLLM's own backend
its ``compilation_config.cache_dir``): used with vLLM's AOT switched off (set by the loader before the model is
built), the engine still traces and inductor takes every graph from the form.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from .. import _vllm_compat
from ..errors import ConfigurationError, IntegrityError, TensorizerManifestError
from ..format.generation import CompileForm, Generation
from ..storage.compile_archive import read_archive, unpack

logger = logging.getLogger("vllm.tensorizer_manifest")

AOT_VARIABLE = "VLLM_USE_AOT_COMPILE"
"""vLLM's switch between its AOT artifacts and its other compile cache (read when the model is built)."""
INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
"""Where inductor keeps its compiled graphs and kernels (read at every use)."""
INDUCTOR_CACHE = "inductor_cache"
"""Inductor's cache inside a compile form's directory (vLLM's own ``VLLM_COMPILE`` backend uses the same name)."""
CACHE_ROOT_VARIABLE = "VLLM_CACHE_ROOT"
"""Where vLLM saves its AOT artifacts (read when a module is first called)."""
AOT_FOLDER = "aot"
"""An AOT form's artifacts, a folder per compiled module: ``rank<r>/model`` for each rank, ``inductor_cache``."""

#: CPU flags that change what inductor's C++ and vLLM's CPU kernels are built for; a form made where one of these
#: differs may not run here (illegal instructions) or may run other kernels.
_ISA_FLAGS = frozenset(
    "avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni avx512_fp16 avx_vnni "
    "amx_tile amx_bf16 amx_int8 amx_fp16 asimd sve sve2 bf16 i8mm".split()
)


def machine_kind(device_type: str = "cpu") -> list[str]:
    """The machine kind a compile form is made for: on CPU the architecture, the features that steer vLLM's CPU
    kernels (``_vllm_compat.cpu_features``, as form sets record them) and every ISA flag of ``_ISA_FLAGS`` the CPU
    has (``/proc/cpuinfo``: inductor's generated C++ is built for them); on CUDA the device and its capability."""
    if device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return [f"cuda:sm_{major}{minor}", f"device:{torch.cuda.get_device_name()}"]
    return [f"{device_type}:{platform.machine()}", *_vllm_compat.cpu_features(), *sorted(_cpu_flags() & _ISA_FLAGS)]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def compile_settings_hash(vllm_config: Any) -> str:
    """vLLM's own hash of what shapes the compiled graph (``VllmConfig.compute_hash``: model, dtype, quantization,
    parallel layout, batch and context sizes, compilation settings, vLLM's version), computed with the model's
    path set aside: the same checkpoint in another directory, or fetched from S3, compiles the same graph."""
    model_config = vllm_config.model_config
    path = model_config.model
    moved = [f.name for f in dataclasses.fields(model_config) if getattr(model_config, f.name, None) == path]
    try:
        for name in moved:
            object.__setattr__(model_config, name, "<checkpoint>")
        return vllm_config.compute_hash()
    finally:
        for name in moved:
            object.__setattr__(model_config, name, path)


def compile_settings(vllm_config: Any) -> dict[str, str]:
    """The main engine settings under ``compile_settings_hash``, in words: what a person compares when it differs."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    scheduler, compilation = vllm_config.scheduler_config, vllm_config.compilation_config
    return {
        "tensor_parallel_size": str(parallel.tensor_parallel_size),
        "pipeline_parallel_size": str(parallel.pipeline_parallel_size),
        "dtype": str(model.dtype).removeprefix("torch."),
        "quantization": str(model.quantization),
        "max_model_len": str(model.max_model_len),
        "max_num_seqs": str(scheduler.max_num_seqs),
        "max_num_batched_tokens": str(scheduler.max_num_batched_tokens),
        "compilation_mode": str(getattr(compilation, "mode", None)),
    }


@dataclasses.dataclass(frozen=True)
class EngineCompile:
    """What this engine would compile for: the fields a compile form must equal to be used here."""

    machine: list[str]
    vllm_version: str
    torch_version: str
    config_hash: str
    settings: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, vllm_config: Any) -> EngineCompile:
        return cls(
            machine=machine_kind(vllm_config.device_config.device_type),
            vllm_version=_vllm_compat.vllm_version(),
            torch_version=str(torch.__version__),
            config_hash=compile_settings_hash(vllm_config),
            settings=compile_settings(vllm_config),
        )


def engine_compiles(vllm_config: Any) -> bool:
    """Whether this engine runs torch.compile (``enforce_eager`` and compilation mode 0 do not)."""
    mode = getattr(vllm_config.compilation_config, "mode", None)
    return not vllm_config.model_config.enforce_eager and mode is not None and int(mode) != 0


def why_not(form: CompileForm, engine: EngineCompile) -> str | None:
    """Why ``form`` cannot be used by ``engine`` (None: it can)."""
    if form.machine != engine.machine:
        only_form = sorted(set(form.machine) - set(engine.machine))
        only_here = sorted(set(engine.machine) - set(form.machine))
        return (
            f"made for another machine kind (it has {only_form or 'nothing more'}, this one {only_here or 'no more'})"
        )
    if form.vllm_version != engine.vllm_version:
        return f"made by vLLM {form.vllm_version} (this engine: {engine.vllm_version})"
    if form.torch_version != engine.torch_version:
        return f"made with torch {form.torch_version} (this engine: {engine.torch_version})"
    if form.config_hash != engine.config_hash:
        differ = [f"{name} {value} (this engine: {engine.settings[name]})" for name, value in form.settings.items()
                  if name in engine.settings and engine.settings[name] != value]  # fmt: skip
        named = ", ".join(differ) or (
            "context length, batch sizes, dtype, quantization, parallel layout or compilation settings"
        )
        return f"made for other engine settings ({named}): run add-form --compile with this engine's settings"
    return None


def choose(forms: list[CompileForm], engine: EngineCompile) -> tuple[CompileForm | None, str]:
    """The form ``engine`` can use, or None and why none (each form's reason)."""
    reasons = []
    for form in forms:
        why = why_not(form, engine)
        if why is None:
            return form, ""
        reasons.append(why)
    return None, "; ".join(dict.fromkeys(reasons))


def aot_switched_off() -> str | None:
    """Make vLLM use its non-AOT compile cache in this process (what a form holds); why it cannot, or None.
    vLLM reads the variable when it builds a model, unless an engine before this one fixed its variables."""
    before = os.environ.get(AOT_VARIABLE)
    os.environ[AOT_VARIABLE] = "0"
    if _vllm_compat.aot_compile_enabled():
        if before is None:
            del os.environ[AOT_VARIABLE]
        else:
            os.environ[AOT_VARIABLE] = before
        return (
            f"an engine started earlier in this process fixed vLLM's {AOT_VARIABLE}=1; set {AOT_VARIABLE}=0 "
            "before the first engine starts to use compile forms"
        )
    return None


def compile_into(vllm_config: Any, directory: Path) -> None:
    """Point this engine's compilation at ``directory``, before the model is built: vLLM's own cache (its
    ``compilation_config.cache_dir``, with ``VLLM_COMPILE``), inductor's (``TORCHINDUCTOR_CACHE_DIR``: on CPU vLLM
    runs torch.compile with inductor directly, ``DYNAMO_TRACE_ONCE``) and, where vLLM makes AOT artifacts, its
    cache root, under which it saves them and points inductor's cache again."""
    vllm_config.compilation_config.cache_dir = str(directory)
    os.environ[INDUCTOR_CACHE_VARIABLE] = str(directory / INDUCTOR_CACHE)
    if _vllm_compat.aot_compile_enabled():
        if _vllm_compat.envs_fixed():
            raise ConfigurationError(
                "an engine started earlier in this process fixed vLLM's variables, so its AOT artifacts cannot be "
                "made into a compile form here: run add-form --compile in a process of its own"
            )
        os.environ[CACHE_ROOT_VARIABLE] = str(directory)


def _module_folder(name: str) -> str:
    return name or "__model__"


def arrange_aot_artifacts(directory: Path, saved: list[dict]) -> None:
    """After ``add-form --compile``'s engine compiled into ``directory`` (``compile_into``) with vLLM's AOT on: its
    artifacts moved from vLLM's cache layout (a folder named by a hash of the model's path, among others) to the
    form's (``AOT_FOLDER``), everything else in it removed. ``saved``: each rank's ``{"rank": r, "modules": {name:
    path}}``, where vLLM saved each compiled module's artifact (None: it saved none)."""
    missing = [f"{name or 'the model'} (rank {report['rank']})" for report in saved
               for name, path in report["modules"].items() if path is None]  # fmt: skip
    if missing or not any(report["modules"] for report in saved):
        raise ConfigurationError(
            f"{directory}: vLLM saved no AOT artifact of {', '.join(missing) or 'any module'} (is "
            "VLLM_DISABLE_COMPILE_CACHE set?); set VLLM_USE_AOT_COMPILE=0 to make a form of inductor's cache alone"
        )
    arranged = directory / AOT_FOLDER
    for report in saved:
        for name, path in report["modules"].items():
            folder = arranged / _module_folder(name)
            (folder / f"rank{report['rank']}").mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, folder / f"rank{report['rank']}" / "model")
            kernels = Path(path).parent.parent / INDUCTOR_CACHE  # vLLM's <hash>/inductor_cache, shared by the ranks
            if kernels.is_dir() and not (folder / INDUCTOR_CACHE).exists():
                shutil.copytree(kernels, folder / INDUCTOR_CACHE, symlinks=True)
    for entry in directory.iterdir():
        if entry != arranged:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def load_aot_artifacts(model: Any, vllm_config: Any, directory: Path, where: str) -> int:
    """Once the weights are in: each compiled module of ``model`` given its AOT artifact from the form placed in
    ``directory``, so that it runs that instead of tracing and compiling; how many were loaded. A module the form
    has no artifact of, or whose artifact does not load, compiles as vLLM would have, after one log line why."""
    rank = vllm_config.parallel_config.rank
    loaded = 0
    for name, module in _vllm_compat.compiled_modules(model).items():
        folder = directory / AOT_FOLDER / _module_folder(name)
        artifact = folder / f"rank{rank}" / "model"
        label = f"{name or 'the model'} (rank {rank})"
        if not artifact.is_file():
            logger.warning("%s has no AOT artifact of %s; vLLM compiles it", where, label)
            continue
        before = os.environ.get(INDUCTOR_CACHE_VARIABLE)
        os.environ[INDUCTOR_CACHE_VARIABLE] = str(folder / INDUCTOR_CACHE)  # the kernels the artifact runs
        try:
            _vllm_compat.load_aot_artifact(module, str(artifact))
        except Exception as exc:  # noqa: BLE001 - whatever torch or vLLM raise, the module compiles as it would have
            if before is None:
                os.environ.pop(INDUCTOR_CACHE_VARIABLE, None)
            else:
                os.environ[INDUCTOR_CACHE_VARIABLE] = before
            logger.warning("%s: the AOT artifact of %s did not load (%s: %s); vLLM compiles it", where, label,
                           type(exc).__name__, exc)  # fmt: skip
            continue
        loaded += 1
        logger.info("%s: vLLM's AOT artifact of %s loaded from it: nothing is traced or compiled", where, label)
    return loaded


@dataclasses.dataclass(frozen=True)
class PlacedForm:
    """A compile form this engine uses: its files, checked, in a private ``directory``; ``aot``: vLLM's AOT
    artifacts, loaded into the model once its weights are in (``load_aot_artifacts``)."""

    directory: Path
    aot: bool


def use_compile_form(
    vllm_config: Any, generation: Generation | None, root: Any, trusted_by: str | None, seal_problem: str | None
) -> PlacedForm | None:
    """Before the model is built: this engine's compile form, its files checked into a fresh private directory
    (that the engine now compiles from, ``compile_into``, where the form is inductor's cache), or None.
    ``trusted_by``: the user's signing key or their opt-in (None: neither); ``seal_problem``: why the generation's
    seal does not check with the keys given (None: it does). Decided here in full, so that an engine whose form is
    not used compiles exactly as it would have. Logs why a checkpoint's form is not used; never raises for one."""
    if generation is None or not generation.compile_forms or not engine_compiles(vllm_config):
        return None
    where = f"{root}: compile form"
    # Every rank decides alike (one generation, one layout's settings, one machine): the first says why, once.
    said = logging.WARNING if vllm_config.parallel_config.rank == 0 else logging.DEBUG

    def not_used(why: str) -> PlacedForm | None:
        """The decision, no form (None), said with why."""
        logger.log(said, "%s not used: %s; vLLM compiles", where, why)
        return None

    if trusted_by is None:
        return not_used(
            "the checkpoint's seal is not checked with your signing key (give signing_key_file, or "
            "trust_compile_forms=true to trust whoever can write the checkpoint)"
        )
    if seal_problem is not None:
        return not_used(f"the generation's seal does not check: {seal_problem}")
    if vllm_config.compilation_config.cache_dir:
        return not_used("compilation_config.cache_dir is set; vLLM compiles into it")
    form, why = choose(generation.compile_forms, EngineCompile.of(vllm_config))
    if form is None:
        return not_used(why)
    target = Path(tempfile.mkdtemp(prefix="tensorizer-manifest-compile-"))
    archive = f"{root}/{form.archive.path}"
    try:
        unpack(read_archive(root, form.archive), form.archive, form.files, target, archive)
    except (OSError, TensorizerManifestError) as exc:
        shutil.rmtree(target, ignore_errors=True)
        return not_used(str(exc) if isinstance(exc, IntegrityError) else f"{archive}: not readable ({exc})")
    if not form.aot:  # inductor's cache alone: the engine traces, with vLLM's AOT off, and inductor takes from it
        cannot = aot_switched_off()
        if cannot is not None:
            shutil.rmtree(target, ignore_errors=True)
            return not_used(cannot)
        compile_into(vllm_config, target)
    atexit.register(shutil.rmtree, target, True)
    _vllm_compat.after_each_compile(
        lambda took, compiled: logger.info(
            "%s: inductor took %d compiled graph(s) from it and compiled %d%s",
            where,
            took,
            compiled,
            "" if compiled == 0 else " (what the form lacks: other shapes or settings than it was made with)",
        )
    )
    logger.info(
        "%s for %s used (%d files, %.1f MB, checked; trusted by %s; %s): the engine loads what it holds instead of "
        "compiling",
        where,
        " ".join(form.machine[:3]),
        len(form.files),
        form.archive.size / 1e6,
        trusted_by,
        "vLLM's AOT artifacts" if form.aot else f"inductor's cache, {AOT_VARIABLE}=0",
    )
    return PlacedForm(target, form.aot)
