"""A toy model whose ``load_weights`` does what vLLM's models do, for the base's unit tests: a stacked
parameter filled from two source tensors through its ``weight_loader``, a parameter without one through
``default_weight_loader``, a source tensor nothing takes. No engine: the claims on real vLLM models are the
end-to-end tests' (``test_e2e_base``)."""

from __future__ import annotations

import torch

from tensorizer_manifest import _vllm_compat


class Stacked(torch.nn.Module):
    """Two source tensors (``a``, ``b``) stacked into one parameter, as vLLM's ``QKVParallelLinear`` does."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard):
        param.data[shard * 2 : shard * 2 + 2].copy_(loaded)


class Toy(torch.nn.Module):
    def __init__(self, buffers_everything: bool = False):
        super().__init__()
        self.proj = Stacked()
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        self.buffers_everything = buffers_everything

    def load_weights(self, weights):
        default = _vllm_compat.default_weight_loader()
        params = dict(self.named_parameters())
        if self.buffers_everything:
            weights = list(weights)  # what no vLLM model does: the iterator is spent before any loader runs
        loaded = set()
        for name, tensor in weights:
            if name in ("proj.a", "proj.b"):
                params["proj.weight"].weight_loader(params["proj.weight"], tensor, 0 if name.endswith("a") else 1)
                loaded.add("proj.weight")
            elif name == "norm.weight":
                getattr(params[name], "weight_loader", default)(params[name], tensor)
                loaded.add(name)
            # "rotary.inv_freq": recomputed by the model, taken by no parameter
        return loaded


def source() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("proj.a", torch.randn(2, 3, generator=generator)),
        ("rotary.inv_freq", torch.randn(3, generator=generator)),
        ("norm.weight", torch.randn(3, generator=generator)),
        ("proj.b", torch.randn(2, 3, generator=generator)),
    ]
