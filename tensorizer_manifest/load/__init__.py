"""Loading a checkpoint into a freshly built model: each layer's form, its tensors, then the replay.

``options`` (what a load may be given), ``plan`` (what a load decides before weights: the generation every rank
reads, the keys, the device, the compile form, a form set or the base), ``load_model`` (the plan carried out: the
model and its report; the loader vLLM calls, in ``vllm_integration``, is an adapter around it), ``layer_forms`` (which
form each layer loads, chosen before a byte is read), ``restore`` (check the model against the manifest, then
restore every tensor exactly), ``replay`` (vLLM's step exactly once for raw layers, a restorer for processed ones),
``engine_check`` (``validate --engine``: the same checks with no weights read), ``from_base`` (an engine no form set
fits, loaded from the layout-free base through the model's own ``load_weights``), ``compile_placement`` (a compile
form used only where its seal and machine kind allow, so a cold engine need not compile), ``model_class_record``
(vLLM's record of the model's class, carried so that a fresh process need not inspect the class).
May import ``checks``, ``restorers``, ``model``, ``storage`` and ``format``; never ``save`` (``add-form``'s
observation of a load is given to it: ``load_model.FormObserver``).
"""
