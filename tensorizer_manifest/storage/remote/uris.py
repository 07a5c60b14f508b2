"""Remote locations as URIs: the schemes read and written, the URIs accepted, and which files of a model
directory are configuration rather than weights.

A URI never holds a credential: one with ``user:password@`` in it, a query (a presigned URL's signature) or a
fragment is refused (``check_uri``), and the refusal does not repeat what it refused.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ...errors import ConfigurationError
from ...format.generation import COMMIT_MARK, GENERATION_DOCUMENT, POINTER_NAME
from ...format.schema import MANIFEST_SUFFIX, TENSORS_SUFFIX

#: URI schemes read (all) and written (``s3`` only) by the ``remote`` package.
SCHEMES = ("s3", "http", "https")

#: Files of a model directory that are weights, not configuration: never copied or fetched.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", TENSORS_SUFFIX, ".gguf", ".msgpack", ".h5", ".ckpt")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

#: Config and tokenizer files looked for over plain HTTP(S), which cannot list a directory.
HTTP_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)


def is_model_file(name: str) -> bool:
    """A config, tokenizer or other non-weight file of a model directory (not a manifest, a pointer, hidden, nor a
    generation's own document or commit mark: a generation's folder is a model directory too)."""
    return not (
        name.startswith(".")
        or name in (POINTER_NAME, GENERATION_DOCUMENT, COMMIT_MARK)
        or name.endswith(WEIGHT_SUFFIXES)
        or name in WEIGHT_INDEXES
        or name.endswith(MANIFEST_SUFFIX)
    )


def check_uri(uri: str) -> tuple[str, str, str]:
    """(scheme, netloc, path) of a URI the ``remote`` package accepts: no credentials, query or fragment in it."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigurationError(f"{uri!r}: not an s3://, http:// or https:// URI")
    if "@" in parts.netloc:
        raise ConfigurationError(
            f"{scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}: credentials may not be part of the URI; "
            "give them as options, environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or ~/.s3cfg"
        )
    if parts.query or parts.fragment:
        raise ConfigurationError(f"{scheme}://{parts.netloc}{parts.path}: a checkpoint URI has no query or fragment")
    if not parts.netloc:
        raise ConfigurationError(f"{uri!r}: no {'bucket' if scheme == 's3' else 'host'} in the URI")
    return scheme, parts.netloc, parts.path
