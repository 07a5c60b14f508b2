"""The checks of a checkpoint, one module a subject.

Against itself, offline (no vLLM, no GPU): ``report`` (what was found), ``seal`` (the seal and the keys),
``records`` (the manifest's records), ``tensor_files`` (a tensor file against its manifest, content hashes last),
``generation_files`` (a format-3 generation: its seal, the model files vLLM read). ``validate`` runs them in that
order, for the loader and for ``tensorizer-manifest validate``. Against the engine: ``fingerprint`` (what the
saving engine was, and what must match the loading one; it reads the engine's configuration from vLLM).
"""
