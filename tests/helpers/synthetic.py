"""A small checkpoint written by the real writer from plain torch modules: no vLLM engine needed.

Used by the fast tests of validation, bad inputs, fuzzing and crash safety. Its
layers mirror what a real save records: a raw linear, a processed norm, a tied
head, a non-contiguous buffer, a zero-length bfloat16 tensor and an int8 one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tensorizer_manifest.format.schema import Fingerprint, KernelRecord, RuntimeAttr
from tensorizer_manifest.save.capture import Capture, CapturedLayer, TensorSlot
from tensorizer_manifest.save.write import write_checkpoint

FINGERPRINT = Fingerprint(
    vllm_version="0.32.0",
    torch_version="2.13.0+cpu",
    tensorizer_version="2.10.1",
    architectures=["LlamaForCausalLM"],
    model_class="vllm.model_executor.models.llama.LlamaForCausalLM",
    dtype="bfloat16",
    quantization=None,
    quant_config_hash=None,
    kv_cache_dtype="auto",
    tensor_parallel_size=1,
    tensor_parallel_rank=0,
    pipeline_parallel_size=1,
    pipeline_parallel_rank=0,
    device_type="cpu",
)


def _slots(module: torch.nn.Module) -> dict[str, TensorSlot]:
    slots = {}
    for name, p in module._parameters.items():
        slots[name] = TensorSlot(p, "parameter", True, (id(p), 0, 0))
    for name, b in module._buffers.items():
        slots[name] = TensorSlot(b, "buffer", name not in module._non_persistent_buffers_set, (id(b), 0, 0))
    return slots


def make_capture(seed: int = 0, scale: int = 1, fallbacks: bool = False) -> Capture:
    """With ``fallbacks``, also a processed experts layer in a machine-specific form with its raw fallback."""
    torch.manual_seed(seed)
    embed = torch.nn.Module()
    embed.weight = torch.nn.Parameter(torch.randn(64 * scale, 32).to(torch.bfloat16), requires_grad=False)
    embed.weight.input_dim = 1
    embed.weight.output_dim = 0
    linear = torch.nn.Module()
    linear.weight = torch.nn.Parameter(
        torch.randint(-127, 127, (48 * scale, 32), dtype=torch.int8), requires_grad=False
    )
    linear.weight_scale = torch.nn.Parameter(torch.rand(48 * scale, 1), requires_grad=False)
    linear.register_buffer("empty", torch.empty(0, dtype=torch.bfloat16))
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(torch.ones(32, dtype=torch.bfloat16), requires_grad=False)
    norm.register_buffer("cache", torch.randn(16, 8).t(), persistent=False)  # non-contiguous
    head = torch.nn.Module()
    head.weight = embed.weight  # tied
    kernel = [KernelRecord(owner="layer", attr="cpu_linear", kernel_class="torch.nn.functional.linear")]
    layers = [
        CapturedLayer(
            "model.embed_tokens",
            embed,
            "processed",
            "cpu_unquantized_gemm",
            _slots(embed),
            kernel,
            [
                RuntimeAttr(
                    owner="layer", name="cpu_linear", type="builtins.function", rebuilt_by="cpu_unquantized_gemm"
                )
            ],
            "",
        ),
        CapturedLayer(
            "model.layers.0.mlp.down_proj",
            linear,
            "raw",
            "post_load",
            _slots(linear),
            [],
            [RuntimeAttr(owner="layer", name="azp_adj", type="torch.nn.parameter.Parameter", rebuilt_by="post_load")],
            "",
        ),
        CapturedLayer("model.norm", norm, "processed", "none", _slots(norm), [], [], ""),
        CapturedLayer("lm_head", head, "processed", "cpu_unquantized_gemm", _slots(head), kernel, [], ""),
    ]
    if fallbacks:
        experts = torch.nn.Module()
        experts.w13_weight = torch.nn.Parameter(torch.randn(4, 16, 32).to(torch.bfloat16), requires_grad=False)
        raw = torch.nn.Module()  # the pre-step form: other shapes, as prepacking pads and reorders
        raw.w13_weight = torch.nn.Parameter(torch.randn(4, 12, 32).to(torch.bfloat16), requires_grad=False)
        layers.insert(
            2,
            CapturedLayer(
                "model.layers.0.mlp.experts",
                experts,
                "processed",
                "cpu_unquantized_moe",
                _slots(experts),
                [],
                [],
                "",
                form={"experts_class": "CPUUnquantizedExperts", "isa": "vec", "zentorch": False},
                verified=True,
                fallback=_slots(raw),
            ),
        )
    return Capture(fingerprint=FINGERPRINT, layers=layers)


def write_synthetic_checkpoint(
    out_dir: Path, seed: int = 0, scale: int = 1, fallbacks: bool = False, signing_key=None
) -> Path:
    """Write the synthetic checkpoint into ``out_dir`` (a config.json too) and return it."""
    out_dir = Path(out_dir)
    write_checkpoint(make_capture(seed, scale, fallbacks), out_dir, "model", signing_key=signing_key)
    (out_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    return out_dir


def save_generation(root: Path, source: Path, seed: int = 0, fallbacks: bool = True):
    """One save of the synthetic capture as a generation of the format-3 checkpoint ``root`` (its model files
    copied from ``source``), committed over the generation current when it began. Returns the generation."""
    from tensorizer_manifest.format import generation as g
    from tensorizer_manifest.save import publish

    publication = publish.begin(root, g.new_generation_id())
    manifest = write_checkpoint(make_capture(seed, fallbacks=fallbacks), publication.folder, "model")
    return publish.commit(
        publication,
        made_by="save",
        form_sets=[publish.layout_form_set(publication, g.Layout(), manifest.fingerprint)],
        model_files=publish.copy_model_files(publication, source),
    )


if __name__ == "__main__":  # used by the crash-safety test: write, forever, until killed
    import sys

    target = Path(sys.argv[1])
    seed = 0
    while True:
        seed += 1
        write_synthetic_checkpoint(target, seed=seed, scale=int(sys.argv[2]) if len(sys.argv) > 2 else 64)


def fresh_synthetic_model() -> torch.nn.Module:
    """What a fresh build of the synthetic layers looks like (what the loader restores into): the same names,
    other values."""
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Module()
    model.model.embed_tokens.weight = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16))
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].mlp = torch.nn.Module()
    down = model.model.layers[0].mlp.down_proj = torch.nn.Module()
    down.weight = torch.nn.Parameter(torch.zeros(48, 32, dtype=torch.int8), requires_grad=False)
    down.weight_scale = torch.nn.Parameter(torch.zeros(48, 1))
    down.register_buffer("empty", torch.empty(0, dtype=torch.bfloat16))
    model.model.norm = torch.nn.Module()
    model.model.norm.weight = torch.nn.Parameter(torch.zeros(32, dtype=torch.bfloat16))
    model.model.norm.register_buffer("cache", torch.zeros(8, 16), persistent=False)
    model.lm_head = torch.nn.Module()
    model.lm_head.weight = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16))
    return model


def experts_form_capture(seed: int = 5) -> Capture:
    """What another engine adds to a checkpoint ``make_capture(fallbacks=True)`` wrote: its processed form of the
    experts layer (another ISA than saved), as ``add-form`` would capture it."""
    torch.manual_seed(seed)
    experts = torch.nn.Module()
    experts.w13_weight = torch.nn.Parameter(torch.randn(4, 16, 32).to(torch.bfloat16), requires_grad=False)
    form = {"experts_class": "X86CPUUnquantizedExperts", "isa": "amx", "zentorch": False}
    layer = CapturedLayer("model.layers.0.mlp.experts", experts, "processed", "cpu_unquantized_moe",
                          _slots(experts), [], [], "", form=form, verified=True)  # fmt: skip
    fingerprint = FINGERPRINT.__copy__()
    fingerprint.cpu_features = ["AVX512", "AMX"]
    return Capture(fingerprint=fingerprint, layers=[layer])
