"""Writing a checkpoint: observing the post-load step, then the tensor file and the sealed manifest.

``capture`` (what the post-load step created, layer by layer, and what to save), ``rebuild`` (the same from
an engine vLLM's default loader loaded), ``write`` (tensor file, manifest, the compare-and-swap commit),
``from_source`` (``save_checkpoint``: start an engine and save it), ``add_form`` (another machine's processed
form beside the first), ``write_base`` (the layout-free base, so another layout, machine or vLLM release can load
the checkpoint), ``publish`` (a write published as a format-3 generation: every rank's files, then one pointer swap
for all), ``add_compile_form`` (``add-form --compile``: this machine kind's compile cache kept, so a cold engine
need not compile). May import everything below it, ``load`` included (a rebuild replays).
"""
