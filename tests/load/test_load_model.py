"""A planned load carried out: which steps overlap the reading (the load itself runs on real vLLM in
``tests/e2e``: ``test_e2e_vllm``, ``test_e2e_generations``, ``test_e2e_base_layouts``)."""

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
