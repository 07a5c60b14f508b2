"""The live model: observing a vLLM layer (tensors, kernels, runtime state) and turning tensors into records.

``layers`` snapshots a layer and diffs two snapshots; ``tensors`` makes a tensor's exact record and puts a
record's tensor back; ``sources`` observes which source tensor filled which module while vLLM's loader runs, so a
load from the base reads only what a layer needs. Both directions use it: save observes, load restores. Imports
``storage`` (spill) and ``format``; never the save or load steps.
"""
