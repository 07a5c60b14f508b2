"""Bytes at rest: a checkpoint's files (local or remote), tensor files, temporary spill files.

``checkpoint`` (where a checkpoint's files are, reading its manifests), ``remote`` (S3 and HTTP: a package of its
own), ``remote_checkpoint`` (a whole checkpoint uploaded, its model files fetched), ``tensor_file`` and
``tensor_headers`` (tensorizer's files, read whole or by header), ``spill`` (tensors parked on disk while an
engine saves), ``option_models`` (the option models saving and loading share), ``files`` (local files written safely:
the writers' lock, create-only and atomic replacement, made durable), ``backends`` (where a checkpoint's bytes
live, behind one protocol: a local directory, S3, HTTP read-only), ``generations`` (format version 3: immutable
files and one pointer swapped by compare-and-swap, written once against ``backends``' protocol, and ``gc``),
``source_files`` (a base by reference: the source's own safetensors files, read in place of a copy),
``compile_archive`` (a compile form's files as one archive, written out only after its hashes match),
``tensorizer_names`` (every private tensorizer name the package touches, in one place, so a tensorizer upgrade
that moves one shows there). No vLLM; imports only
``format`` and the package's foundation modules. A save reads the source model's safetensors through vLLM's own
loader (``docs/performance.md`` says why); only a base by reference is read here, with safetensors itself.
"""
