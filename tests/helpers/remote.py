"""What the tests of remote storage share: a checkpoint with config and tokenizer files, a fresh S3 prefix
in the test bucket, and the options that reach a test server."""

from __future__ import annotations

import uuid
from pathlib import Path

from helpers.servers import BUCKET
from helpers.synthetic import write_synthetic_checkpoint
from tensorizer_manifest.storage.remote import RemoteOptions


def write_model_checkpoint(out: Path) -> Path:
    """The synthetic checkpoint in ``out``, with a config and a tokenizer file beside it."""
    write_synthetic_checkpoint(out)
    (out / "config.json").write_text('{"model_type": "llama"}')
    (out / "tokenizer.json").write_text("{}")
    return out


def fresh_prefix(name: str = "t") -> str:
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


def options_for(server) -> RemoteOptions:
    return RemoteOptions(server.key_id, server.secret, server.endpoint)
