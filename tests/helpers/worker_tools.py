"""A worker extension for tests: the package's own, plus what a test does to one rank of a sharded engine.

``collective_rpc`` reaches a method by name, so nothing is pickled (a function would be, and vLLM's engine
process refuses to without ``VLLM_ALLOW_INSECURE_SERIALIZATION``). The worker processes import it by name:
``tests/`` must be on their ``PYTHONPATH``.
"""

from __future__ import annotations

import torch

from tensorizer_manifest.vllm_integration.worker import ManifestWorkerExtension

#: ``worker_extension_cls`` for an engine whose workers a test changes.
TEST_WORKER_EXTENSION = "helpers.worker_tools.RankChangingWorkerExtension"


class RankChangingWorkerExtension(ManifestWorkerExtension):
    def tm_test_add_to_weight(self, tp_rank: int, suffix: str, amount: float) -> str | None:
        """Add ``amount`` in place to the parameter whose name ends with ``suffix``, on tensor-parallel rank
        ``tp_rank`` only (what a weight update that reached one rank does). Returns its name there."""
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != tp_rank:
            return None
        for name, param in self._tm_model().named_parameters():
            if name.endswith(suffix):
                with torch.no_grad():
                    param.add_(amount)
                return name
        return None
