"""How a command ends on a known error: one red line and its exit code."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from tensorizer_manifest.cli.output import fail
from tensorizer_manifest.errors import ConfigurationError, IntegrityError


@pytest.mark.parametrize(
    ("error", "exit_code"),
    [(ConfigurationError("--keep x: not a generation id"), 2), (IntegrityError("tensor 'a': content hash"), 1)],
)
def test_a_known_error_is_one_line_on_stderr_and_its_exit_code(error, exit_code):
    @click.command()
    def command() -> None:
        fail(error)

    result = CliRunner().invoke(command, [])
    assert result.exit_code == exit_code
    assert result.stderr == f"error: {error}\n" and result.stdout == ""
