"""How a command ends: a known error as one red line with its exit code, a report for tools as JSON alone."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from tensorizer_manifest.cli.output import fail, write_json
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


def test_a_report_for_tools_is_the_json_alone_on_stdout():
    @click.command()
    def command() -> None:
        write_json({"ok": False, "problems": [{"kind": "IntegrityError"}]})

    result = CliRunner().invoke(command, [])
    assert result.exit_code == 0 and result.stderr == ""
    assert json.loads(result.stdout) == {"ok": False, "problems": [{"kind": "IntegrityError"}]}
    assert result.stdout.startswith('{\n  "ok": false') and result.stdout.endswith("}\n")
