"""The checks of a checkpoint against itself, one module a subject, all offline (no vLLM, no GPU).

``report`` (what was found), ``seal`` (the seal and the keys), ``records`` (the manifest's records),
``tensor_files`` (a tensor file against its manifest, content hashes last). ``validate`` runs them in
that order, for the loader and for ``tensorizer-manifest validate``.
"""
