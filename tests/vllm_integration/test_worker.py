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
