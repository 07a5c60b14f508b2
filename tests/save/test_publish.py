"""A write published as a generation, without vLLM: the synthetic checkpoint's rank written into a generation's
folder, committed once; readers follow the pointer, a stub answers old readers, an add-form's generation keeps
the save's tensor file where it is, and a write of format version 2 into such a checkpoint is refused."""

from __future__ import annotations

import json

import pytest
from helpers.synthetic import experts_form_capture, make_capture
from helpers.synthetic import save_generation as _save

from tensorizer_manifest.checks.validate import validate_checkpoint
from tensorizer_manifest.errors import ConcurrentWriteError, ConfigurationError, ManifestVersionError
from tensorizer_manifest.format import generation as g
from tensorizer_manifest.format.schema import decode_manifest
from tensorizer_manifest.save import publish
from tensorizer_manifest.save.write import write_added_form, write_checkpoint
from tensorizer_manifest.storage.checkpoint import load_manifest, read_manifest, signing_key_from
from tensorizer_manifest.storage.generations import LocalCheckpoint
from tensorizer_manifest.storage.remote_checkpoint import publish_to_s3


@pytest.fixture(autouse=True)
def _no_vllm_records(monkeypatch):
    """The model files are the source's alone here: vLLM's record of the class (``load.model_class_record``, whose
    tests carry it) is left out, whatever this machine's vLLM cache holds."""
    from tensorizer_manifest import _vllm_compat

    monkeypatch.setattr(_vllm_compat, "model_class_records", lambda: None)


@pytest.fixture
def source(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    (source / "tokenizer.json").write_text('{"version": "1.0"}\n')
    (source / "model.safetensors").write_bytes(b"weights are not model files")
    return source


def test_a_save_is_one_generation_and_readers_follow_the_pointer(tmp_path, source):
    root = tmp_path / "ckpt"
    generation = _save(root, source)
    assert {p.name for p in root.iterdir()} == {
        "tensorizer-manifest.json", ".tensorizer-manifest.json.lock", "generations", "config.json",
        "tokenizer.json", "model.manifest.json",
    }  # fmt: skip
    assert [m.name for m in generation.model_files] == ["config.json", "tokenizer.json"]
    assert (root / "config.json").read_bytes() == (source / "config.json").read_bytes()
    manifest, path = load_manifest(root)
    assert path == root / generation.form_sets[0].ranks[0].manifest.path
    assert read_manifest(root / "model.manifest.json") == manifest  # the stub's name reads the current one
    with pytest.raises(ManifestVersionError, match="format version 3 is newer"):
        decode_manifest((root / "model.manifest.json").read_bytes())  # what a 0.4 reader sees: "upgrade"
    assert json.loads((root / "model.manifest.json").read_text())["pointer"] == g.POINTER_NAME
    report = validate_checkpoint(root)
    assert report.ok, report.problems


def test_a_re_save_is_a_new_generation_and_the_old_one_stays_for_readers(tmp_path, source):
    root = tmp_path / "ckpt"
    first = _save(root, source, seed=0)
    old_manifest, old_path = load_manifest(root)
    second = _save(root, source, seed=1)
    assert second.parent == first.id
    assert load_manifest(root)[0].tensor_file.digest != old_manifest.tensor_file.digest
    assert load_manifest(root, generation=first) == (old_manifest, old_path)  # within the grace period


def test_a_writer_that_started_before_another_s_commit_commits_nothing(tmp_path, source):
    root = tmp_path / "ckpt"
    _save(root, source)
    slow = publish.begin(root, g.new_generation_id())
    _save(root, source, seed=1)
    write_checkpoint(make_capture(2), slow.folder, "model")
    with pytest.raises(ConcurrentWriteError):
        publish.commit(
            slow, made_by="save", form_sets=[publish.form_set(g.Layout(), make_capture().fingerprint,
            [publish.rank_entry(slow, "model")])], model_files=[],
        )  # fmt: skip
    assert LocalCheckpoint(root).current_generation_id() != slow.generation_id


def test_an_added_form_keeps_the_save_s_tensor_file_in_its_folder(tmp_path, source):
    root = tmp_path / "ckpt"
    saved = _save(root, source)
    loaded, _ = load_manifest(root)
    publication = publish.begin(root, g.new_generation_id(), parent=saved.id, read_parent=False)
    write_added_form(experts_form_capture(), root, "model", loaded, into=publication.folder)
    added = publish.commit_over(
        publication, saved, made_by="add-form", form_sets=publish.with_new_manifests(publication, saved)
    )
    assert [m.file.hash for m in added.model_files] == [m.file.hash for m in saved.model_files]
    assert all(m.file.path.startswith(g.generation_dir(added.id)) for m in added.model_files)  # its own folder
    (rank,) = added.form_sets[0].ranks
    assert rank.tensor_files[0] == saved.form_sets[0].ranks[0].tensor_files[0]  # the save's, where it is
    assert rank.tensor_files[1].startswith(g.generation_dir(added.id))  # the form's, new
    manifest, _ = load_manifest(root)
    assert len(manifest.added_forms) == 1
    report = validate_checkpoint(root)
    assert report.ok, report.problems


def test_a_write_over_a_generation_changes_only_its_form_sets_or_its_compile_forms(tmp_path, source):
    """``commit_over``, as add-form and add-form --compile commit: the new generation keeps its parent's model files
    (copied into its own folder), its base, and whichever of form sets and compile forms the write leaves."""
    from tensorizer_manifest.format.schema import blake3_hex

    root = tmp_path / "ckpt"
    saved = _save(root, source)
    publication = publish.begin(root, g.new_generation_id(), parent=saved.id, read_parent=False)
    (publication.folder / "compile-x.bin").write_bytes(b"graphs")
    archive = g.FileRef(path=publication.relative("compile-x.bin"), size=6, hash=blake3_hex(b"graphs"))
    form = g.CompileForm(machine=["cpu:x86_64"], vllm_version="0.32.0", torch_version="2.13.0", config_hash="h",
                         archive=archive)  # fmt: skip
    compiled = publish.commit_over(publication, saved, made_by="add-form-compile", compile_forms=[form])
    assert (compiled.form_sets, compiled.base, compiled.compile_forms) == (saved.form_sets, saved.base, [form])
    assert [m.file.hash for m in compiled.model_files] == [m.file.hash for m in saved.model_files]
    assert all(m.file.path.startswith(g.generation_dir(compiled.id)) for m in compiled.model_files)

    publication = publish.begin(root, g.new_generation_id(), parent=compiled.id, read_parent=False)
    write_added_form(experts_form_capture(), root, "model", load_manifest(root)[0], into=publication.folder)
    added = publish.commit_over(
        publication, compiled, made_by="add-form", form_sets=publish.with_new_manifests(publication, compiled)
    )
    assert (added.made_by, added.compile_forms, added.base) == ("add-form", [form], compiled.base)
    assert added.form_sets[0].ranks[0].manifest.path.startswith(g.generation_dir(added.id))
    report = validate_checkpoint(root)
    assert report.ok, report.problems


def _beside_another_release(root, saved, release: str) -> g.Generation:
    """An add-form's commit as an engine of ``release`` makes it at the layout ``saved`` has (from the base): its
    own form set beside the save's, its rank manifest under the same name in the new generation's folder."""
    publication = publish.begin(root, g.new_generation_id(), parent=saved.id, read_parent=False)
    capture = make_capture(3, fallbacks=True)
    capture.fingerprint = capture.fingerprint.__copy__()
    capture.fingerprint.vllm_version = release
    write_checkpoint(capture, publication.folder, "model")
    theirs = publish.layout_form_set(publication, g.Layout(), capture.fingerprint)
    return publish.commit_over(publication, saved, made_by="add-form", form_sets=[*saved.form_sets, theirs])


def test_each_release_reads_its_own_form_set_at_one_layout_and_an_added_form_goes_to_its_own(tmp_path, source):
    """A checkpoint follows its fleet's upgrades. Two form sets at one layout, made by two vLLM releases: each
    release's loader reads its own (the newest where it has none), an added form by one release's engine changes only
    that release's form set, and the whole stays valid."""
    from tensorizer_manifest.storage.checkpoint import form_set_of, has_rank

    root = tmp_path / "ckpt"
    saved = _save(root, source)
    ours = saved.form_sets[0].fingerprint.vllm_version
    both = _beside_another_release(root, saved, "0.31.0")
    assert [s.fingerprint.vllm_version for s in both.form_sets] == [ours, "0.31.0"]
    theirs, _ = load_manifest(root, "model", vllm_version="0.31.0")
    mine, _ = load_manifest(root, "model", vllm_version=ours)
    assert (theirs.fingerprint.vllm_version, mine.fingerprint.vllm_version) == ("0.31.0", ours)
    assert form_set_of(both, "model", "0.99.0") is both.form_sets[-1]  # no form set of its own: the newest
    assert has_rank(both, "model", "0.31.0") and has_rank(both, "model", ours)
    assert not has_rank(both, "model", "0.30.0") and not has_rank(both, "model-tp0-of-2", ours)

    publication = publish.begin(root, g.new_generation_id(), parent=both.id, read_parent=False)
    write_added_form(experts_form_capture(), root, "model", mine, into=publication.folder)
    added = publish.commit_over(
        publication, both, made_by="add-form", form_sets=publish.with_new_manifests(publication, both, ours)
    )
    assert added.form_sets[1] == both.form_sets[1]  # the other release's, untouched
    assert added.form_sets[0].ranks[0].manifest.path.startswith(g.generation_dir(added.id))
    assert len(load_manifest(root, "model", vllm_version=ours)[0].added_forms) == 1
    assert load_manifest(root, "model", vllm_version="0.31.0")[0] == theirs
    report = validate_checkpoint(root)
    assert report.ok, report.problems


def test_a_format_2_write_into_a_generations_checkpoint_is_refused(tmp_path, source):
    root = tmp_path / "ckpt"
    _save(root, source)
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(ConfigurationError, match="format version 3"):
        write_checkpoint(make_capture(3), root, "model")
    assert sorted(p.name for p in root.iterdir()) == before


def test_a_sharded_rank_whose_manifest_is_not_there_is_named(tmp_path, source):
    publication = publish.begin(tmp_path / "ckpt", g.new_generation_id())
    with pytest.raises(Exception, match="model-tp1-of-2's manifest is not in the generation's folder"):
        publish.rank_entry(publication, "model-tp1-of-2")


def test_a_reader_of_the_previous_generation_finishes_while_two_re_saves_and_a_gc_run(tmp_path, source):
    from helpers.synthetic import fresh_synthetic_model

    from tensorizer_manifest.checks.validate import open_checked
    from tensorizer_manifest.errors import CheckpointNotFoundError
    from tensorizer_manifest.load.restore import restore_tensors
    from tensorizer_manifest.storage.checkpoint import load_generation

    root = tmp_path / "ckpt"
    first = _save(root, source, seed=0, fallbacks=False)
    manifest, manifest_path = load_manifest(root)  # a loader read the pointer, then...
    second = _save(root, source, seed=1, fallbacks=False)  # ...two re-saves, each with its gc
    third = _save(root, source, seed=2, fallbacks=False)
    store = LocalCheckpoint(root)
    store.gc(store.plan_gc())  # and one more, with the default grace
    assert store.current().id == third.id and third.parent == second.id
    model = fresh_synthetic_model()
    with open_checked(manifest, manifest_path) as reader:  # every file it needs is still there, hashes checked
        restore_tensors(model, manifest, reader)
    assert load_manifest(root, generation=first)[0] == manifest
    store.gc(store.plan_gc(grace_s=0))  # past the grace period: the first generation goes
    with pytest.raises(CheckpointNotFoundError, match=first.id):
        load_generation(root, g.pointer_to(first.id, b"its document"))


def test_the_loser_of_two_saves_leaves_no_file_of_its_own_where_loaders_look(tmp_path, source):
    root = tmp_path / "ckpt"
    _save(root, source)
    winner = publish.begin(root, g.new_generation_id())
    loser = publish.begin(root, g.new_generation_id())
    other = tmp_path / "other-source"
    other.mkdir()
    (other / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}\n')
    for publication, seed in ((winner, 1), (loser, 2)):
        write_checkpoint(make_capture(seed), publication.folder, "model")
    files = {}
    for publication, model_source in ((winner, source), (loser, other)):
        files[publication.generation_id] = publish.copy_model_files(publication, model_source)
    fingerprint = make_capture().fingerprint
    publish.commit(
        winner,
        made_by="save",
        model_files=files[winner.generation_id],
        form_sets=[publish.form_set(g.Layout(), fingerprint, [publish.rank_entry(winner, "model")])],
    )
    with pytest.raises(ConcurrentWriteError):
        publish.commit(
            loser,
            made_by="save",
            model_files=files[loser.generation_id],
            form_sets=[publish.form_set(g.Layout(), fingerprint, [publish.rank_entry(loser, "model")])],
        )
    # fmt: skip
    assert (root / "config.json").read_bytes() == (source / "config.json").read_bytes()  # the winner's
    assert LocalCheckpoint(root).current_generation_id() == winner.generation_id
    assert (loser.folder / "config.json").is_file()  # the loser's own, in its uncommitted folder (gc's, later)


# -- S3 (moto on 127.0.0.1) ----------------------------------------------------------------------------------------


def _s3(server):
    import uuid

    from helpers.servers import BUCKET

    from tensorizer_manifest.storage.remote import RemoteOptions

    return f"s3://{BUCKET}/gen-{uuid.uuid4().hex[:8]}", RemoteOptions(server.key_id, server.secret, server.endpoint)


def _stage(tmp_path, source, seed, stems=("model",)):
    staging = tmp_path / f"staging-{seed}"
    publication = publish.begin(staging, g.new_generation_id())
    manifests = [write_checkpoint(make_capture(seed + i), publication.folder, stem) for i, stem in enumerate(stems)]
    layout = g.Layout(tp=len(stems))
    ranks = [publish.rank_entry(publication, stem) for stem in stems]
    publish.commit(
        publication,
        made_by="save",
        form_sets=[publish.form_set(layout, manifests[0].fingerprint, ranks)],
        model_files=publish.copy_model_files(publication, source),
    )
    return staging


def test_a_generation_on_s3_loads_through_its_pointer_and_fetch_takes_its_own_model_files(moto_s3, tmp_path, source):
    from tensorizer_manifest.storage.generations import S3Checkpoint
    from tensorizer_manifest.storage.remote import RemoteDir
    from tensorizer_manifest.storage.remote_checkpoint import fetch_model_files

    uri, options = _s3(moto_s3)
    first = publish_to_s3(_stage(tmp_path, source, 0), uri, options)
    second = publish_to_s3(_stage(tmp_path, source, 1), uri, options)
    assert first.parent is None and second.parent == first.id
    store = S3Checkpoint(RemoteDir(uri, options))
    assert store.current() == second
    manifest, path = load_manifest(uri, remote=options)
    assert str(path) == f"{uri}/{second.form_sets[0].ranks[0].manifest.path}"
    report = validate_checkpoint(uri, remote=options)
    assert report.ok, report.problems
    (RemoteDir(uri, options) / "tokenizer.json").put_bytes(b'{"another": "save"}')  # a stale copy at the top
    cache = fetch_model_files(uri, tmp_path / "cache", options)
    assert sorted(p.name for p in cache.iterdir()) == ["config.json", "tokenizer.json"]
    assert (cache / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()  # the generation's


_RACING_WRITER = """
import sys
sys.path.insert(0, sys.argv[4])
from pathlib import Path
from tensorizer_manifest.storage.remote_checkpoint import publish_to_s3
from tensorizer_manifest.storage.remote import RemoteOptions
from tensorizer_manifest.errors import ConcurrentWriteError
try:
    publish_to_s3(Path(sys.argv[1]), sys.argv[2], RemoteOptions(*sys.argv[3].split(",")))
    print("committed")
except ConcurrentWriteError as exc:
    print("refused:", exc)
"""


def test_two_re_saves_on_s3_one_commits_the_other_commits_nothing(moto_s3, tmp_path, source):
    """Writer A, a process of its own, uploads its generation and pauses before its pointer PUT; writer B commits
    to completion; released, A's conditional PUT fails: ConcurrentWriteError, nothing of A's where loaders look."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tensorizer_manifest.storage.generations import S3Checkpoint
    from tensorizer_manifest.storage.remote import RemoteDir

    uri, options = _s3(moto_s3)
    base = publish_to_s3(_stage(tmp_path, source, 0), uri, options)
    other = tmp_path / "other-source"
    other.mkdir()
    (other / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}\n')
    staged_a, staged_b = _stage(tmp_path, other, 1), _stage(tmp_path, source, 2)
    gate = tmp_path / "gate"
    gate.mkdir()
    tests = str(Path(__file__).resolve().parents[1])
    credentials = ",".join((options.access_key_id, options.secret_access_key, options.endpoint))
    writer_a = subprocess.Popen(
        [sys.executable, "-c", _RACING_WRITER, str(staged_a), uri, credentials, tests],
        env={**os.environ, "TENSORIZER_MANIFEST_PAUSE_AT": f"before-commit:{gate}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(gate.glob("before-commit.*.reached")):
            assert writer_a.poll() is None and time.monotonic() < deadline, writer_a.stdout.read()
            time.sleep(0.05)
        b = publish_to_s3(staged_b, uri, options)  # B commits while A holds its generation
    finally:
        (gate / "before-commit.release").touch()
        output, _ = writer_a.communicate(timeout=120)
    assert "refused:" in output and "another writer committed generation" in output, output
    store = S3Checkpoint(RemoteDir(uri, options))
    assert store.current().id == b.id and b.parent == base.id
    top = RemoteDir(uri, options) / "config.json"
    assert top.read_bytes() == (source / "config.json").read_bytes()  # B's, never the loser's
    report = validate_checkpoint(uri, remote=options)
    assert report.ok, report.problems


def test_a_sharded_s3_commit_whose_rank_upload_fails_commits_nothing(moto_s3, tmp_path, source, monkeypatch):
    from tensorizer_manifest.errors import RemoteStorageError
    from tensorizer_manifest.storage.generations import S3Checkpoint
    from tensorizer_manifest.storage.remote import RemoteDir

    uri, options = _s3(moto_s3)
    stems = ("model-tp0-of-2", "model-tp1-of-2")
    base = publish_to_s3(_stage(tmp_path, source, 0, stems), uri, options)
    before = {stem: load_manifest(uri, stem, remote=options)[0] for stem in stems}
    create = S3Checkpoint.create

    def failing_create(self, relative, data):
        if "model-tp1-of-2" in relative:
            raise RemoteStorageError(f"{relative}: uploading it failed (the connection was reset)")
        return create(self, relative, data)

    monkeypatch.setattr(S3Checkpoint, "create", failing_create)
    with pytest.raises(RemoteStorageError, match="model-tp1-of-2"):
        publish_to_s3(_stage(tmp_path, source, 5, stems), uri, options)
    monkeypatch.undo()
    assert S3Checkpoint(RemoteDir(uri, options)).current_generation_id() == base.id
    for stem in stems:  # every rank still reads the one save it had, whole
        assert load_manifest(uri, stem, remote=options)[0] == before[stem]
        report = validate_checkpoint(f"{uri}/{stem}.manifest.json", remote=options)
        assert report.ok, report.problems


def test_an_s3_generation_staged_without_tensors_takes_an_add_form_only_over_itself(moto_s3, tmp_path, source):
    """add-form on S3: the current generation staged locally without its tensor files (checked by hash), a
    generation made over it there, published only over it: never over a save committed meanwhile."""
    from tensorizer_manifest.errors import ConcurrentWriteError, IntegrityError
    from tensorizer_manifest.storage.generations import S3Checkpoint
    from tensorizer_manifest.storage.remote import RemoteDir

    uri, options = _s3(moto_s3)
    base = publish_to_s3(_stage(tmp_path, source, 0), uri, options)
    store = S3Checkpoint(RemoteDir(uri, options))
    staged = store.stage(tmp_path / "stage")
    assert staged == base and LocalCheckpoint(tmp_path / "stage").current() == base
    local = {p.relative_to(tmp_path / "stage").as_posix() for p in (tmp_path / "stage").rglob("*") if p.is_file()}
    (rank,) = base.form_sets[0].ranks
    assert rank.manifest.path in local and {m.file.path for m in base.model_files} <= local
    assert not [name for name in local if name.endswith(".tensors")], "tensor files stay where they are"

    def made_over_base(stage):  # what add-form commits in its stage: a new manifest, the save's tensor file kept
        publication = publish.begin(stage, g.new_generation_id(), parent=base.id, read_parent=False)
        (loaded,) = base.form_sets[0].ranks
        data = (stage / loaded.manifest.path).read_bytes()
        (publication.folder / f"{loaded.stem}.manifest.json").write_bytes(data)
        return publish.commit(
            publication,
            made_by="add-form",
            form_sets=publish.with_new_manifests(publication, base),
            model_files=publish.carry_model_files(publication, base),
        )

    added = made_over_base(tmp_path / "stage")
    published = publish_to_s3(tmp_path / "stage", uri, options, only_over_its_parent=True)
    assert published.id == added.id and published.parent == base.id and store.current() == published
    assert load_manifest(uri, remote=options)[0] == load_manifest(tmp_path / "stage")[0]
    assert published.form_sets[0].ranks[0].tensor_files == rank.tensor_files  # the save's file, not uploaded again

    store.stage(tmp_path / "stage-2")  # a second add-form stages the add-form's generation...
    newer = publish_to_s3(_stage(tmp_path, source, 1), uri, options)  # ...and a re-save commits meanwhile
    base = published
    made_over_base(tmp_path / "stage-2")
    with pytest.raises(ConcurrentWriteError, match=newer.id):
        publish_to_s3(tmp_path / "stage-2", uri, options, only_over_its_parent=True)
    assert store.current() == newer

    (RemoteDir(uri, options) / newer.model_files[0].file.path).delete()
    (RemoteDir(uri, options) / newer.model_files[0].file.path).put_bytes(b"{}")  # a damaged copy
    with pytest.raises(IntegrityError, match=newer.model_files[0].file.path):
        store.stage(tmp_path / "stage-3")


def test_upload_checkpoint_commits_a_local_generation_and_seals_it_again_only_with_its_key(moto_s3, tmp_path, source):
    from tensorizer_manifest import upload_checkpoint
    from tensorizer_manifest.storage.generations import S3Checkpoint
    from tensorizer_manifest.storage.remote import RemoteDir

    uri, options = _s3(moto_s3)
    staged = LocalCheckpoint(_stage(tmp_path, source, 0)).current()
    uploaded = upload_checkpoint(tmp_path / "staging-0", uri, options)
    store = S3Checkpoint(RemoteDir(uri, options))
    assert store.current() == staged and sorted(uploaded) == sorted(staged.named_paths())
    assert validate_checkpoint(uri, remote=options).ok
    key_file = tmp_path / "key"
    key_file.write_bytes(b"k" * 32)
    signed = publish.begin(tmp_path / "signed", g.new_generation_id())
    manifest = write_checkpoint(make_capture(1), signed.folder, "model")
    publish.commit(
        signed,
        made_by="save",
        form_sets=[publish.form_set(g.Layout(tp=1), manifest.fingerprint, [publish.rank_entry(signed, "model")])],
        model_files=publish.copy_model_files(signed, source),
        signing_key=signing_key_from(key_file),
    )
    with pytest.raises(ConfigurationError, match="sealed with a key"):
        upload_checkpoint(tmp_path / "signed", uri, options)  # over another generation: sealed again, no key given
    assert store.current() == staged
    upload_checkpoint(tmp_path / "signed", uri, options, signing_key_file=key_file)
    assert store.current().id == signed.generation_id and store.current().parent == staged.id
    assert store.current().seal.mode == "mac"


def test_a_server_that_ignores_conditional_writes_is_refused_unless_accepted(moto_s3, tmp_path, source):
    from helpers.servers import FaultProxy

    from tensorizer_manifest.errors import UnsafeStorageError
    from tensorizer_manifest.storage import remote
    from tensorizer_manifest.storage.remote import RemoteDir, RemoteOptions

    with FaultProxy(moto_s3, ignore_conditions=True) as proxy:
        uri, _ = _s3(moto_s3)
        options = RemoteOptions(moto_s3.key_id, moto_s3.secret, proxy.url)
        with pytest.raises(UnsafeStorageError, match="ignores conditional writes") as refused:
            publish_to_s3(_stage(tmp_path, source, 0), uri, options)
        assert proxy.url in str(refused.value) and moto_s3.secret not in str(refused.value)
        assert [n for n in RemoteDir(uri, options).list_names()] == []  # nothing written, the probe removed
        generation = publish_to_s3(_stage(tmp_path, source, 1), uri, options, allow_unconditional_writes=True)
        assert load_manifest(uri, remote=options)[0].tensor_file.digest
        assert generation.parent is None
    assert remote.probe_conditional_writes(RemoteDir(uri, RemoteOptions(moto_s3.key_id, moto_s3.secret,
                                                                        moto_s3.endpoint))) is None  # fmt: skip


def test_an_add_form_over_a_generation_an_identical_re_save_replaced_commits_nothing(tmp_path, source):
    """The ABA of version 2: a deterministic re-save writes byte-identical manifests, and an add-form that started
    before it compared a content hash and passed, then named a file the re-save had deleted. Here the re-save is
    a new generation (a new id), so the add-form's commit over the old one is refused, and the checkpoint is whole."""
    root = tmp_path / "ckpt"
    saved = _save(root, source, seed=0)
    loaded, _ = load_manifest(root)  # the add-form's engine loaded this generation
    resaved = _save(root, source, seed=0)  # the same source again: the same manifest bytes
    assert load_manifest(root)[0] == loaded and resaved.id != saved.id
    publication = publish.begin(root, g.new_generation_id(), parent=saved.id, read_parent=False)
    write_added_form(experts_form_capture(), root, "model", loaded, into=publication.folder)
    with pytest.raises(ConcurrentWriteError, match=saved.id):
        publish.commit(
            publication,
            made_by="add-form",
            form_sets=publish.with_new_manifests(publication, saved),
            model_files=saved.model_files,
        )
    assert LocalCheckpoint(root).current_generation_id() == resaved.id
    report = validate_checkpoint(root)
    assert report.ok, report.problems


_GC_FOREVER = """
import sys
from tensorizer_manifest.storage.generations import LocalCheckpoint
store = LocalCheckpoint(sys.argv[1])
print("ready", flush=True)
while True:
    store.gc(store.plan_gc(grace_s=0, orphan_grace_s=0))
"""


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.2])
def test_kill_9_during_gc_leaves_a_checkpoint_that_loads(tmp_path, source, delay):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = tmp_path / "ckpt"
    for seed in range(6):  # five retired generations for gc to remove, file by file
        _save(root, source, seed=seed, fallbacks=False)
    current = LocalCheckpoint(root).current()
    worker = subprocess.Popen(
        [sys.executable, "-c", _GC_FOREVER, str(root)], stdout=subprocess.PIPE, cwd=Path(__file__).parents[2]
    )
    try:
        assert worker.stdout.readline().strip() == b"ready"
        time.sleep(delay)
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(30)
    assert LocalCheckpoint(root).current() == current
    assert all((root / path).is_file() for path in current.named_paths())
    report = validate_checkpoint(root)
    assert report.ok, report.problems
    store = LocalCheckpoint(root)
    store.gc(store.plan_gc(grace_s=0, orphan_grace_s=0))  # and the next gc finishes the work
    assert sorted(p.name for p in (root / "generations").iterdir()) == [current.id]


def test_what_the_probe_found_is_probed_again_after_its_time_to_live(moto_s3, monkeypatch):
    """A long-lived writer (a server that saves now and then) sees a server whose configuration changed: the
    probe's finding is kept an hour per process, then asked again."""
    from helpers.servers import FaultProxy

    from tensorizer_manifest.errors import UnsafeStorageError
    from tensorizer_manifest.storage.remote import RemoteDir, RemoteOptions, objects

    with FaultProxy(moto_s3) as proxy:
        uri, _ = _s3(moto_s3)
        location = RemoteDir(uri, RemoteOptions(moto_s3.key_id, moto_s3.secret, proxy.url))
        objects.probe_conditional_writes(location)
        proxy.ignore_conditions = True  # the server changes under the process
        objects.probe_conditional_writes(location)  # within the hour: the finding stands
        monkeypatch.setattr(objects, "PROBE_TTL_S", 0.0)
        with pytest.raises(UnsafeStorageError, match="ignores conditional writes"):
            objects.probe_conditional_writes(location)
