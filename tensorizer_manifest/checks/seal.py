"""The seal and the keys: is this manifest the one that was saved, and do the keys given suit it?

A ``digest`` seal catches damage and edits; a ``mac`` seal (signing key) or ``mac-encryption-key`` seal
(encrypted checkpoints) also catches an edit re-sealed by someone without the key. Given a key, only a seal
made with it passes; an encrypted checkpoint's manifest is always sealed with a MAC.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from .._constants import ENCRYPTION_KEY_ENV, SIGNING_KEY_ENV
from ..errors import (
    ConfigurationError,
    IntegrityError,
    TensorizerManifestError,
)
from ..format.generation import Generation, generation_seal_hash
from ..format.schema import (
    EncryptionKey,
    Manifest,
    Seal,
    SealMode,
    SigningKey,
    seal_hash,
)

_PASS_THE_KEY = (
    f"pass its key file (signing_key_file in model_loader_extra_config, --signing-key-file, or ${SIGNING_KEY_ENV})"
)


_PASS_THE_ENCRYPTION_KEY = (
    "pass its key file (encryption_key_file in model_loader_extra_config, --encryption-key-file, "
    f"or ${ENCRYPTION_KEY_ENV})"
)


def check_encryption(
    manifest: Manifest, encryption_key: EncryptionKey | None
) -> tuple[type[TensorizerManifestError], str] | None:
    """Whether the keys given suit the checkpoint's encryption, as (error, message); None when they do.

    An encrypted checkpoint needs its key (``ConfigurationError``). Given a key,
    only an encrypted checkpoint passes: anyone who can write the files could
    otherwise replace an encrypted checkpoint with a plain one of their own.
    """
    encrypted = manifest.tensor_file.encryption != "none"
    if encrypted and encryption_key is None:
        return ConfigurationError, f"the checkpoint's tensor file is encrypted; {_PASS_THE_ENCRYPTION_KEY}"
    if not encrypted and encryption_key is not None:
        return IntegrityError, (
            "an encryption key was given but the checkpoint is not encrypted (it was saved without the key, or "
            "replaced by a plain one): re-save it with the key, or load it without one"
        )
    return None


def check_seal(
    manifest: Manifest, signing_key: SigningKey | None, encryption_key: EncryptionKey | None = None
) -> tuple[type[TensorizerManifestError], str] | None:
    """Whether the seal binds this manifest, as (error, message); None when it does, or when there is none and no key.

    With a signing key, only a ``mac`` seal made with that key passes: a
    ``digest`` can be recomputed by anyone who edits the manifest, and a seal can
    be removed. An encrypted checkpoint's manifest is always sealed with a MAC:
    ``mac``, or without a signing key ``mac-encryption-key``, checked with the
    encryption key.
    """
    return _check_sealed(
        manifest.seal,
        manifest.tensor_file.encryption != "none",
        lambda mode: seal_hash(manifest, mode, signing_key, encryption_key),
        signing_key,
        encryption_key,
        "manifest",
    )


def check_generation_seal(
    generation: Generation,
    encrypted: bool,
    signing_key: SigningKey | None,
    encryption_key: EncryptionKey | None = None,
) -> tuple[type[TensorizerManifestError], str] | None:
    """``check_seal``'s rules for a generation document (format version 3): every one is sealed when written, so
    a missing seal is an edit. ``encrypted``: the checkpoint's tensor files are (its manifests say so)."""
    if generation.seal is None:
        return IntegrityError, (
            "the generation document is not sealed, as every one is when written: it was edited or forged; "
            "save the checkpoint again"
        )
    return _check_sealed(
        generation.seal,
        encrypted,
        lambda mode: generation_seal_hash(generation, mode, signing_key, encryption_key),
        signing_key,
        encryption_key,
        "generation document",
    )


def _check_sealed(
    seal: Seal | None,
    encrypted: bool,
    hash_in: Callable[[SealMode], str],
    signing_key: SigningKey | None,
    encryption_key: EncryptionKey | None,
    what: str,
) -> tuple[type[TensorizerManifestError], str] | None:
    if encrypted and (seal is None or seal.mode == "digest"):
        return IntegrityError, (
            f"the {what} was modified after it was saved, or forged: it says its tensor file is encrypted but is "
            "not sealed with a key, as every encrypted checkpoint's manifest is; re-save the checkpoint"
        )
    if seal is not None and seal.mode == "mac-encryption-key":
        if signing_key is not None:
            return IntegrityError, (
                f"a signing key was given but the {what} is sealed with its encryption key (saved without the "
                "signing key): re-save it with the signing key, or load it without one"
            )
        if encryption_key is None:
            return ConfigurationError, (
                f"the {what} is sealed with its encryption key (mac-encryption-key); {_PASS_THE_ENCRYPTION_KEY}"
            )
        if not _same_hash(hash_in(seal.mode), seal.hash):
            return IntegrityError, (
                f"the {what} was modified after it was saved, or the encryption key is not the one it was saved "
                "with (its seal does not match): use the right key, or re-save the checkpoint"
            )
        return None
    if seal is None:
        if signing_key is None:
            return None  # an old manifest: a warning (unsealed_warning), not an error
        return IntegrityError, (
            "a signing key was given but the manifest is not sealed (saved by tensorizer-manifest 0.2.0 or "
            "older, or its seal was removed): re-save the checkpoint with the key"
        )
    if seal.mode == "mac" and signing_key is None:
        return ConfigurationError, f"the {what} is sealed with a signing key (mac); {_PASS_THE_KEY} to check it"
    if seal.mode == "digest" and signing_key is not None:
        return IntegrityError, (
            f"a signing key was given but the {what}'s seal is a plain digest, which anyone who edits the "
            "manifest can recompute: it was saved without the key, or edited and re-sealed; re-save it with the key"
        )
    if not _same_hash(hash_in(seal.mode), seal.hash):
        if seal.mode == "mac":
            return IntegrityError, (
                f"the {what} was modified after it was saved, or the signing key is not the one it was saved with "
                "(its seal does not match): use the right key, or re-save the checkpoint"
            )
        return IntegrityError, (
            f"the {what} was modified after it was saved (its seal does not match its content): re-save the checkpoint"
        )
    return None


def _same_hash(computed: str, recorded: str) -> bool:
    """Seal hashes compared in constant time: a MAC compared with ``==`` tells, by its timing, how many leading
    characters of a forged one were right."""
    return hmac.compare_digest(computed.encode(), recorded.encode())


def unsealed_warning(manifest: Manifest) -> str | None:
    """The note for an unsealed manifest: loadable, but edits to it are not caught as such."""
    if manifest.seal is not None:
        return None
    return (
        "the manifest is not sealed (saved by tensorizer-manifest 0.2.0 or older): an edit of a field the other "
        "checks do not cover would go unnoticed; re-save the checkpoint to seal it"
    )


def seal_needs_encryption_key(manifest: Manifest, encryption_key: EncryptionKey | None) -> bool:
    """The seal is keyed from the encryption key, and none was given: it cannot be checked."""
    return encryption_key is None and manifest.seal is not None and manifest.seal.mode == "mac-encryption-key"
