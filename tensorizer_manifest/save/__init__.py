"""Writing a checkpoint: observing the post-load step, then the tensor file and the sealed manifest.

``capture`` (what the post-load step created, layer by layer, and what to save), ``rebuild`` (the same from
an engine vLLM's default loader loaded), ``write`` (tensor file, manifest, the compare-and-swap commit),
``from_source`` (``save_checkpoint``: start an engine and save it), ``add_form`` (another machine's processed
form beside the first). May import everything below it, ``load`` included (a rebuild replays).
"""
