"""The command line on a checkpoint saved by real vLLM (e2e) and on bad paths (fast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_fp8_kv
from helpers.checkpoints import manifest_file

CLI = [sys.executable, "-m", "tensorizer_manifest.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env={"PATH": ""})


@pytest.mark.e2e
def test_inspect_table_and_json_on_a_saved_checkpoint(scenarios):
    checkpoint = Path(scenarios.e2e("w8a8-int8")["checkpoint"])
    manifest = json.loads(manifest_file(checkpoint).read_text())

    table = run("inspect", str(checkpoint))
    assert table.returncode == 0, table.stderr
    for module in manifest["modules"]:
        assert module["path"] in table.stdout
    assert "raw" in table.stdout and "processed" in table.stdout
    assert "CompressedTensorsLinearMethod" in table.stdout

    as_json = run("inspect", str(checkpoint / "model.manifest.json"), "--json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert [row["path"] for row in doc["layers"]] == [m["path"] for m in manifest["modules"]]
    raw = sum(1 for m in manifest["modules"] if m["state"] == "raw")
    assert doc["summary"]["raw_layers"] == raw == 8
    assert (
        doc["summary"]["tensor_file_bytes"]
        == (manifest_file(checkpoint).parent / manifest["tensor_file"]["path"]).stat().st_size
    )
    qkv = next(r for r in doc["layers"] if r["path"].endswith("layers.0.self_attn.qkv_proj"))
    # What the int8 kernel's step creates differs by CPU (azp_adj without oneDNN's VNNI path, a kernel object
    # with it): the table shows whatever the capture saw.
    assert qkv["state"] == "raw" and qkv["bytes"] > 0 and qkv["runtime_state"]
    saved = next(m for m in manifest["modules"] if m["path"] == qkv["path"])
    assert [a["name"] if a["owner"] == "layer" else f"{a['owner']}.{a['name']}" for a in saved["runtime_state"]] == qkv[
        "runtime_state"
    ]


@pytest.mark.e2e
def test_inspect_imports_neither_torch_nor_vllm(scenarios):
    checkpoint = scenarios.e2e("llama")["checkpoint"]
    proc = run_importing_none_of(["inspect", checkpoint, "--json"], ("torch", "vllm"))
    assert json.loads(proc.stdout)["summary"]["layers"] > 0


def run_importing_none_of(args: list[str], packages: tuple[str, ...]) -> subprocess.CompletedProcess:
    """The command ``args`` in a fresh interpreter, which imports no module of ``packages`` (asserted there)."""
    code = (
        "import sys\nfrom tensorizer_manifest.cli import app\n"
        f"try:\n    app({args!r})\nexcept SystemExit:\n    pass\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {packages!r})\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_inspect_missing_path_is_one_clear_line(tmp_path):
    proc = run("inspect", str(tmp_path / "nope"))
    assert proc.returncode == 1
    assert "no such checkpoint directory" in proc.stderr and "Traceback" not in proc.stderr


def test_inspect_directory_without_manifest(tmp_path):
    proc = run("inspect", str(tmp_path))
    assert proc.returncode == 1
    assert "not a tensorizer-manifest checkpoint" in proc.stderr


def test_inspect_damaged_manifest(tmp_path):
    (tmp_path / "model.manifest.json").write_text('{"format_version": 1, "producer": 3}')
    proc = run("inspect", str(tmp_path))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "$.producer" in proc.stderr


def test_save_of_a_missing_model_is_one_clear_line(tmp_path):
    proc = subprocess.run(
        [*CLI, "save", str(tmp_path / "no-model"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={"PATH": "", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 1
    assert "not a local directory and not in the Hugging Face cache" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_save_command_writes_a_valid_self_contained_checkpoint(e2e_dir, tmp_path):
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    src = build_tiny_model(e2e_dir / "tiny-llama", "llama")
    out = tmp_path / "saved"
    proc = subprocess.run(
        [*CLI, "save", str(src), str(out), "--dtype", "bfloat16", "--max-model-len", "128"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {p.name for p in out.iterdir()}  # format version 3: the pointer, model files and a stub at the top
    assert {"config.json", "tokenizer.json", "model.manifest.json", "tensorizer-manifest.json"} <= names
    everywhere = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()]
    assert not any(n.endswith(".safetensors") for n in everywhere), "weights of SRC must not be copied"
    folder = manifest_file(out).parent.relative_to(out).as_posix()
    tensor_files = sorted(n for n in everywhere if n.endswith(".tensors"))
    assert [n.rpartition("/") for n in tensor_files] == [
        (folder, "/", n) for n in sorted(n.rpartition("/")[2] for n in tensor_files)
    ], "every tensor file in the current generation's folder"
    assert [n.rpartition("/")[2].partition(".")[0] for n in tensor_files] == ["base", "model"]  # the base by default
    valid = subprocess.run([*CLI, "validate", str(out)], capture_output=True, text=True)
    assert valid.returncode == 0, valid.stderr


def test_save_with_a_bad_option_is_a_usage_error(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    proc = subprocess.run([*CLI, "save", str(src), str(tmp_path / "out"), "-tp", "0"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "tensor_parallel_size" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.e2e
@needs_fp8_kv
def test_save_passes_engine_options_into_the_fingerprint(e2e_dir, tmp_path):
    """A checkpoint of a model with calibrated fp8 KV scales, saved from the CLI with an fp8 KV cache."""
    from tensorizer_manifest.embedded_models.tiny import build_tiny_model

    src = build_tiny_model(e2e_dir / "tiny-kv-fp8-calibrated", "kv-fp8-calibrated")
    out = tmp_path / "saved"
    # The options are the subject: vLLM's engine in this process (the save above goes through its multiprocess one).
    in_process = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run(
        [*CLI, "save", str(src), str(out), "--dtype", "bfloat16", "--max-model-len", "128", "--kv-cache-dtype",
         "fp8", "--engine-arg", "max-num-seqs=1"],
        capture_output=True,
        text=True,
        env=in_process,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads(manifest_file(out).read_text())
    assert manifest["fingerprint"]["kv_cache_dtype"] == "fp8"
    valid = subprocess.run([*CLI, "validate", str(out)], capture_output=True, text=True)
    assert valid.returncode == 0, valid.stderr


def run_remote(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The command with this checkout on the path, curl on PATH (tensorizer streams through it) and ``env``."""
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(root), "COLUMNS": "300", **env},
    )


def test_inspect_validate_diff_and_fetch_on_remote_checkpoints(moto_s3, tmp_path):
    from helpers.servers import BUCKET, RangeHTTPServer
    from helpers.synthetic import write_synthetic_checkpoint

    from tensorizer_manifest.storage.remote import RemoteOptions
    from tensorizer_manifest.storage.remote_checkpoint import upload_checkpoint

    a, b = write_synthetic_checkpoint(tmp_path / "a"), write_synthetic_checkpoint(tmp_path / "b", seed=1)
    (a / "config.json").write_text("{}")
    options = RemoteOptions(moto_s3.key_id, moto_s3.secret, moto_s3.endpoint)
    upload_checkpoint(a, f"s3://{BUCKET}/cli/a", options)
    upload_checkpoint(b, f"s3://{BUCKET}/cli/b", options)
    by_env = moto_s3.env()
    by_option = ["--s3-access-key-id", moto_s3.key_id, "--s3-secret-access-key", moto_s3.secret]
    by_option += ["--s3-endpoint", moto_s3.endpoint]
    outputs = []

    shown = run_remote("inspect", f"s3://{BUCKET}/cli/a", "--json", env=by_env)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["summary"]["layers"] > 0
    table = run_remote("inspect", f"s3://{BUCKET}/cli/a", *by_option, env={})
    assert table.returncode == 0 and f"s3://{BUCKET}/cli/a/model.manifest.json" in table.stdout, table.stderr
    valid = run_remote("validate", f"s3://{BUCKET}/cli/a", *by_option, env={})
    assert valid.returncode == 0 and "valid" in valid.stdout and "content hashes checked" in valid.stdout
    same = run_remote("diff", f"s3://{BUCKET}/cli/a", str(a), env=by_env)
    assert same.returncode == 0, same.stderr
    differ = run_remote("diff", f"s3://{BUCKET}/cli/a", f"s3://{BUCKET}/cli/b", "--json", env=by_env)
    assert differ.returncode == 1 and json.loads(differ.stdout)["same"] is False
    fetched = run_remote("fetch", f"s3://{BUCKET}/cli/a", str(tmp_path / "cache"), env=by_env)
    assert fetched.returncode == 0, fetched.stderr
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["config.json"]
    assert "--load-format tensorizer_manifest" in fetched.stdout
    missing = run_remote("inspect", f"s3://{BUCKET}/cli/none", env=by_env)
    assert (
        missing.returncode == 1
        and "RemoteNotFoundError" not in missing.stderr
        and "no *.manifest.json" in (missing.stderr)
    )
    outputs += [shown, table, valid, same, differ, fetched, missing]

    with RangeHTTPServer(tmp_path) as server:
        served = run_remote("validate", f"{server.url}/a", env={})
        assert served.returncode == 0, served.stderr
    http_save = run_remote("save", str(a), "https://127.0.0.1:1/x", env={})
    assert http_save.returncode == 2 and "read-only" in http_save.stderr
    for proc in [*outputs, served, http_save]:
        assert "Traceback" not in proc.stderr
        assert moto_s3.secret not in proc.stdout + proc.stderr


def test_wrong_credentials_and_an_unreachable_endpoint_are_one_line_each(moto_s3_auth, tmp_path):
    from helpers.servers import BUCKET, closed_endpoint
    from helpers.synthetic import write_synthetic_checkpoint

    from tensorizer_manifest.storage.remote import RemoteOptions
    from tensorizer_manifest.storage.remote_checkpoint import upload_checkpoint

    server = moto_s3_auth
    local = write_synthetic_checkpoint(tmp_path / "a")
    upload_checkpoint(local, f"s3://{BUCKET}/cli-auth/a", RemoteOptions(server.key_id, server.secret, server.endpoint))
    wrong = {**server.env(), "AWS_SECRET_ACCESS_KEY": "wrong-secret-from-the-environment"}
    for args, env in (
        (["inspect", f"s3://{BUCKET}/cli-auth/a"], wrong),
        (["validate", f"s3://{BUCKET}/cli-auth/a", "--s3-secret-access-key", "wrong-secret-given-as-an-option"],
         server.env()),
    ):  # fmt: skip
        proc = run_remote(*args, env=env)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "access denied" in proc.stderr and "Traceback" not in proc.stderr
        for secret in (server.secret, "wrong-secret-from-the-environment", "wrong-secret-given-as-an-option"):
            assert secret not in proc.stdout + proc.stderr
    away = run_remote("inspect", f"s3://{BUCKET}/cli-auth/a", "--s3-endpoint", closed_endpoint(), env=server.env())
    assert away.returncode == 1 and "cannot be reached" in away.stderr


def test_validate_and_inspect_take_vllm_tensorizer_names(tmp_path):
    """A tensor file, as vLLM's tensorizer_uri names it, finds its manifest; --no-verify-hash is vLLM's name."""
    from helpers.synthetic import write_synthetic_checkpoint

    from tensorizer_manifest.storage.checkpoint import read_manifest

    checkpoint = write_synthetic_checkpoint(tmp_path / "ckpt")
    tensor_file = checkpoint / read_manifest(checkpoint).tensor_file.path
    shown = run("inspect", str(tensor_file), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["summary"]["tensor_file_bytes"] == tensor_file.stat().st_size
    quick = run("validate", str(tensor_file), "--no-verify-hash", "--json")
    assert quick.returncode == 0, quick.stderr
    assert json.loads(quick.stdout)["hashes_checked"] == 0
    full = json.loads(run("validate", str(tensor_file), "--verify-hash", "--json").stdout)
    assert full["hashes_checked"] == full["stored"] > 0
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    keyed = run("validate", str(checkpoint), "--encryption-keyfile", str(key), "--json")
    assert "no such option" not in keyed.stderr  # vLLM's flag name is taken


def test_inspect_of_a_stock_vllm_file_names_the_resave_command(tmp_path):
    from helpers.checkpoints import write_stock_tensor_file

    stock = write_stock_tensor_file(tmp_path / "stock" / "model.tensors")
    shown = run("inspect", str(stock))
    assert shown.returncode != 0
    assert "a tensorizer file without a manifest beside it" in shown.stderr
    assert "tensorizer-manifest save SOURCE_MODEL" in shown.stderr


def test_gc_says_what_it_would_remove_then_removes_it(tmp_path):
    from tensorizer_manifest.format import generation as g
    from tensorizer_manifest.storage.generations import LocalCheckpoint

    store = LocalCheckpoint(tmp_path)
    parent = None
    for payload in (b"one", b"two"):
        gid = g.new_generation_id()
        ref = store.put(f"{g.generation_dir(gid)}/config.json", payload)
        generation = g.Generation(format_version=3, id=gid, parent=parent, producer="t", made_by="save",
                                  model_files=[g.ModelFile(name="config.json", file=ref)])  # fmt: skip
        store.commit(g.seal_generation(generation))
        parent = gid
    first = store.current().parent
    dry = run("gc", str(tmp_path), "--grace", "0", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["current"] == parent and report["removed"] == []
    assert f"{g.generation_dir(first)}/config.json" in report["delete"]
    assert (tmp_path / g.generation_dir(first)).is_dir()
    done = run("gc", str(tmp_path), "--grace", "0")
    assert done.returncode == 0, done.stderr
    assert "removed" in done.stdout and not (tmp_path / g.generation_dir(first)).exists()
    assert store.current().id == parent


def test_gc_of_a_format_2_checkpoint_is_one_clear_line(tmp_path):
    proc = run("gc", str(tmp_path))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "format version 3" in proc.stderr


def test_inspect_and_validate_name_the_generation_of_a_format_3_checkpoint(tmp_path):
    from helpers.synthetic import make_capture, write_synthetic_checkpoint

    from tensorizer_manifest.format import generation as g
    from tensorizer_manifest.save import publish
    from tensorizer_manifest.save.write import write_checkpoint

    source = write_synthetic_checkpoint(tmp_path / "source")
    root = tmp_path / "ckpt"
    publication = publish.begin(root, g.new_generation_id())
    manifest = write_checkpoint(make_capture(), publication.folder, "model")
    publish.commit(
        publication,
        made_by="save",
        form_sets=[publish.form_set(g.Layout(), manifest.fingerprint, [publish.rank_entry(publication, "model")])],
        model_files=publish.copy_model_files(publication, source),
    )
    shown = run("inspect", str(root))
    assert shown.returncode == 0, shown.stderr
    assert f"generation {publication.generation_id} (save; over nothing): tp=1 pp=1 (1 ranks)" in shown.stdout
    checked = run("validate", str(root), "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_inspect_shows_the_base_and_validate_checks_its_file(tmp_path):
    """A generation with a base: ``inspect`` says what serves other layouts; ``validate`` checks the base's tensor
    file as a rank's (a changed byte in its data is a content-hash problem naming the file)."""
    from helpers.sources import Toy, source
    from helpers.synthetic import make_capture, write_synthetic_checkpoint

    from tensorizer_manifest.format import generation as g
    from tensorizer_manifest.live_model.sources import SourceObserver
    from tensorizer_manifest.save import publish
    from tensorizer_manifest.save.write import write_checkpoint
    from tensorizer_manifest.save.write_base import write_base
    from tensorizer_manifest.storage.tensor_file import read_index

    root = tmp_path / "ckpt"
    publication = publish.begin(root, g.new_generation_id())
    manifest = write_checkpoint(make_capture(), publication.folder, "model")
    model, observer = Toy(), SourceObserver(g.Layout())
    with observer.watching(model):
        model.load_weights(observer.source(iter(source())))
    base = write_base(observer.observed, source(), publication.folder)
    publish.commit(
        publication,
        made_by="save",
        form_sets=[publish.form_set(g.Layout(), manifest.fingerprint, [publish.rank_entry(publication, "model")])],
        model_files=publish.copy_model_files(publication, write_synthetic_checkpoint(tmp_path / "source")),
        base=publish.base_entry(publication, *base),
    )
    shown = run("inspect", str(root))
    assert shown.returncode == 0, shown.stderr
    assert "processed for tp=1 pp=1 on cpu" in shown.stdout
    assert "base: 4 source tensors" in shown.stdout and "any other tensor- or pipeline-parallel size" in shown.stdout
    states = [m.state for m in manifest.modules]
    assert f"{states.count('processed')} of {len(states)} layers processed" in shown.stdout
    assert "base.manifest.json" not in shown.stdout  # the base is no rank's manifest
    checked = run("validate", str(root), "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr

    base_file = publication.folder / base[1].tensor_file.path
    entry = read_index(base_file)["proj.b"]
    data = bytearray(base_file.read_bytes())
    data[entry.data_offset] ^= 0x01
    base_file.write_bytes(bytes(data))
    damaged = run("validate", str(root))
    assert damaged.returncode == 1
    said = damaged.stdout + damaged.stderr
    assert base_file.name in said and "tensor 'proj.b': content hash does not match" in said


def _handed_on(monkeypatch, module, function: str, args: list[str]) -> dict:
    """The keyword arguments a command hands ``module.function`` for ``args`` (stopped there: no engine)."""
    from click.testing import CliRunner

    from tensorizer_manifest.cli import app
    from tensorizer_manifest.errors import ConfigurationError

    seen: dict = {}

    def stop(*_args, **kwargs):
        seen.update(kwargs)
        raise ConfigurationError("stopped here")

    monkeypatch.setattr(module, function, stop)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "stopped here" in result.output, result.output
    return seen


def test_save_options_are_the_models_fields_as_today(monkeypatch, tmp_path):
    """``save``'s options are made from ``SaveOptions``: each field's default, type and description, under the
    spellings the command always had; what reaches ``save_checkpoint`` is what the model takes."""
    from tensorizer_manifest.cli import app
    from tensorizer_manifest.save import from_source
    from tensorizer_manifest.save.from_source import SaveOptions

    handed = _handed_on(monkeypatch, from_source, "save_checkpoint", ["save", "src", "out"])
    defaults = SaveOptions().model_dump(exclude={"kv_cache_memory_bytes"})  # the one option the API only takes
    assert handed == {**defaults, "engine_args": {}, "progress": False}
    handed = _handed_on(
        monkeypatch,
        from_source,
        "save_checkpoint",
        ["save", "src", "out", "-tp", "2", "--format-version", "2", "--no-fallbacks", "--cpu-gemm", "fallback",
         "--encrypt-key-file", "k", "--signing-key-file", "s", "--kv-cache-dtype", "fp8", "--engine-arg", "x=1"],
    )  # fmt: skip
    assert handed["tensor_parallel_size"] == 2 and handed["format_version"] == 2 and handed["fallbacks"] is False
    assert (
        handed["cpu_gemm"] == "fallback" and handed["encryption_key_file"] == "k" and handed["signing_key_file"] == "s"
    )
    assert handed["engine_args"] == {"x": 1, "kv_cache_dtype": "fp8"}
    options = {p.name: p for p in app.commands["save"].params}
    for name, info in SaveOptions.model_fields.items():
        if name in options and not name.startswith("s3_"):  # the s3 options are every command's, one declaration
            assert options[name].help == info.description, name
    assert options["encryption_key_file"].opts == [
        "--encryption-key-file",
        "--encryption-keyfile",
        "--encrypt-key-file",
    ]
    assert options["tensor_parallel_size"].opts == ["--tensor-parallel-size", "-tp"]
    assert options["fallbacks"].opts == ["--fallbacks"] and options["fallbacks"].secondary_opts == ["--no-fallbacks"]


def test_add_form_options_are_the_models_fields(monkeypatch):
    from tensorizer_manifest.save import add_form
    from tensorizer_manifest.save.add_form import AddFormOptions

    handed = _handed_on(monkeypatch, add_form, "add_form", ["add-form", "c", "--encryption-keyfile", "k", "--json"])
    assert handed == {**AddFormOptions().model_dump(), "encryption_key_file": "k"}


def test_schema_prints_the_published_schema_without_pydantic_or_torch():
    """``make schema`` writes ``schemas/manifest-v2.schema.json`` with it."""
    proc = run_importing_none_of(["schema"], ("pydantic", "torch", "vllm"))
    assert proc.stdout == (Path(__file__).resolve().parents[2] / "schemas" / "manifest-v2.schema.json").read_text()


def test_the_light_commands_import_no_option_model():
    """The options of ``save`` and ``add-form`` are made when those commands run: ``inspect`` and ``--help``
    import neither pydantic nor torch for them, and ``save --help`` no torch."""
    run_importing_none_of(["--help"], ("pydantic", "torch", "vllm"))
    run_importing_none_of(["inspect", "--help"], ("pydantic", "torch", "vllm"))
    run_importing_none_of(["save", "--help"], ("torch", "vllm"))
