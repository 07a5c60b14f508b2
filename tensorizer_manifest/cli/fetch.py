"""``fetch``: a remote checkpoint's config and tokenizer files into a local directory, for vLLM's ``model``."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import ConfigurationError, TensorizerManifestError
from .output import console, fail, json_dumps, write_json
from .parameters import PATH, json_option, remote_from, remote_options


@click.command()
@click.argument("uri")
@click.argument("cache_dir", type=PATH)
@remote_options
@json_option
def fetch(uri: str, cache_dir: Path, json: bool, **remote) -> None:
    """Download the config and tokenizer files (no weights) of the remote checkpoint URI into CACHE_DIR.

    vLLM's model must be a local directory: start it with model=CACHE_DIR,
    load_format='tensorizer_manifest' and model_loader_extra_config={"checkpoint_dir": URI}; the tensors
    stream from URI at load."""
    from ..storage.remote import is_remote
    from ..storage.remote_checkpoint import fetch_model_files

    if not is_remote(uri):
        fail(ConfigurationError(f"{uri}: not an s3:// or http(s):// URI"))
    try:
        target = fetch_model_files(uri, cache_dir, remote_from(**remote))
    except TensorizerManifestError as exc:
        fail(exc)
    fetched = sorted(p.name for p in target.iterdir())
    if json:
        write_json({"uri": uri, "model": str(target), "files": fetched, "load_format": "tensorizer_manifest",
                    "model_loader_extra_config": {"checkpoint_dir": uri}})  # fmt: skip
        return
    console().print(f"fetched {', '.join(fetched)} into {target}", highlight=False)
    config = json_dumps({"checkpoint_dir": uri})
    console().print(
        f"start vLLM with: --model {target} --load-format tensorizer_manifest --model-loader-extra-config '{config}'",
        highlight=False,
        soft_wrap=True,
    )
