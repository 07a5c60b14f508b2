"""Bytes at rest: a checkpoint's files (local or remote), tensor files, temporary spill files.

``checkpoint`` (where a checkpoint's files are, reading its manifests), ``remote`` (S3 and HTTP: a package of its
own), ``remote_checkpoint`` (a whole checkpoint uploaded, its model files fetched), ``tensor_file`` and
``tensor_headers`` (tensorizer's files, read whole or by header), ``spill`` (tensors parked on disk while an
engine saves), ``options`` (the option models saving and loading share). No vLLM; imports only ``format`` and the
package's foundation modules. A source model's safetensors are read by vLLM's own loader (``docs/performance.md``
says why this package no longer reads them itself).
"""
