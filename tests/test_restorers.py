"""The restorer registry: discovery of restorer modules, names, and why no restorer covers a layer."""

from __future__ import annotations

import pkgutil

import pytest
import torch

import tensorizer_manifest.restorers as restorers
from tensorizer_manifest.layers import LayerDiff
from tensorizer_manifest.restorers import RESTORERS, Restorer, find_restorer, known_replays, register

pytest.importorskip("vllm")


def test_every_module_in_the_folder_registers_a_restorer():
    modules = {m.name for m in pkgutil.iter_modules(restorers.__path__)} - {"base"}
    registered = {type(r).__module__.rsplit(".", 1)[-1] for r in RESTORERS.values()}
    assert modules == registered


def test_names_are_unique_and_cannot_shadow_replay_values():
    class Again(Restorer):
        name = "cpu_unquantized_gemm"

    class PostLoad(Restorer):
        name = "post_load"

    for cls in (Again, PostLoad):
        with pytest.raises(ValueError, match="is taken"):
            register(cls())
    assert known_replays() == {"post_load", "none", *RESTORERS}


def test_a_layer_no_restorer_applies_to_gets_a_reason():
    restorer, why = find_restorer(torch.nn.Linear(2, 2), LayerDiff(changed_tensors={"weight"}))
    assert restorer is None and "no restorer for Linear" in why


def test_cpu_gemm_restorer_refuses_a_packed_weight_and_covers_the_dispatch_alone():
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    cpu_gemm = RESTORERS["cpu_unquantized_gemm"]
    layer = torch.nn.Linear(2, 2)
    layer.quant_method = UnquantizedLinearMethod()
    assert cpu_gemm.applies_to(layer)
    packed = LayerDiff(changed_tensors={"weight"}, changed_attrs={("layer", "cpu_linear"): print})
    assert "oneDNN" in cpu_gemm.covers(layer, packed)
    assert cpu_gemm.covers(layer, LayerDiff(changed_attrs={("layer", "cpu_linear"): print})) is None
    extra = LayerDiff(changed_attrs={("layer", "cpu_linear"): print, ("layer", "handle"): object()})
    assert "handle" in cpu_gemm.covers(layer, extra)


def test_attention_restorer_derives_floats_from_the_saved_buffers():
    attention = RESTORERS["attention_scales"]
    layer = torch.nn.Module()
    layer.register_buffer("_k_scale", torch.tensor(0.125))
    layer.register_buffer("_v_scale", torch.tensor(0.5))
    attention.replay(layer, None)
    assert layer._k_scale_float == 0.125 and layer._v_scale_float == 0.5
    assert torch.equal(layer._k_scale_cpu, torch.tensor(0.125))
    assert "added tensors" in attention.covers(layer, LayerDiff(added_tensors={"azp_adj"}))
