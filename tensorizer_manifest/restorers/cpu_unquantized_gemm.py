"""CPU unquantized linear and embedding layers: rebuild the ``cpu_linear`` dispatch.

vLLM's step builds ``layer.cpu_linear`` from the weight. When the step left
every tensor as it was (vLLM's torch fallback, or an embedding, which keeps its
weight), the saved weight is the raw one and calling vLLM's own dispatch on it
rebuilds the closure. When the step packed the weight into a oneDNN handle and
dropped it, nothing savable is left and the layer is saved raw instead.
"""

from __future__ import annotations

import torch

from .. import _vllm_compat
from .base import Restorer, register, state_beyond


class CpuUnquantizedGemmRestorer(Restorer):
    name = "cpu_unquantized_gemm"
    kernel_independent = True
    writes_tensors = False
    handles = (
        "vllm.model_executor.layers.linear.UnquantizedLinearMethod",
        "vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod",
    )
    verified_on = frozenset({"cpu"})
    rebuilds = "the cpu_linear dispatch (torch fallback or SGL/oneDNN chosen again from the kept weight)"

    def applies_to(self, module):
        method = type(getattr(module, "quant_method", None))
        return _vllm_compat.on_cpu() and method in _vllm_compat.unquantized_methods()

    def covers(self, module, diff):
        if not diff.tensors_untouched:
            changed = sorted(diff.added_tensors | diff.removed_tensors | diff.changed_tensors)
            return f"the step replaced or packed tensors {changed} (e.g. into a oneDNN handle)"
        why_not = state_beyond(diff, {("layer", "cpu_linear")})
        if why_not is not None:
            return why_not
        return None

    def replay(self, module, model_config):
        if _vllm_compat.skips_cpu_gemm_dispatch(module):
            module.cpu_linear = torch.nn.functional.linear
            return
        linear_method, _ = _vllm_compat.unquantized_methods()
        _vllm_compat.dispatch_cpu_unquantized_gemm(module, remove_weight=isinstance(module.quant_method, linear_method))


register(CpuUnquantizedGemmRestorer())
