"""CUDA weight-only 4/8-bit linear layers on Marlin or Machete (GPTQ, AWQ, compressed-tensors WNA16). Unverified.

Both ``MPLinearKernel`` steps repack the weights and permute the scales for the
kernel (Marlin pads to its tiles, also permutes the bias, and puts an empty
zero-point Parameter on the layer when there are no zero points; Machete
prepacks for sm_90 and folds the scales into the zero points): full passes
over every weight, all of it tensors, saved processed. Beyond the tensors,
Marlin's step leaves two things this restorer sets again exactly as vLLM
writes them: the kernel's ``w_zp_name`` defaulted to ``"w_zp"``, and
``input_global_scale = None`` on the layer (for int8 activations with several
groups it is a tensor instead, and saved). Machete's step leaves nothing else.
vLLM has no pre-processed branch for these methods; replay is this module.

The kernel class (chosen by the GPU), the activation type and the device
capability are the layer's ``form``: a checkpoint processed for Machete
(Hopper) or for Marlin on one generation is refused before reading elsewhere.
``verified_on`` is empty: nothing in this project has run it on a GPU.
"""

from __future__ import annotations

from ..format.schema import qualified_class
from .base import Restorer, device_capability, layer_kernel, register, state_beyond

_MP = "vllm.model_executor.kernels.linear.mixed_precision"
MARLIN = f"{_MP}.marlin.MarlinLinearKernel"
MACHETE = f"{_MP}.machete.MacheteLinearKernel"


def _kernel(module):
    return layer_kernel(module, "kernel", {MARLIN, MACHETE})


def _marlin_input_global_scale_is_tensor(kernel) -> bool:
    """Marlin's step registers ``input_global_scale`` for int8 activations with several groups."""
    import torch

    c = kernel.config
    groups = 1 if c.group_size == -1 else c.partition_weight_shape[0] // c.group_size
    return c.act_type == torch.int8 and groups > 1


class CudaWna16Restorer(Restorer):
    name = "cuda_wna16"
    handles = (
        MARLIN,
        MACHETE,
        "vllm.model_executor.layers.quantization.auto_gptq.AutoGPTQLinearMethod",
        "vllm.model_executor.layers.quantization.auto_awq.AutoAWQMarlinLinearMethod",
        "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16.CompressedTensorsWNA16",
    )
    verified_on = frozenset()
    asked_after = {
        "cpu_wna16": "both handle the GPTQ, AWQ and compressed-tensors methods; the kernel tells them apart "
        "(CPUWNA16LinearKernel there, Marlin or Machete here), so at most one applies to a layer",
    }
    rebuilds = "Marlin: the kernel's w_zp_name and input_global_scale=None; Machete: nothing (its layout is the form)"

    def applies_to(self, module):
        return _kernel(module) is not None

    def form(self, module):
        _, kernel = _kernel(module)
        return {
            "kernel": qualified_class(kernel),
            "act_type": str(kernel.config.act_type),
            "capability": device_capability(),
        }

    def creates_tensors(self, module):
        _, kernel = _kernel(module)
        if qualified_class(kernel) != MARLIN:
            return set()
        created = set() if kernel.config.zero_points else {kernel.w_zp_name or "w_zp"}
        if _marlin_input_global_scale_is_tensor(kernel):
            created.add("input_global_scale")
        return created

    def _allowed_attrs(self, owner, kernel):
        if qualified_class(kernel) != MARLIN:
            return set()
        allowed = {(owner, "w_zp_name")}
        if not _marlin_input_global_scale_is_tensor(kernel):
            allowed.add(("layer", "input_global_scale"))
        return allowed

    def covers(self, module, diff):
        owner, kernel = _kernel(module)
        allowed = self._allowed_attrs(owner, kernel)
        why_not = state_beyond(diff, allowed)
        if why_not is not None:
            return why_not
        for key, value in diff.changed_attrs.items():
            if key[1] == "w_zp_name" and value != "w_zp":
                return f"the step set {key} to {value!r}, not the 'w_zp' Marlin defaults to"
            if key == ("layer", "input_global_scale") and value is not None:
                return "the step set input_global_scale to a value, not None"
        if diff.added_tensors - self.creates_tensors(module):
            return f"the step added tensors {sorted(diff.added_tensors)} that a freshly built layer lacks"
        if diff.removed_tensors:
            return f"the step removed tensors {sorted(diff.removed_tensors)}"
        kernel_tensors = {kernel.w_q_name, kernel.w_s_name, kernel.w_zp_name or "w_zp", "bias", "input_global_scale"}
        if diff.changed_tensors - kernel_tensors:
            return f"the step changed tensors {sorted(diff.changed_tensors - kernel_tensors)} the kernel does not own"
        return None

    def replay(self, module, model_config):
        _, kernel = _kernel(module)
        if qualified_class(kernel) != MARLIN:
            return  # Machete's step creates nothing but the repacked tensors
        # The lines of MarlinLinearKernel.process_weights_after_loading that are not tensor transforms
        # (the empty zero-point Parameter it makes is a saved tensor, already in place).
        if kernel.w_zp_name is None:
            kernel.w_zp_name = "w_zp"
        if not _marlin_input_global_scale_is_tensor(kernel):
            module.input_global_scale = None


register(CudaWna16Restorer())
