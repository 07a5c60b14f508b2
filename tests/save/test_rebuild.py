"""Rebuilding a running engine's pre-step state (``rebuild``): its pieces without an engine. The claims (a
default-loaded engine saves what the capture path saves; changed weights are refused) are proved on real
vLLM in ``test_e2e_running_engine.py`` and ``test_e2e_serve.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from tensorizer_manifest.errors import CheckpointNotFoundError, NotReproducibleError, UnsupportedModelError  # noqa: E402
from tensorizer_manifest.save import rebuild  # noqa: E402


class _Kernel:
    """Stands in for a vLLM kernel object: forked, since its module is one of vLLM's layer packages."""

    def __init__(self):
        self.config = {"group": 32}
        self.handle = None

    def run(self):
        return self.handle


class _Method:
    def __init__(self, kernel):
        self.kernel = kernel
        self.linear_method = kernel.run


class _Config:
    """Not one of vLLM's layer packages: shared, never copied."""


for _cls in (_Kernel, _Method):
    _cls.__module__ = "vllm.model_executor.layers.test_doubles"


def test_the_state_before_the_step_is_a_private_copy_the_step_cannot_reach():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    config = _Config()
    for layer in model:
        layer.quant_method = _Method(_Kernel())
        layer.config = config
        layer.flag = "as loaded"
    model[1].quant_method.kernel = model[0].quant_method.kernel  # shared by two layers
    rebuild.remember_pre_step_attributes(model)
    live = model[0].quant_method
    model[0].flag, live.kernel.handle = "after the step", object()  # what vLLM's step does to the live layer
    before = rebuild._PRE_STEP_ATTRIBUTES[model[0]]
    assert before["flag"] == "as loaded"
    assert not set(rebuild._CONTAINERS) & set(before)  # tensors are vLLM's record, not copied here
    assert before["quant_method"] is not live and before["quant_method"].kernel is not live.kernel
    assert before["quant_method"].kernel.handle is None  # as before the step, whatever the step set
    assert before["config"] is config  # configs are shared
    # a shadow gets its own copies again, so that its step changes neither the engine nor the record
    memo: dict = {}
    shadows = [rebuild.fork_state(rebuild._PRE_STEP_ATTRIBUTES[layer], memo) for layer in model]
    kernel = shadows[0]["quant_method"].kernel
    assert kernel is not before["quant_method"].kernel and kernel is not live.kernel
    assert shadows[1]["quant_method"].kernel is kernel  # shared in the engine, shared in the shadow
    assert shadows[0]["quant_method"].linear_method.__self__ is kernel  # bound methods follow their object
    kernel.handle = "the shadow's"
    assert live.kernel.handle != "the shadow's" and before["quant_method"].kernel.handle is None


def test_a_loader_bound_to_the_live_layer_is_bound_to_its_shadow():
    live, shadow = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    weight.weight_loader = live.extra_repr  # any method of the live layer
    rebound = rebuild._rebind(weight, live, shadow)
    assert rebound.weight_loader.__self__ is shadow


def test_a_large_tensor_held_before_the_step_is_not_kept_alive_and_its_loss_is_named():
    layer = torch.nn.Module()
    layer.small = torch.zeros(4)
    layer.large = torch.zeros(rebuild._MAX_KEPT_TENSOR_BYTES // 4 + 1)  # float32: just over the limit
    layer.nested = [torch.zeros(rebuild._MAX_KEPT_TENSOR_BYTES // 4 + 1)]  # inside a list, likewise
    rebuild.remember_pre_step_attributes(layer)
    before = rebuild._PRE_STEP_ATTRIBUTES[layer]
    assert before["small"] is layer.small
    assert isinstance(before["large"], rebuild._Released) and isinstance(before["nested"][0], rebuild._Released)
    assert rebuild.fork_state(before["large"], {}) is layer.large  # still alive: the same tensor
    layer.nested = None  # the step replaced it: nothing keeps it
    with pytest.raises(NotReproducibleError, match="is gone"):
        rebuild.fork_state(before, {})


def test_a_layer_quantized_online_is_refused_before_anything_is_rebuilt():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].quant_method = type("OnlineMethod", (), {"uses_meta_device": True})()
    with pytest.raises(UnsupportedModelError, match=r"^0: .*online quantization"):
        rebuild._refuse_online_quantization(model)


def test_a_source_shard_gone_after_the_first_weight_is_a_typed_error():
    class Loader:
        def get_all_weights(self, model_config, model):
            yield "model.embed_tokens.weight", torch.zeros(2)
            raise FileNotFoundError("model-00002-of-00002.safetensors")

    config = type("ModelConfig", (), {"model": "/models/m"})()
    weights = rebuild._source_weights(Loader(), config, None)
    assert next(weights)[0] == "model.embed_tokens.weight"
    with pytest.raises(CheckpointNotFoundError, match=r"cannot be read \(model-00002-of-00002"):
        next(weights)


def test_the_tensors_an_attention_impl_keeps_must_be_the_rebuilt_bytes():
    """MLA on AMX computes with ``_w_uk_packed``/``_w_uv_packed`` on its impl, not with kv_b_proj's (released)
    weight: a difference there is a changed engine, refused; equal bytes, or no impl, pass."""

    class Impl:
        pass

    def attention(packed: torch.Tensor) -> torch.nn.Module:
        module = torch.nn.Module()
        module.impl = Impl()
        module.impl._w_uk_packed, module.impl.scale = packed, 1.0
        return module

    live = attention(torch.arange(8, dtype=torch.bfloat16))
    same = rebuild._Layer("model.layers.0.self_attn.attn", live, attention(torch.arange(8, dtype=torch.bfloat16)))
    rebuild.Rebuilder._compare_impl_tensors(same)
    rebuild.Rebuilder._compare_impl_tensors(rebuild._Layer("x", torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    changed = attention(torch.arange(8, dtype=torch.bfloat16))
    changed.impl._w_uk_packed[3] = 100
    with pytest.raises(NotReproducibleError, match=r"self_attn\.attn: the attention kernel's _w_uk_packed differs"):
        rebuild.Rebuilder._compare_impl_tensors(rebuild._Layer("model.layers.0.self_attn.attn", live, changed))
    missing = attention(torch.arange(8, dtype=torch.bfloat16))
    del missing.impl._w_uk_packed
    with pytest.raises(NotReproducibleError, match="_w_uk_packed"):
        rebuild.Rebuilder._compare_impl_tensors(rebuild._Layer("a", live, missing))


# -- fork_state: what is copied, what is shared ------------------------------------------------------------------


def test_containers_are_copied_and_tensors_modules_and_other_objects_shared():
    tensor, module, config = torch.zeros(2), torch.nn.Linear(2, 2), _Config()
    value = {"t": tensor, "m": module, "c": config, "items": [tensor, (module, "x")], "cls": _Kernel}
    forked = rebuild.fork_state(value, {})
    assert forked is not value and forked.keys() == value.keys()
    assert forked["items"] is not value["items"] and forked["items"][1] is not value["items"][1]
    assert forked["t"] is tensor and forked["items"][0] is tensor  # a tensor is never copied here
    assert forked["m"] is module and forked["c"] is config and forked["cls"] is _Kernel
    forked["items"].append("added to the fork")
    assert len(value["items"]) == 2  # the original is not reached through the copy


def test_the_memo_keeps_what_is_shared_shared_and_cycles_closed():
    shared, kernel = {"group": 32}, _Kernel()
    kernel.owner = kernel  # a vLLM object that refers to itself
    loop: list = []
    loop.append(loop)
    memo: dict = {}
    first = rebuild.fork_state({"a": shared, "b": shared, "kernel": kernel, "loop": loop}, memo)
    assert first["a"] is first["b"] is not shared
    assert first["kernel"] is not kernel and first["kernel"].owner is first["kernel"]
    assert first["loop"] is not loop and first["loop"][0] is first["loop"]
    # a second value forked with the same memo meets the same copies (two layers holding one kernel)
    second = rebuild.fork_state([shared, kernel], memo)
    assert second[0] is first["a"] and second[1] is first["kernel"]
    assert rebuild.fork_state([shared], {})[0] is not first["a"]  # a new memo, new copies


def test_a_vllm_object_is_copied_but_a_method_of_another_object_is_left_as_it_is():
    config = _Config()
    method = _Method(_Kernel())
    method.shared_config = config
    bound = torch.nn.Linear(2, 2).extra_repr
    method.other = bound
    forked = rebuild.fork_state(method, {})
    assert type(forked) is _Method and forked is not method and forked.kernel is not method.kernel
    assert forked.shared_config is config and forked.other is bound


# -- fork_state: large tensors held by weak reference ----------------------------------------------------------


def test_only_a_tensor_over_the_limit_is_released_and_only_when_asked():
    limit = rebuild._MAX_KEPT_TENSOR_BYTES
    at_limit, over = torch.zeros(limit, dtype=torch.uint8), torch.zeros(limit + 1, dtype=torch.uint8)
    kept = rebuild.fork_state({"at": at_limit, "over": (over,)}, {}, release_large=True, where="layer")
    assert kept["at"] is at_limit
    assert isinstance(kept["over"][0], rebuild._Released) and kept["over"][0].ref() is over
    assert rebuild.fork_state(over, {}) is over  # not asked: kept as it is
    assert rebuild.fork_state(kept, {})["over"][0] is over  # resolved while it is alive


def test_a_released_tensor_gone_is_refused_naming_the_layer_that_held_it():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    model[0][0].packed = torch.zeros(rebuild._MAX_KEPT_TENSOR_BYTES + 1, dtype=torch.uint8)
    rebuild.remember_pre_step_attributes(model)
    before = rebuild._PRE_STEP_ATTRIBUTES[model[0][0]]
    assert isinstance(before["packed"], rebuild._Released)
    del model[0][0].packed  # the step replaced it
    with pytest.raises(NotReproducibleError, match=r"^0\.0: a tensor this layer held .* is gone") as refused:
        rebuild.fork_state(before, {})
    assert "tensorizer_manifest_capture" in str(refused.value)  # and what to do instead


# -- the rebuild and its comparisons, on plain torch modules -----------------------------------------------------


class _Model(torch.nn.Module):
    """Two linear layers and a buffer no source holds, loaded as vLLM's models load (``load_weights``)."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4, bias=False)
        self.a.register_buffer("made_at_init", torch.arange(3.0))
        if tied:
            self.b.weight = self.a.weight

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        for name, tensor in weights:
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)


def _source(tied: bool = False) -> dict[str, torch.Tensor]:
    source = _Model(tied)
    with torch.no_grad():
        for param in source.parameters():
            param.normal_(generator=torch.Generator().manual_seed(param.numel()))
    # a tied weight is in the source once, as vLLM's models skip the tied head's name
    left_out = {"a.made_at_init", "b.weight"} if tied else {"a.made_at_init"}
    return {name: tensor for name, tensor in source.state_dict().items() if name not in left_out}


def _engine(source: dict[str, torch.Tensor], tied: bool = False) -> _Model:
    live = _Model(tied)
    live.load_state_dict(source, strict=False)
    return live


def _rebuild(live: torch.nn.Module, source: dict[str, torch.Tensor]) -> rebuild.Rebuilder:
    from tensorizer_manifest.save.capture import CapturePolicy

    config = type("ModelConfig", (), {"dtype": torch.float32})()
    rebuilder = rebuild.Rebuilder(live, config, torch.device("cpu"), CapturePolicy())
    try:
        with torch.no_grad():
            rebuilder.load(list(source.items()))
    finally:
        rebuilder.close()
    return rebuilder


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_engine_that_serves_its_source_rebuilds_without_being_touched(tied):
    source = _source(tied)
    live = _engine(source, tied)
    identity = {name: (id(t), t.data_ptr(), t._version) for name, t in live.state_dict(keep_vars=True).items()}
    rebuilder = _rebuild(live, source)
    assert {path for path, layer in rebuilder.results.items() if layer.tensors} == {"a", "b"}
    assert rebuilder.results["a"].state == "processed" and rebuilder.results["a"].module is live.a
    assert rebuilder.results["a"].tensors["made_at_init"].tensor is live.a.made_at_init  # the engine's own bytes
    assert {name: (id(t), t.data_ptr(), t._version) for name, t in live.state_dict(keep_vars=True).items()} == identity


@pytest.mark.parametrize(("tensor", "named"), [("b.weight", r"^b\.weight differs"), ("a.bias", r"^a\.bias differs")])
def test_a_tensor_changed_after_loading_is_refused_by_name(tensor, named):
    source = _source()
    live = _engine(source)
    with torch.no_grad():
        live.get_parameter(tensor).view(-1)[1] += 1  # a LoRA merged, an update
    with pytest.raises(NotReproducibleError, match=named) as refused:
        _rebuild(live, source)
    assert "changed after loading" in str(refused.value)


def test_a_layer_with_a_step_whose_state_was_not_recorded_is_refused_by_path():
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    class Method(QuantizeMethodBase):  # a double: only its type matters (a layer with a post-load step)
        def create_weights(self, *args, **kwargs):
            pass

        def apply(self, *args, **kwargs):
            pass

    live = _engine(_source())
    live.b.quant_method = Method()
    with pytest.raises(NotReproducibleError, match=r"^b: this engine's state before vLLM's post-load step was not"):
        _rebuild(live, _source())


class _Packed:
    """A linear kernel double: answers with the weight it packed (where vLLM's step hides a linear weight)."""

    def apply(self, layer, x):
        return x @ layer.packed.T


def _linear(packed: torch.Tensor) -> torch.nn.Module:
    from vllm.model_executor.layers.linear import LinearBase

    class Linear(LinearBase):
        def __init__(self):  # vLLM's needs a tensor-parallel group; the comparison needs only these
            torch.nn.Module.__init__(self)
            self.input_size, self.packed, self.quant_method = packed.shape[1], packed, _Packed()
            self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # emptied by the step

    return Linear()


def _compare(live: torch.nn.Module, rebuilt: torch.nn.Module, inside_attention: bool = False) -> None:
    from tensorizer_manifest.live_model.layers import snapshot_module

    rebuilder = object.__new__(rebuild.Rebuilder)  # the comparison's state alone: no model to rebuild
    rebuilder.device, rebuilder.model_config = torch.device("cpu"), type("C", (), {"dtype": torch.float32})()
    rebuilder._read_by_attention = {id(rebuilt)} if inside_attention else set()
    layer = rebuild._Layer("model.layers.0.mlp.down_proj", live, rebuilt)
    layer.before = snapshot_module(rebuilt, None)
    rebuilder._compare_kernels(layer, snapshot_module(live, None))


def test_a_linear_kernel_is_compared_by_running_it_on_a_probe():
    weights = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    _compare(_linear(weights.clone()), _linear(weights.clone()))
    changed = weights.clone()
    changed[2, 3] += 1e-3
    with pytest.raises(NotReproducibleError, match=r"^model\.layers\.0\.mlp\.down_proj's kernel answers differently"):
        _compare(_linear(weights.clone()), _linear(changed))


def test_a_kernel_that_cannot_run_is_refused_unless_its_attention_layer_serves_it():
    live, rebuilt = _linear(torch.zeros(3, 4)), _linear(torch.zeros(3, 4))
    for layer in (live, rebuilt):
        del layer.packed  # the kernel fails
    with pytest.raises(UnsupportedModelError, match=r"down_proj \(Linear\): its kernel cannot be run .*AttributeError"):
        _compare(live, rebuilt)
    _compare(live, rebuilt, inside_attention=True)  # MLA on AMX: never run, the impl's copies are compared


def test_a_layer_of_another_kind_whose_step_hides_a_weight_is_refused():
    rebuilt = torch.nn.Linear(4, 3)  # as the shadow held it before the step
    _compare(torch.nn.Linear(4, 3), rebuilt)  # nothing hidden
    emptied = torch.nn.Linear(4, 3)
    emptied.weight = torch.nn.Parameter(torch.empty(0))
    with pytest.raises(UnsupportedModelError, match=r"down_proj \(Linear\): vLLM's post-load step hides weight "):
        _compare(emptied, rebuilt)
    set_to_none = torch.nn.Linear(4, 3)
    set_to_none.bias = None
    with pytest.raises(UnsupportedModelError, match="hides bias inside its kernel"):
        _compare(set_to_none, rebuilt)
    deleted = torch.nn.Linear(4, 3)
    del deleted.bias  # deleted, not hidden: nothing in the engine computes with it
    _compare(deleted, rebuilt)


def test_a_materialized_tensor_holds_zeros_where_no_loader_writes(monkeypatch):
    """vLLM's ``materialize_meta_tensor`` gives ``empty_strided``: padding no weight loader writes would hold the
    allocator's leftovers (here: sevens, standing in for them) and be saved. The rebuild zeroes it first, keeping
    the tensor's class and attributes (its ``weight_loader``)."""
    from tensorizer_manifest import _vllm_compat

    def leftovers(meta):
        tensor = torch.full(meta.shape, 7.0, dtype=meta.dtype)
        tensor.__class__ = meta.__class__
        tensor.__dict__ = meta.__dict__.copy()
        return tensor

    meta = torch.nn.Parameter(torch.empty(4, 3, device="meta"), requires_grad=False)
    meta.weight_loader = "the loader"
    monkeypatch.setattr(_vllm_compat, "materialize_meta_tensor", leftovers)
    real = rebuild.materialized(meta)
    assert type(real) is torch.nn.Parameter and real.weight_loader == "the loader"
    assert real.shape == (4, 3) and not real.is_meta and torch.count_nonzero(real) == 0
