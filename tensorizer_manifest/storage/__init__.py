"""Bytes at rest: a checkpoint's files (local or remote), tensor files, temporary spill files, source weights.

``checkpoint`` (where a checkpoint's files are, reading its manifests), ``remote`` (S3 and HTTP), ``tensor_file``
and ``tensor_headers`` (tensorizer's files, read whole or by header), ``spill`` (tensors parked on disk while an
engine saves), ``source_weights`` (a model's safetensors read one tensor at a time), ``options`` (the option
models saving and loading share). No vLLM; imports only ``format`` and the package's foundation modules.
"""
