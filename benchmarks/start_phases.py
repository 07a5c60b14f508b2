"""Where a start's time goes, phase by phase, from the process's spawn to its first answer.

    .venv/bin/python benchmarks/start_phases.py MODEL_DIR --engine-arg enforce_eager=true
    .venv/bin/python benchmarks/start_phases.py CKPT --engine-arg load_format=tensorizer_manifest

Measured inside the process that starts (vLLM's engine in it: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Run as a
script, it starts one ``LLM()`` (bf16, the demo's serving settings unless ``--engine-arg`` says otherwise) and
prints each phase. ``bench_compile.py``'s children use ``StartClock`` the same way: made as the process's first
statement, imports timed with ``phase``, ``watch_vllm`` once vLLM is imported (the CPU worker's steps wrapped,
torch's own compile timers read), then ``result()``. The phases add up to the whole (from the parent's spawn time
where it passes one, ``SPAWNED_AT_ENV``), so nothing is left out unnamed: what vLLM's ``LLM()`` does around its
worker's steps is ``engine set-up``. Figures only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time

#: The spawn time a parent passes (``time.time()`` just before it starts the child).
SPAWNED_AT_ENV = "BENCH_SPAWNED_AT"

#: The phases, in the order a start meets them. ``compile: dynamo trace`` and ``compile: inductor`` (the backend:
#: a cold compile, or its cache's load) run inside the warm-up forward, and are taken out of it.
PHASES = (
    "interpreter and script",
    "import torch",
    "import vllm",
    "engine set-up",
    "model-class inspection",
    "model load",
    "compile: dynamo trace",
    "compile: inductor",
    "compile: AOT artifact load",
    "warm-up forward",
    "kv cache",
    "first answer",
)

#: An AOT artifact's load: vLLM's own (in the warm-up forward, where vLLM finds one in its cache) or the loader's,
#: from a compile form (in the model's load, once the weights are in); each is taken out of the phase it ran in.
_VLLM_AOT, _FORM_AOT = "vLLM's AOT load", "the form's AOT load"

#: vLLM inspects a model's class in a fresh interpreter (``registry._run_in_subprocess``: it imports vLLM again)
#: unless ``VLLM_CACHE_ROOT/modelinfos`` has the class's record: a fresh replica pays it, a warm restart does not.

#: The CPU worker's steps, and the phase each is (``vllm.v1.worker.cpu_worker.CPUWorker``).
_WORKER_STEPS = {
    "load_model": "model load",
    "determine_available_memory": "warm-up forward",
    "initialize_from_config": "kv cache",
    "compile_or_warm_up_model": "warm-up forward",
}


class StartClock:
    """Seconds per phase of this process's start; the spawn time from ``SPAWNED_AT_ENV`` (else the process's own)."""

    def __init__(self) -> None:
        spawned = os.environ.get(SPAWNED_AT_ENV)
        if spawned is None:  # this process's start, as the kernel recorded it
            import psutil

            spawned = psutil.Process().create_time()
        self.spawned_at = float(spawned)
        self.seconds: dict[str, float] = {"interpreter and script": time.time() - self.spawned_at}
        self._llm = 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @contextlib.contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    @contextlib.contextmanager
    def llm(self):
        """Around ``LLM()``: what its worker's steps did not take is the engine's set-up."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._llm += time.perf_counter() - started

    def watch_vllm(self) -> None:
        """Wrap the CPU worker's steps (each adds to its phase); vLLM must be imported, no engine started."""
        from vllm.compilation import decorators
        from vllm.model_executor.models import registry
        from vllm.v1.worker.cpu_worker import CPUWorker

        for name, phase in _WORKER_STEPS.items():
            self._wrap(CPUWorker, name, phase)
        self._wrap(registry, "_run_in_subprocess", "model-class inspection")
        self._wrap(decorators, "_try_load_aot_compiled_fn", _VLLM_AOT)
        from tensorizer_manifest import _vllm_compat

        self._wrap(_vllm_compat, "load_aot_artifact", _FORM_AOT)

    def _wrap(self, owner, name: str, phase: str) -> None:
        """``owner.name`` (a method of a class, or a function vLLM looks up in its module when it calls it) adds its
        time to ``phase``."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - started)

        setattr(owner, name, timed)

    def result(self) -> dict:
        """Seconds per phase (``PHASES``, absent ones 0), the whole from the spawn, and torch's compile timers."""
        from torch._dynamo.utils import compilation_time_metrics

        timers = {name: sum(values) for name, values in compilation_time_metrics.items()}
        # dynamo's trace and guards; the backend: inductor's compile or its cache's load, reached through dynamo
        # (``call_user_compiler``) or, where vLLM compiles ahead of time, through AOTAutograd's dispatcher
        dynamo = timers.get("bytecode_tracing", 0.0) + timers.get("build_guards", 0.0)
        backend = max(
            timers.get("OutputGraph.call_user_compiler", 0.0), timers.get("create_aot_dispatcher_function", 0.0)
        )
        seconds = {phase: self.seconds.get(phase, 0.0) for phase in PHASES}
        seconds["compile: dynamo trace"], seconds["compile: inductor"] = dynamo, backend
        vllm_aot, form_aot = self.seconds.get(_VLLM_AOT, 0.0), self.seconds.get(_FORM_AOT, 0.0)
        seconds["compile: AOT artifact load"] = vllm_aot + form_aot
        seconds["warm-up forward"] = max(0.0, seconds["warm-up forward"] - dynamo - backend - vllm_aot)
        seconds["model load"] = max(0.0, seconds["model load"] - form_aot)
        worker = sum(
            self.seconds.get(p, 0.0) for p in ("model load", "warm-up forward", "kv cache", "model-class inspection")
        )
        seconds["engine set-up"] = max(0.0, self._llm - worker)
        return {
            "phases": seconds,
            "whole": time.time() - self.spawned_at,
            "llm_seconds": self._llm,
            "torch_compile_timers": timers,
        }


def _value(text: str):
    """An ``--engine-arg`` value: JSON where it parses (``true``, ``128``), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def main() -> None:
    clock = StartClock()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model directory, or a checkpoint with --engine-arg load_format=...")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="an LLM() option")
    args = parser.parse_args()
    options = {"dtype": "bfloat16", "seed": 0, "max_model_len": 128, "max_num_seqs": 1,
               "kv_cache_memory_bytes": 64 << 20}  # fmt: skip
    options.update({k: _value(v) for k, _, v in (a.partition("=") for a in args.engine_arg)})
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with clock.phase("import torch"):
        import torch  # noqa: F401
    with clock.phase("import vllm"):
        from vllm import LLM, SamplingParams
    clock.watch_vllm()
    with clock.llm():
        llm = LLM(model=args.model, **options)
    with clock.phase("first answer"):
        (answer,) = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
    result = clock.result()
    for phase, seconds in result["phases"].items():
        print(f"{phase:<36} {seconds:7.2f} s")
    print(f"{'whole, spawn to first answer':<36} {result['whole']:7.2f} s   tokens {list(answer.outputs[0].token_ids)}")


if __name__ == "__main__":
    main()
