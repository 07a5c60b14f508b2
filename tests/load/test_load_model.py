"""A planned load carried out: which steps overlap the reading, and what is refused before anything is read (the
load itself, add-form's observation of it included, runs on real vLLM in ``tests/e2e``: ``test_e2e_vllm``,
``test_e2e_base_layouts``, ``test_e2e_fallbacks``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_overlap_policy_defers_vllms_steps_on_cpu_only_and_an_explicit_choice_wins():
    import torch

    from tensorizer_manifest.load.load_model import overlap_policy
    from tensorizer_manifest.load.options import LoadOptions

    assert LoadOptions().overlap_steps is None
    assert overlap_policy(None, torch.device("cpu")) == {"raw_steps": False, "restorers": True}
    assert overlap_policy(None, torch.device("cuda", 0)) == {"raw_steps": True, "restorers": True}
    assert overlap_policy(True, torch.device("cpu")) == {"raw_steps": True, "restorers": True}
    assert overlap_policy(False, torch.device("cuda")) == {"raw_steps": False, "restorers": False}


def _plan(tmp_path, **decided):
    import torch

    from tensorizer_manifest.load.options import LoadOptions
    from tensorizer_manifest.load.plan import Clock, LoadPlan

    undecided = dict(
        vllm_config=None, model_config=None, prefix="", options=LoadOptions(), checkpoint=str(tmp_path),
        named_file=None, root=tmp_path, generation=None, signing_key=None, encryption_key=None, fingerprint=None,
        undescribed=None, stem="model", device=torch.device("cpu"), clock=Clock(),
    )  # fmt: skip
    return LoadPlan(**{**undecided, **decided})


def test_an_engine_this_vllm_cannot_describe_is_refused_before_its_manifest_is_looked_for(tmp_path):
    """The plan kept why (a base might have served it); with no base to take, that is the error, and the empty
    checkpoint folder is never read."""
    from tensorizer_manifest.errors import UnsupportedVLLMError
    from tensorizer_manifest.load.load_model import load_model

    undescribed = UnsupportedVLLMError("this vLLM cannot be described")
    with pytest.raises(UnsupportedVLLMError) as raised:
        load_model(_plan(tmp_path, undescribed=undescribed))
    assert raised.value is undescribed


def test_add_form_on_an_engine_this_vllm_cannot_describe_is_refused_before_the_base_is_read(tmp_path):
    from tensorizer_manifest.errors import ConfigurationError
    from tensorizer_manifest.format import generation as g
    from tensorizer_manifest.load.load_model import load_model

    generation = g.Generation(
        format_version=3, id="20261204T000000Z-" + "0" * 32, producer="tensorizer-manifest test", made_by="save",
    )  # fmt: skip
    planned = _plan(tmp_path, generation=generation, why_base="no form set at this layout")
    with pytest.raises(ConfigurationError, match=r"cannot describe the forms it would make.*\(no form set at this"):
        load_model(planned, add_form=object())  # never asked: refused first
