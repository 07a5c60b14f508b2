"""A load's plan: every decision made before a byte of weights is read, made once (no engine started: the
engine's fingerprint is the synthetic one, its config the few fields the plan reads)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")


def _engine(model: str) -> tuple[SimpleNamespace, SimpleNamespace]:
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0)
    model_config = SimpleNamespace(model=model)
    return SimpleNamespace(parallel_config=parallel, model_config=model_config), model_config


@pytest.fixture
def described(monkeypatch):
    """This engine, as the synthetic checkpoint's save described its own."""
    from helpers.synthetic import FINGERPRINT

    from tensorizer_manifest.load import plan

    monkeypatch.setattr(plan, "engine_fingerprint", lambda vllm_config: FINGERPRINT)
    return FINGERPRINT


def _generation(tmp_path: Path):
    from helpers.synthetic import save_generation

    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    root = tmp_path / "ckpt"
    return root, save_generation(root, source)


def test_a_plan_holds_the_generation_every_rank_reads_and_is_frozen(tmp_path, described):
    from tensorizer_manifest.load.options import LoadOptions
    from tensorizer_manifest.load.plan import plan_load

    root, generation = _generation(tmp_path)
    vllm_config, model_config = _engine(str(root))
    planned = plan_load(vllm_config, model_config, "", LoadOptions(), torch.device("cpu"))
    assert (planned.root, planned.generation.id, planned.stem) == (root, generation.id, "model")
    assert (planned.fingerprint, planned.undescribed, planned.device) == (described, None, torch.device("cpu"))
    assert (planned.why_base, planned.compile_form, planned.compile_identity) == (None, None, None)  # no base, no form
    assert (planned.signing_key, planned.encryption_key, planned.named_file) == (None, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        planned.why_base = "decided twice"  # type: ignore[misc]


def test_a_checkpoint_without_a_pointer_is_planned_where_it_was_given(tmp_path, described):
    from helpers.synthetic import write_synthetic_checkpoint

    from tensorizer_manifest.load.options import LoadOptions
    from tensorizer_manifest.load.plan import plan_load

    checkpoint = str(write_synthetic_checkpoint(tmp_path / "ckpt"))
    vllm_config, model_config = _engine(checkpoint)
    planned = plan_load(vllm_config, model_config, "", LoadOptions(), torch.device("cpu"))
    assert (planned.root, planned.checkpoint, planned.generation) == (checkpoint, checkpoint, None)


def test_an_engine_vllm_cannot_describe_is_planned_with_why_and_the_base_asked_of_none_is_refused(
    tmp_path, monkeypatch
):
    """The fingerprint's failure is kept for later (a base may still serve the engine); asking for the base of a
    checkpoint that has none is refused before anything is read."""
    from tensorizer_manifest.errors import ConfigurationError, UnsupportedVLLMError
    from tensorizer_manifest.load import plan
    from tensorizer_manifest.load.options import LoadOptions

    undescribed = UnsupportedVLLMError("this vLLM cannot be described")

    def fingerprint(vllm_config):
        raise undescribed

    monkeypatch.setattr(plan, "engine_fingerprint", fingerprint)
    root, _ = _generation(tmp_path)
    vllm_config, model_config = _engine(str(root))
    planned = plan.plan_load(vllm_config, model_config, "", LoadOptions(), torch.device("cpu"))
    assert (planned.fingerprint, planned.undescribed) == (None, undescribed)
    with pytest.raises(ConfigurationError, match=r"ask for the base \(source='base'\), and this checkpoint has none"):
        plan.plan_load(vllm_config, model_config, "", LoadOptions(source="base"), torch.device("cpu"))


def test_a_form_set_another_vllm_release_made_sends_the_rank_to_the_base_before_anything_is_read(tmp_path):
    """Its processed tensors and raw fallbacks are in that release's names and shapes; the base is in the source's.
    Decided from the generation alone: the rank's manifest (here, a path with nothing behind it) is not read."""
    import msgspec
    from helpers.synthetic import FINGERPRINT

    from tensorizer_manifest.format import generation as g
    from tensorizer_manifest.load.options import LoadOptions
    from tensorizer_manifest.load.plan import why_not_its_forms

    manifest = g.FileRef(path="generations/none/model.manifest.json", size=1, hash="blake3:" + "0" * 64)
    older = msgspec.structs.replace(FINGERPRINT, vllm_version="0.31.0")
    generation = g.Generation(
        format_version=3,
        id="20261204T000000Z-" + "0" * 32,
        producer="tensorizer-manifest test",
        made_by="save",
        form_sets=[g.FormSet(layout=g.Layout(), fingerprint=older, ranks=[g.RankRef(stem="model", manifest=manifest)])],
    )

    def why(options, fingerprint=FINGERPRINT):
        return why_not_its_forms(tmp_path, generation, "model", fingerprint, None, options, None)

    assert why(LoadOptions()) == (
        "its form sets at this layout were made by vLLM 0.31.0 (this engine: 0.32.0; `tensorizer-manifest add-form` "
        "on this release adds its own)"
    )
    assert why(LoadOptions(source="base")) == "the load options ask for the base (source='base')"
    from tensorizer_manifest.errors import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError, match="model.manifest.json"):  # the same release: read next
        why(LoadOptions(), older)
