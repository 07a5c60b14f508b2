"""Which compile form an engine may use, decided before a file of it is read (the e2e tests run real engines)."""

from __future__ import annotations

import os
import shutil

import msgspec
import pytest

from tensorizer_manifest import _vllm_compat
from tensorizer_manifest.format.generation import CompileForm, FileRef
from tensorizer_manifest.load.compile_placement import (
    EngineCompile,
    choose,
    compile_settings,
    compile_settings_hash,
    engine_compiles,
    machine_kind,
    use_compile_form,
    why_not,
)

ENGINE = EngineCompile(
    machine=["cpu:x86_64", "AVX512", "avx512f"],
    vllm_version="0.32.0",
    torch_version="2.13.0",
    config_hash="c" * 64,
    settings={"tensor_parallel_size": "1", "max_model_len": "128"},
)


def _form(**changes) -> CompileForm:
    form = CompileForm(
        machine=list(ENGINE.machine),
        vllm_version=ENGINE.vllm_version,
        torch_version=ENGINE.torch_version,
        config_hash=ENGINE.config_hash,
        archive=FileRef(path="generations/g/compile-x.bin", size=0, hash="blake3:" + "0" * 64),
    )
    return msgspec.structs.replace(form, **changes)


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"machine": ["cpu:x86_64", "AVX2"]}, "made for another machine kind (it has ['AVX2'], this one"),
        ({"vllm_version": "0.31.0"}, "made by vLLM 0.31.0 (this engine: 0.32.0)"),
        ({"torch_version": "2.14.0"}, "made with torch 2.14.0 (this engine: 2.13.0)"),
        ({"config_hash": "d" * 64}, "made for other engine settings (context length, batch sizes"),
        (
            {"config_hash": "d" * 64, "settings": {"tensor_parallel_size": "2", "max_model_len": "128"}},
            "made for other engine settings (tensor_parallel_size 2 (this engine: 1)): run add-form --compile with",
        ),
    ],
)
def test_a_form_that_differs_in_anything_it_depends_on_is_not_used_and_says_why(changes, why):
    assert why_not(_form(), ENGINE) is None
    assert why in why_not(_form(**changes), ENGINE)


def test_the_form_that_fits_is_chosen_among_others_and_none_fits_names_each_reason():
    fits = _form()
    others = [_form(vllm_version="0.31.0"), _form(machine=["cpu:aarch64"])]
    assert choose([*others, fits], ENGINE) == (fits, "")
    form, why = choose(others, ENGINE)
    assert form is None and "vLLM 0.31.0" in why and "another machine kind" in why


def test_the_machine_kind_is_this_cpus():
    kind = machine_kind()
    assert kind[0].startswith("cpu:")
    assert kind[1 : 1 + len(_vllm_compat.cpu_features())] == _vllm_compat.cpu_features()
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split(":")[1].split()
    assert ("avx2" in kind) == ("avx2" in flags) and ("amx_tile" in kind) == ("amx_tile" in flags)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def _config(model_dir, **engine):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model_dir), dtype="bfloat16", max_model_len=128, **engine).create_engine_config()


def test_the_settings_hash_follows_the_graphs_settings_not_the_models_path(tiny_llama, tmp_path):
    moved = tmp_path / "elsewhere"
    shutil.copytree(tiny_llama, moved)
    here = _config(tiny_llama)
    assert compile_settings_hash(here) == compile_settings_hash(_config(moved))
    assert here.model_config.model == str(tiny_llama)  # put back
    assert compile_settings_hash(here) != compile_settings_hash(_config(tiny_llama, max_num_seqs=3))
    assert engine_compiles(here) and not engine_compiles(_config(tiny_llama, enforce_eager=True))


def test_the_settings_in_words_are_the_engines(tiny_llama):
    settings = compile_settings(_config(tiny_llama, max_num_seqs=3))
    assert settings["max_num_seqs"] == "3" and settings["max_model_len"] == "128"
    assert settings["dtype"] == "bfloat16" and settings["tensor_parallel_size"] == "1"


@pytest.mark.parametrize("rank, warned", [(0, True), (1, False)])
def test_why_a_form_is_not_used_is_said_once_by_the_first_rank(tiny_llama, tmp_path, caplog, rank, warned):
    import logging

    from tensorizer_manifest.format.generation import GENERATIONS_FORMAT_VERSION, Generation, new_generation_id

    generation = Generation(format_version=GENERATIONS_FORMAT_VERSION, id=new_generation_id(), producer="test",
                            made_by="add-form-compile", compile_forms=[_form()])  # fmt: skip
    config = _config(tiny_llama)
    config.parallel_config.rank = rank
    with caplog.at_level(logging.DEBUG, logger="vllm.tensorizer_manifest"):
        assert use_compile_form(config, generation, tmp_path, None, None) is None
    (record,) = [r for r in caplog.records if "compile form not used" in r.getMessage()]
    assert "not checked with your signing key" in record.getMessage()
    assert (record.levelno == logging.WARNING) == warned


def _vllm_cache_with_artifacts(root, ranks: int) -> list[dict]:
    """What vLLM leaves under its cache root after compiling one module at ``ranks`` ranks with AOT on (a folder
    named by a hash, a rank folder each, the kernels shared), and what the workers report of it."""
    folder = root / "torch_compile_cache" / "torch_aot_compile" / "ab12"
    (folder / "inductor_cache" / "xy").mkdir(parents=True)
    (folder / "inductor_cache" / "xy" / "kernel.so").write_bytes(b"kernel")
    saved = []
    for rank in range(ranks):
        (folder / f"rank_{rank}_0").mkdir()
        (folder / f"rank_{rank}_0" / "model").write_bytes(f"artifact {rank}".encode())
        saved.append({"rank": rank, "modules": {"model": str(folder / f"rank_{rank}_0" / "model")}})
    (root / "modelinfos").mkdir()
    (root / "modelinfos" / "record.json").write_text("{}")
    return saved


def test_vllms_aot_artifacts_are_arranged_by_module_and_rank_and_nothing_else_is_kept(tmp_path):
    from tensorizer_manifest.load.compile_placement import arrange_aot_artifacts

    saved = _vllm_cache_with_artifacts(tmp_path, ranks=2)
    arrange_aot_artifacts(tmp_path, saved)
    kept = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert kept == ["aot/model/inductor_cache/xy/kernel.so", "aot/model/rank0/model", "aot/model/rank1/model"]
    assert (tmp_path / "aot/model/rank1/model").read_bytes() == b"artifact 1"


@pytest.mark.parametrize("modules", [{"model": None}, {}])
def test_a_compile_that_saved_no_aot_artifact_is_refused_with_what_to_do(tmp_path, modules):
    from tensorizer_manifest.errors import ConfigurationError
    from tensorizer_manifest.load.compile_placement import arrange_aot_artifacts

    with pytest.raises(ConfigurationError, match="VLLM_USE_AOT_COMPILE=0"):
        arrange_aot_artifacts(tmp_path, [{"rank": 0, "modules": modules}])


def test_a_module_whose_artifact_is_missing_or_does_not_load_is_left_to_compile_and_the_log_says_why(
    tmp_path, monkeypatch, caplog
):
    """The loader's side alone (vLLM's modules and its load stood in for): the module that loads counts, the two
    that cannot are named in the log, and inductor's cache is pointed back where it was for them."""
    import types

    from tensorizer_manifest import _vllm_compat
    from tensorizer_manifest.load import compile_placement

    for name in ("loads", "breaks"):
        (tmp_path / "aot" / name / "rank1").mkdir(parents=True)
        (tmp_path / "aot" / name / "rank1" / "model").write_bytes(b"artifact")
    modules = {"loads": object(), "breaks": object(), "absent": object()}
    given = []

    def load(module, path):
        if module is modules["breaks"]:
            raise RuntimeError("source changed")
        given.append((module, path))

    monkeypatch.setattr(_vllm_compat, "compiled_modules", lambda model: modules)
    monkeypatch.setattr(_vllm_compat, "load_aot_artifact", load)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/users/own/cache")
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(rank=1))
    with caplog.at_level("INFO", logger="vllm.tensorizer_manifest"):
        loaded = compile_placement.load_aot_artifacts(None, config, tmp_path, "ckpt: compile form")
    assert loaded == 1 and given == [(modules["loads"], str(tmp_path / "aot/loads/rank1/model"))]
    said = caplog.text
    assert "AOT artifact of breaks (rank 1) did not load (RuntimeError: source changed); vLLM compiles it" in said
    assert "has no AOT artifact of absent (rank 1); vLLM compiles it" in said
    assert "AOT artifact of loads (rank 1) loaded from it" in said
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "aot" / "loads" / "inductor_cache")
