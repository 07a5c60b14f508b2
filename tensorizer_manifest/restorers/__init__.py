"""Restorers, one module per restorer, named after it; this package imports them in a declared order.

Supporting a new kernel is one new module here (a ``Restorer`` subclass, and
``register`` of an instance), its place in ``BUILT_IN_MODULES``, and its test.
``find_restorer`` asks the restorers in registration order and takes the first
that covers a layer: the built-ins in ``BUILT_IN_MODULES``' order (a module's
own in the order it registers them), then any added with ``register``
(``tensorizer_manifest.register_restorer``) in the order added, so a built-in
that covers a layer wins over them. The inventory takes the first restorer
naming a class in ``handles`` by the same order. Two built-ins may apply to one
kind of layer only where the later declares the earlier in ``asked_after``,
with what decides between them; importing the package checks that two which
name one class in ``handles`` do (``undeclared_overlaps``). The built-ins, each
restoring what one kind of kernel's post-load step made: ``cpu_unquantized_gemm``
(CPU unquantized linear and embeddings), ``attention_scales`` (attention's
q/k/v/prob scales), ``cpu_wna16`` (CPU weight-only 4-bit linear), ``cpu_moe``
(CPU mixture-of-experts, a family of three), ``cpu_fp8_linear`` (CPU block FP8
linear, AMX); unverified: ``mla_attention`` (MLA's absorbed projections) and, on
GPUs, ``cuda_wna16`` (Marlin, Machete), ``cuda_fp8_linear`` (FP8 linear),
``cuda_fused_moe`` (fused-MoE experts) and ``modelopt_nvfp4_linear`` (ModelOpt
NVFP4 linear; ``docs/kernels.md``). Beside them, not
imported here: ``base`` (what a restorer is) and ``inventory`` (every vLLM
kernel class with a post-load step, and which restorer covers it; the
``kernels`` command).
May import ``model``, ``_vllm_compat``, ``storage`` and ``format``.
"""

from __future__ import annotations

import importlib

from .base import RESTORERS, Restorer, find_restorer, known_replays, register, undeclared_overlaps

#: The modules of the built-in restorers, in the order ``find_restorer`` asks them. Each is named after the
#: restorer it registers, but for ``cpu_moe``, a family of three (its docstring says why).
BUILT_IN_MODULES = (
    "attention_scales",
    "cpu_fp8_linear",
    "cpu_unquantized_gemm",
    "cpu_moe",
    "cpu_wna16",
    "cuda_fp8_linear",
    "cuda_fused_moe",
    "cuda_wna16",
    "mla_attention",
    "modelopt_nvfp4_linear",
)

for _module in BUILT_IN_MODULES:
    importlib.import_module(f"{__name__}.{_module}")

if _problems := undeclared_overlaps(RESTORERS.values()):
    raise ImportError("built-in restorers overlap without a declared order: " + "; ".join(_problems))

__all__ = [
    "BUILT_IN_MODULES",
    "RESTORERS",
    "Restorer",
    "find_restorer",
    "known_replays",
    "register",
    "undeclared_overlaps",
]
