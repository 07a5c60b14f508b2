"""The worker extension's methods on a bare model runner, without starting an engine (its saves on real
engines are in ``tests/e2e``)."""

from __future__ import annotations

import pytest

from tensorizer_manifest.errors import ConfigurationError, TensorizerManifestError

pytest.importorskip("vllm")


def _worker(model):
    from types import SimpleNamespace

    from tensorizer_manifest.vllm_integration.worker import ManifestWorkerExtension

    worker = ManifestWorkerExtension()
    worker.model_runner = SimpleNamespace(model=model)
    return worker


def test_the_worker_extension_vllm_is_given_is_this_one():
    import importlib

    from tensorizer_manifest._constants import WORKER_EXTENSION
    from tensorizer_manifest.vllm_integration.worker import ManifestWorkerExtension

    module, _, name = WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is ManifestWorkerExtension


def test_an_unknown_format_version_is_refused_before_anything_is_done(tmp_path):
    import torch

    with pytest.raises(ConfigurationError, match="format_version must be 2 or 3, not 4"):
        _worker(torch.nn.Linear(2, 2)).save_tensorizer_manifest(str(tmp_path / "out"), format_version=4)
    assert not (tmp_path / "out").exists()


def test_a_model_the_manifest_loader_did_not_load_has_no_report_and_no_form_to_add(tmp_path):
    import torch

    worker = _worker(torch.nn.Linear(2, 2))
    assert worker.tensorizer_manifest_report() is None
    with pytest.raises(TensorizerManifestError, match="did not load with load_format='tensorizer_manifest'"):
        worker.add_tensorizer_manifest_form(str(tmp_path))


def test_state_hashes_name_every_parameter_and_persistent_buffer():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model[1].register_buffer("scratch", torch.zeros(2), persistent=False)
    hashes = _worker(model).tensorizer_manifest_state_hashes()
    assert set(hashes) == {
        "0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked",
    }  # fmt: skip
    assert hashes == _worker(model).tensorizer_manifest_state_hashes()


@pytest.fixture
def votes(monkeypatch):
    """The votes this rank casts; every other rank votes no (``every_rank_succeeded`` says False)."""
    from tensorizer_manifest import _vllm_compat

    cast = []
    monkeypatch.setattr(_vllm_compat, "every_rank_succeeded", lambda succeeded: cast.append(succeeded) and False)
    return cast


def test_a_part_written_here_is_undone_when_another_rank_failed_to_write_its_own(votes):
    from tensorizer_manifest.vllm_integration.worker import _every_rank_writes

    undone = []
    with pytest.raises(TensorizerManifestError, match="^another rank failed$"):
        with _every_rank_writes("another rank failed") as part:
            part.undo = lambda: undone.append("part")
    assert (votes, undone) == ([True], ["part"])


def test_a_rank_that_fails_to_write_votes_no_and_raises_its_own_error(votes):
    from tensorizer_manifest.vllm_integration.worker import _every_rank_writes

    undone = []
    with pytest.raises(OSError, match="disk full"):
        with _every_rank_writes("another rank failed") as part:
            part.undo = lambda: undone.append("part")
            raise OSError("disk full")
    assert (votes, undone) == ([False], [])


def test_a_rank_other_than_the_first_commits_nothing_and_learns_that_the_first_failed(votes, monkeypatch):
    from tensorizer_manifest.vllm_integration import worker

    monkeypatch.setattr(worker, "first_rank", lambda: False)
    commits = []
    with pytest.raises(TensorizerManifestError, match="^the first rank could not commit$"):
        worker._first_rank_commits(lambda: commits.append("pointer"), "the first rank could not commit")
    assert (votes, commits) == ([True], [])
