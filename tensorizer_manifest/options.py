"""The parts of the option models (pydantic) that saving and loading share.

Kept apart from ``remote.py`` so that ``inspect`` and ``validate``, which read
remote checkpoints but take no option models, never import pydantic (a fifth
of a second at start-up).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, SecretStr

from .remote import RemoteOptions


def describe_validation_error(exc: Any) -> str:
    """A pydantic ``ValidationError`` as text without the values given (one of them may be a credential)."""
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'options'}: {error['msg']}"
        for error in exc.errors(include_url=False, include_input=False)
    )


class S3Options(BaseModel):
    """The S3 fields of the save and load options (pydantic): one place for their names and their fallbacks."""

    s3_access_key_id: str | None = Field(
        None, repr=False, description="S3 access key id (else ~/.s3cfg, else AWS_ACCESS_KEY_ID)."
    )
    s3_secret_access_key: SecretStr | None = Field(
        None, repr=False, description="S3 secret access key (else ~/.s3cfg, else AWS_SECRET_ACCESS_KEY)."
    )
    s3_endpoint: str | None = Field(
        None, description="S3 endpoint URL (else host_base in ~/.s3cfg, else AWS_ENDPOINT_URL)."
    )

    def remote(self) -> RemoteOptions:
        """Credentials and endpoint for an s3:// location (unset ones resolved as tensorizer does)."""
        secret = self.s3_secret_access_key
        return RemoteOptions(
            access_key_id=self.s3_access_key_id,
            secret_access_key=secret.get_secret_value() if secret is not None else None,
            endpoint=self.s3_endpoint,
        )
