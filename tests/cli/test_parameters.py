"""The options the commands share, and the options made from a pydantic option model (no command run)."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_a_checkpoint_argument_is_a_path_unless_it_is_a_uri():
    from tensorizer_manifest.cli.parameters import location_of

    assert location_of("checkpoints/a") == Path("checkpoints/a")
    assert location_of("s3://bucket/a") == "s3://bucket/a" and location_of("https://host/a") == "https://host/a"


def test_engine_args_are_read_as_vllm_serve_would():
    import click

    from tensorizer_manifest.cli.parameters import parse_engine_args

    assert parse_engine_args(("max-num-seqs=4", "enable_prefix_caching=false", "kv_cache_dtype=fp8")) == {
        "max_num_seqs": 4,
        "enable_prefix_caching": False,
        "kv_cache_dtype": "fp8",
    }
    assert parse_engine_args(('override_generation_config={"temperature": 0.5}',)) == {
        "override_generation_config": {"temperature": 0.5}
    }
    with pytest.raises(click.BadParameter, match="not KEY=VALUE"):
        parse_engine_args(("max_num_seqs",))


def test_a_model_field_with_no_option_is_caught_when_the_command_is_made():
    import click
    from pydantic import BaseModel

    from tensorizer_manifest.cli.parameters import ModelOptionsCommand

    class Options(BaseModel):
        shown: int = 1
        forgotten: bool = False

    command = ModelOptionsCommand("c", callback=lambda **_: None, model=lambda: Options, options=["shown"])
    with pytest.raises(RuntimeError, match="forgotten"):
        command.params  # noqa: B018
    listed = ModelOptionsCommand("c", model=lambda: Options, options=["shown"], api_only=["forgotten"])
    assert [p.opts for p in listed.params if isinstance(p, click.Option)] == [["--shown"]]
