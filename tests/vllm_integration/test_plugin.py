"""The plugin entry point, without starting an engine."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_plugin_registers_both_load_formats_once():
    from vllm.model_executor.model_loader import get_model_loader  # noqa: F401  (public API)

    from tensorizer_manifest import _vllm_compat
    from tensorizer_manifest._constants import CAPTURE_LOAD_FORMAT, LOAD_FORMAT
    from tensorizer_manifest.vllm_integration.loaders import CaptureModelLoader, ManifestModelLoader
    from tensorizer_manifest.vllm_integration.plugin import register

    register()
    assert not _vllm_compat.register_model_loader_once(LOAD_FORMAT, ManifestModelLoader)
    assert not _vllm_compat.register_model_loader_once(CAPTURE_LOAD_FORMAT, CaptureModelLoader)


def _checkpoint(tmp_path):
    from helpers.synthetic import save_generation

    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    (source / "tokenizer.json").write_text("{}\n")
    root = tmp_path / "ckpt"
    return root, save_generation(root, source)


def test_a_format_3_checkpoint_given_as_vllm_s_model_is_pinned_before_vllm_reads_it(tmp_path):
    """vLLM's arguments, as it parses them: the model becomes the current generation's own folder, the tokenizer
    follows it, the served name stays the path given; the hook runs at every engine config of the process."""
    from vllm.engine.arg_utils import EngineArgs

    from tensorizer_manifest._constants import LOAD_FORMAT
    from tensorizer_manifest.format.generation import generation_dir
    from tensorizer_manifest.vllm_integration.plugin import before_engine_config, pin_current_generation, register

    register()
    assert EngineArgs.create_engine_config._tensorizer_manifest_hook is before_engine_config
    import vllm.v1.engine.utils as engine_utils  # an engine's failed start raises its processes' typed error

    assert "_tensorizer_manifest_translate" in vars(engine_utils.wait_for_engine_startup)
    root, generation = _checkpoint(tmp_path)
    args = EngineArgs(model=str(root), load_format=LOAD_FORMAT)
    pin_current_generation(args)
    assert args.model == str(root.resolve() / generation_dir(generation.id))
    assert args.tokenizer == args.model and args.served_model_name == str(root)
    pin_current_generation(args)  # a generation's folder has no pointer: left as it is
    assert args.model == str(root.resolve() / generation_dir(generation.id))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"load_format": "auto"},
        {"load_format": "tensorizer_manifest", "model_loader_extra_config": {"checkpoint_dir": "/elsewhere"}},
        {"load_format": "tensorizer_manifest", "tokenizer": "own-tokenizer"},
    ],
    ids=["other-load-format", "checkpoint-named-apart", "own-tokenizer"],
)
def test_what_is_not_the_checkpoint_s_to_decide_is_left_alone(tmp_path, kwargs):
    from vllm.engine.arg_utils import EngineArgs

    from tensorizer_manifest.vllm_integration.plugin import pin_current_generation

    root, _ = _checkpoint(tmp_path)
    if "tokenizer" in kwargs:  # vLLM resolves a tokenizer path as it parses: it must be a folder
        (tmp_path / kwargs["tokenizer"]).mkdir()
        kwargs = {**kwargs, "tokenizer": str(tmp_path / kwargs["tokenizer"])}
    args = EngineArgs(model=str(root), **kwargs)
    pin_current_generation(args)
    if "tokenizer" in kwargs:  # the model is pinned, the tokenizer the user named is not
        assert args.tokenizer == kwargs["tokenizer"] and args.model != str(root)
    else:
        assert args.model == str(root) and args.tokenizer in (None, str(root))


def test_a_relative_generation_folder_is_that_generation(tmp_path, monkeypatch):
    from pathlib import Path

    from tensorizer_manifest.format.generation import generation_dir
    from tensorizer_manifest.storage.checkpoint import pinned_generation

    root, generation = _checkpoint(tmp_path)
    monkeypatch.chdir(root)
    found = pinned_generation(Path(generation_dir(generation.id)))
    assert found is not None and found[1].id == generation.id and found[0] == root.resolve()
