"""Count vLLM's own post-load steps per layer, in a process that loads with real vLLM.

Patches ``process_weights_after_loading`` of every quant method class in vLLM and of
the attention layers (plain and MLA, which is not an ``Attention`` subclass), and tags
every layer with its path when our replay is set up (before any step runs). The
counter's keys are ``(label, path)``: ``quant_method`` or ``attention``, and the layer.
"""

from __future__ import annotations

import collections


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def install_post_load_counter() -> collections.Counter:
    """Start counting; the returned counter fills as steps run, for every engine started afterwards."""
    # the quant methods of the tiny kinds, imported before their classes are patched (vLLM imports them lazily)
    import vllm.model_executor.layers.quantization.auto_awq  # noqa: F401
    import vllm.model_executor.layers.quantization.auto_gptq  # noqa: F401
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors  # noqa: F401
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from tensorizer_manifest.load import replay

    counts: collections.Counter = collections.Counter()
    active: set[int] = set()

    def patch(cls):
        fn = cls.__dict__.get("process_weights_after_loading")
        if fn is None:
            return

        def counting(self, layer, *a, __fn=fn, **k):
            # One call per layer however deep the class chain goes (a method calling super() counts once).
            outermost = id(layer) not in active
            if outermost:
                counts[("quant_method", getattr(layer, "_tm_path", "?"))] += 1
                active.add(id(layer))
            try:
                return __fn(self, layer, *a, **k)
            finally:
                if outermost:
                    active.discard(id(layer))

        cls.process_weights_after_loading = counting

    for cls in set(_all_subclasses(QuantizeMethodBase)):
        patch(cls)

    def patch_attention(cls):
        fn = cls.__dict__["process_weights_after_loading"]

        def attn_counting(self, act_dtype, __fn=fn):
            counts[("attention", getattr(self, "_tm_path", "?"))] += 1
            return __fn(self, act_dtype)

        cls.process_weights_after_loading = attn_counting

    for cls in (Attention, MLAAttention):
        patch_attention(cls)

    original_init = replay.Replayer.__init__

    def tagging_init(self, model, *args, **kwargs):
        for path, module in model.named_modules():
            module._tm_path = path
        original_init(self, model, *args, **kwargs)

    replay.Replayer.__init__ = tagging_init
    return counts
