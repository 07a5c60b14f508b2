"""Loading a checkpoint into a freshly built model: each layer's form, its tensors, then the replay.

``forms`` (which form each layer loads, chosen before a byte is read), ``restore`` (check the model against
the manifest, then restore every tensor exactly), ``replay`` (vLLM's step exactly once for raw layers, a
restorer for processed ones), ``engine_check`` (``validate --engine``: the same checks with no weights read).
May import ``checks``, ``restorers``, ``model``, ``storage`` and ``format``; never ``save``.
"""
