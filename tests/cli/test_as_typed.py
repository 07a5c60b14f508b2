"""The light commands as a person types them: the installed ``tensorizer-manifest`` on a real terminal
and piped, with and without ``--json``, on a local checkpoint and on S3 (moto). Each ends with exit 0 and its
summary when it did its work, and with one ``error:`` line and exit 1 (2 for a usage error) when it did not; never
a traceback, never a credential. The commands that start vLLM (``save``, ``add-form``) are typed on a terminal by
the end-to-end modules that start it anyway (``test_e2e_compile_forms``, ``test_e2e_upgrade``,
``test_e2e_typed_errors``).

The checkpoint is the synthetic one (format 3, two generations, no engine needed): what is shown here is how each
command ends, not what vLLM saved.
"""

from __future__ import annotations

import json
import re

import pytest
from helpers.terminal import piped, typed

HOW = ["terminal", "piped", "json"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, moto_s3) -> dict:
    """Two generations of the synthetic checkpoint, locally and on S3 (gc has the older one to remove), and the
    environment that reaches each."""
    from helpers.remote import fresh_prefix, options_for
    from helpers.synthetic import save_generation, write_synthetic_checkpoint

    from tensorizer_manifest.storage.remote_checkpoint import upload_checkpoint

    work = tmp_path_factory.mktemp("as-typed")
    source = write_synthetic_checkpoint(work / "source")
    where = {}
    uri = fresh_prefix("as-typed")
    for seed in (0, 1):  # each generation committed over the one before, in both places
        save_generation(work / "local-checkpoint", source, seed=seed)
        save_generation(work / "s3-checkpoint", source, seed=seed)
        upload_checkpoint(work / "s3-checkpoint", uri, options_for(moto_s3))
    where["local"] = {"checkpoint": str(work / "local-checkpoint"), "env": {}}
    where["s3"] = {"checkpoint": uri, "env": moto_s3.env()}
    return {"work": work, "secret": moto_s3.secret, **where}


def _run(how: str, *args: str, env: dict) -> tuple[int, str]:
    """The command's exit code and everything it showed (on a terminal, the screen's text)."""
    if how == "terminal":
        shown = typed(*args, env=env, timeout=300)
        return shown.returncode, shown.flat
    done = piped(*args, *(["--json"] if how == "json" else []), env=env, timeout=300)
    if how == "json":
        return done.returncode, done.stdout + done.stderr
    return done.returncode, " ".join((done.stdout + done.stderr).split())  # where a log's width wrapped it


def _ended_well(code: int, said: str, secret: str) -> None:
    assert code == 0, said[-3000:]
    assert "Traceback" not in said and "error:" not in said, said[-3000:]
    assert secret not in said


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("how", HOW)
def test_inspect_validate_and_diff_end_with_their_summaries(checkpoints, where, how):
    at, env = checkpoints[where]["checkpoint"], checkpoints[where]["env"]
    code, said = _run(how, "inspect", at, env=env)
    _ended_well(code, said, checkpoints["secret"])
    if how == "json":
        assert json.loads(said)["summary"]["model_class"] == "LlamaForCausalLM"
    else:
        assert "LlamaForCausalLM bfloat16" in said and "generation " in said, said[-3000:]
    code, said = _run(how, "validate", at, env=env)
    _ended_well(code, said, checkpoints["secret"])
    if how == "json":
        assert json.loads(said)["ok"] is True
    else:
        assert re.search(r"(^|\s)valid \S+: \d+ tensor records, \d+ stored, \d+ content hashes checked", said), said
    code, said = _run(how, "diff", at, checkpoints["local"]["checkpoint"], env=env)
    _ended_well(code, said, checkpoints["secret"])
    assert json.loads(said)["same"] is True if how == "json" else "describe the same model" in said


@pytest.mark.parametrize("how", HOW)
def test_fetch_from_s3_ends_with_the_load_command(checkpoints, how):
    into = checkpoints["work"] / f"fetched-{how}"
    code, said = _run(how, "fetch", checkpoints["s3"]["checkpoint"], str(into), env=checkpoints["s3"]["env"])
    _ended_well(code, said, checkpoints["secret"])
    assert (into / "config.json").is_file()
    if how == "json":
        report = json.loads(said)
        assert report["files"] == sorted(p.name for p in into.iterdir()) and report["model"] == str(into)
        assert report["model_loader_extra_config"] == {"checkpoint_dir": checkpoints["s3"]["checkpoint"]}
    else:
        assert "--load-format tensorizer_manifest" in said, said[-3000:]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_gc_says_what_it_would_remove_then_removes_it_on_a_terminal_and_piped(checkpoints, where):
    """The dry run on a terminal, the same piped as JSON, then the removal on a terminal: the older generation's
    files, the current one kept and still valid."""
    at, env = checkpoints[where]["checkpoint"], checkpoints[where]["env"]
    code, dry = _run("terminal", "gc", at, "--dry-run", "--grace", "0", env=env)
    _ended_well(code, dry, checkpoints["secret"])
    code, report = _run("json", "gc", at, "--dry-run", "--grace", "0", env=env)
    _ended_well(code, report, checkpoints["secret"])
    report = json.loads(report)
    assert report["delete"] and report["removed"] == [], report
    assert f"current generation {report['current']}" in dry and "would remove" in dry, dry[-3000:]
    code, done = _run("terminal", "gc", at, "--grace", "0", env=env)
    _ended_well(code, done, checkpoints["secret"])
    assert all(f"removed {path}" in done for path in report["delete"]), done[-3000:]
    code, again = _run("json", "gc", at, "--dry-run", "--grace", "0", env=env)
    assert code == 0 and json.loads(again)["delete"] == [], again
    code, said = _run("piped", "validate", at, env=env)
    _ended_well(code, said, checkpoints["secret"])


@pytest.mark.parametrize("how", HOW)
def test_what_cannot_be_done_is_one_error_line_and_its_exit_code(checkpoints, how):
    missing = str(checkpoints["work"] / "no-such-checkpoint")
    local = checkpoints["local"]["checkpoint"]
    cases = [
        (("inspect", missing), 1, "no such checkpoint"),
        (("validate", missing), 1, "no such checkpoint"),
        (("gc", missing), 1, "no such checkpoint directory"),
        (("fetch", local, str(checkpoints["work"] / "x")), 2, "not an s3:// or http(s):// URI"),
        (("validate", local, "--no-such-option"), 2, "No such option"),
    ]
    for args, exit_code, why in cases:
        code, said = _run(how, *args, env={})
        assert code == exit_code and why in said, (args, code, said[-2000:])
        assert "Traceback" not in said, said[-3000:]


@pytest.mark.parametrize("how", ["terminal", "json"])
def test_kernels_lists_this_vllms_classes_with_no_word_about_other_hardware(how):
    """The inventory imports every vLLM module: what one cannot use here (a multimodal processor without
    torchvision, another platform's kernels) is counted on the last line, not warned about above the table."""
    from vllm import __version__ as vllm_version

    from tensorizer_manifest.restorers import RESTORERS

    code, said = _run(how, "kernels", env={})
    _ended_well(code, said, secret="no secret here")
    assert "[transformers]" not in said and "WARNING" not in said, said[:3000]
    ours = {name for name, restorer in RESTORERS.items() if restorer.verified_for("cpu")}
    if how == "json":
        inventory = json.loads(said)
        assert inventory["vllm_version"] == vllm_version
        assert ours <= {entry["restorer"] for entry in inventory["entries"]}, inventory["entries"]
        by_class = {e["vllm_class"].rsplit(".", 1)[-1]: e for e in inventory["entries"]}
        assert by_class["CPUWNA16LinearKernel"]["status"] == "verified on cpu"
        assert all(e["strategy"] != "no post-load step" for e in inventory["entries"])
    else:
        assert said.startswith(f"vLLM {vllm_version}: classes with a post-load step"), said[:500]
        assert all(name in said for name in ours), (ours, said[:3000])
        assert re.search(r"\d+ vLLM modules do not import here \(other hardware\); not listed$", said), said[-500:]


def test_schema_is_the_same_json_on_a_terminal_and_piped():
    shown = typed("schema", timeout=120)
    written = piped("schema", timeout=120)
    assert shown.returncode == written.returncode == 0
    assert json.loads(written.stdout)["$ref"] == "#/$defs/Manifest"
    assert " ".join(written.stdout.split()) == shown.flat


@pytest.mark.e2e
def test_save_to_s3_typed_on_a_terminal_ends_with_its_summary_and_inspect_finds_it(checkpoints, moto_s3):
    """``save`` straight to S3, as typed: the engine's save, the upload and the pointer's commit, then the summary."""
    from helpers.remote import fresh_prefix

    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    model = build_tiny_model(checkpoints["work"] / "tiny-llama", "llama")
    uri = fresh_prefix("as-typed-save")
    env = {**moto_s3.env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    said = typed("save", str(model), uri, "--dtype", "bfloat16", env=env)
    assert said.returncode == 0 and "Traceback" not in said.output, said.output[-3000:]
    assert "committed generation" in said.flat, said.flat[-700:]
    assert f"load it with: tensorizer-manifest fetch {uri} DIR, then LLM(model=DIR," in said.flat, said.flat[-700:]
    assert moto_s3.secret not in said.output
    code, shown = _run("piped", "inspect", uri, env=moto_s3.env())
    _ended_well(code, shown, moto_s3.secret)
    assert "LlamaForCausalLM bfloat16" in shown, shown[-3000:]


@pytest.mark.e2e
@pytest.mark.parametrize("multiprocessing", ["0", "1"], ids=["core-in-this-process", "core-in-its-own-process"])
def test_a_save_whose_engine_vllm_cannot_start_ends_in_one_line_and_writes_nothing(checkpoints, multiprocessing):
    """vLLM refuses to start the saving engine for a reason of its own (here a KV cache larger than the machine):
    its reason is in its log, and the command ends with one line saying so, exit 1, not a traceback of ours;
    with vLLM's engine core in the command's process (the CLI's default) as in a process of its own."""
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    model = build_tiny_model(checkpoints["work"] / "tiny-llama", "llama")
    out = checkpoints["work"] / f"never-saved-{multiprocessing}"
    said = typed("save", str(model), str(out), "--engine-arg", f"kv_cache_memory_bytes={1 << 50}",
                 env={"VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}, timeout=300)  # fmt: skip
    assert said.returncode == 1, said.output[-3000:]
    assert "tensorizer_manifest/cli/" not in said.output, said.output[-3000:]  # no traceback through the command
    line = said.flat.find("error: vLLM's engine did not start, for a reason of its own")
    assert line >= 0 and "Nothing was committed." in said.flat[line:], said.flat[-1000:]
    assert 0 <= said.flat.find("less than requested memory") < line  # vLLM's own reason, in its log above the line
    assert not out.exists()
