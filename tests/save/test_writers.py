"""Writers racing each other on one checkpoint, as real processes.

Every commit of a manifest is a compare-and-swap on the manifest the writer started from
(``write.commit_manifest``, under ``write.manifest_lock``): of two writers that started from one manifest, one
commits and the other gets ``ConcurrentWriteError`` and commits nothing. No race loses a form silently, leaves
a checkpoint that does not validate, or a manifest naming a file that is not there; a writer killed with
``kill -9`` at any point of its commit leaves the checkpoint as it was before or as it is after, and never
holds the lock past its death. Each race runs again with the writers' start shifted (bounded in count).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
from helpers.synthetic import experts_form_capture, make_capture, write_synthetic_checkpoint

from tensorizer_manifest.checks.validate import validate_checkpoint
from tensorizer_manifest.errors import ConcurrentWriteError, IntegrityError
from tensorizer_manifest.format.schema import MANIFEST_SUFFIX, SigningKey, manifest_generation
from tensorizer_manifest.save import write
from tensorizer_manifest.storage.checkpoint import read_manifest
from tensorizer_manifest.storage.files import this_host

MANIFEST = "model" + MANIFEST_SUFFIX
#: Start offsets of the second writer, in seconds (the first starts at the gate): same instant, then later.
SHIFTS = (0.0, 0.002, 0.02)
WAIT_S = 60.0


def _writer(what: str, checkpoint: str, gate: str, delay: float, seed: int, out: str) -> None:
    """One writer, in a process of its own: it reads the manifest it starts from, says it is ready, waits at the
    gate, sleeps ``delay``, then commits (``add-form``: a form of its own; ``re-save``: another checkpoint)."""
    base = read_manifest(checkpoint)
    started_from = write.current_generation(Path(checkpoint) / MANIFEST)
    Path(out + ".ready").touch()
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.0005)
    time.sleep(delay)
    result: dict = {"committed": False, "error": None}
    try:
        if what == "add-form":
            write.write_added_form(experts_form_capture(seed), Path(checkpoint), "model", base)
        else:
            # a re-save that began before the gate: its commit must be over the manifest it found then
            manifest, to_store = write.build_manifest(make_capture(seed=seed, fallbacks=True), "")
            name = write._write_tensors(Path(checkpoint), "model", manifest.tensor_file, to_store, None)
            manifest.seal = write.seal_manifest(manifest)
            write.commit_manifest(Path(checkpoint), "model", manifest, started_from)
            result["tensor_file"] = name
        result["committed"] = True
    except ConcurrentWriteError as exc:
        result["error"] = f"ConcurrentWriteError: {exc}"
    Path(out).write_text(json.dumps(result))


def _race(checkpoint: Path, writers: list[tuple[str, int]], delay: float, tmp: Path) -> list[dict]:
    """Start ``writers`` (what, seed) as processes, open the gate when all are ready; their results."""
    context = multiprocessing.get_context("spawn")
    gate = tmp / "gate"
    gate.unlink(missing_ok=True)
    outs = [tmp / f"writer-{i}.json" for i in range(len(writers))]
    processes = []
    for i, ((what, seed), out) in enumerate(zip(writers, outs, strict=True)):
        out.unlink(missing_ok=True)
        Path(str(out) + ".ready").unlink(missing_ok=True)
        args = (what, str(checkpoint), str(gate), delay if i else 0.0, seed, str(out))
        processes.append(context.Process(target=_writer, args=args))
        processes[-1].start()
    deadline = time.monotonic() + WAIT_S
    while not all(Path(str(out) + ".ready").exists() for out in outs):
        assert time.monotonic() < deadline, "a writer never got ready"
        time.sleep(0.01)
    gate.touch()
    for process in processes:
        process.join(WAIT_S)
        assert process.exitcode == 0, f"a writer died ({process.exitcode})"
    return [json.loads(out.read_text()) for out in outs]


def _assert_loadable(checkpoint: Path) -> None:
    report = validate_checkpoint(checkpoint)
    assert report.ok, report.problems  # every file a manifest names is there, whole


@pytest.mark.parametrize("delay", SHIFTS)
def test_two_add_forms_at_once_one_commits_the_other_is_told_and_no_form_is_lost(tmp_path, delay):
    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    results = _race(checkpoint, [("add-form", 11), ("add-form", 12)], delay, tmp_path)
    committed = [r for r in results if r["committed"]]
    assert len(committed) == 1, results
    (refused,) = [r for r in results if not r["committed"]]
    assert refused["error"].startswith("ConcurrentWriteError: ") and "re-run" in refused["error"]
    manifest = read_manifest(checkpoint)
    assert len(manifest.added_forms) == 1  # the winner's; the loser knows its form is not in
    _assert_loadable(checkpoint)
    # the loser re-runs over what is there now: both forms are in, neither lost
    write.write_added_form(experts_form_capture(13), checkpoint, "model", manifest)
    assert len(read_manifest(checkpoint).added_forms) == 2
    _assert_loadable(checkpoint)


@pytest.mark.parametrize("delay", SHIFTS)
def test_an_add_form_against_a_re_save_one_commits_and_the_checkpoint_stays_loadable(tmp_path, delay):
    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    before = read_manifest(checkpoint)
    results = _race(checkpoint, [("re-save", 21), ("add-form", 22)], delay, tmp_path)
    assert sum(r["committed"] for r in results) == 1, results
    resave, add_form = results
    manifest = read_manifest(checkpoint)
    if resave["committed"]:  # the re-save's checkpoint, with no form made from the old one
        assert add_form["error"].startswith("ConcurrentWriteError: ")
        assert manifest.tensor_file.path == resave["tensor_file"] and manifest.added_forms == []
    else:  # the add-form's: the old checkpoint and its form; the re-save was told
        assert resave["error"].startswith("ConcurrentWriteError: ")
        assert manifest.tensor_file == before.tensor_file and len(manifest.added_forms) == 1
    _assert_loadable(checkpoint)


def test_a_loader_during_add_forms_always_reads_a_whole_checkpoint(tmp_path):
    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    context = multiprocessing.get_context("spawn")
    stop = tmp_path / "stop"
    reader = context.Process(target=_validate_until, args=(str(checkpoint), str(stop), str(tmp_path / "reads.json")))
    reader.start()
    try:
        for seed in range(30, 36):  # forms added one after another while the reader reads
            write.write_added_form(experts_form_capture(seed), checkpoint, "model", read_manifest(checkpoint))
    finally:
        stop.touch()
        reader.join(WAIT_S)
    reads = json.loads((tmp_path / "reads.json").read_text())
    assert reads["count"] >= 1 and reads["problems"] == [], reads
    assert len(read_manifest(checkpoint).added_forms) == 6


def _validate_until(checkpoint: str, stop: str, out: str) -> None:
    count, problems = 0, []
    deadline = time.monotonic() + WAIT_S
    while (not os.path.exists(stop) or count == 0) and time.monotonic() < deadline:
        report = validate_checkpoint(checkpoint)
        count += 1
        problems += [f"{p.kind.__name__}: {p.message}" for p in report.problems]
    Path(out).write_text(json.dumps({"count": count, "problems": problems}))


#: Where in its commit a writer is killed (``_killed_writer``): holding the lock before comparing, with the new
#: manifest written beside the old one, and just after the rename.
KILL_POINTS = ("locked", "written", "renamed")


def _killed_writer(checkpoint: str, point: str, ready: str) -> None:
    """An add-form that stops at ``point`` of its commit, says so, and waits to be killed."""

    def pause() -> None:
        Path(ready).touch()
        time.sleep(WAIT_S)

    write_manifest, replace = write._write_manifest, os.replace

    def paused_write_manifest(out_dir, stem, manifest):
        if point == "locked":
            pause()
        return write_manifest(out_dir, stem, manifest)

    def paused_replace(src, dst):
        if str(dst).endswith(MANIFEST) and point == "written":
            pause()
        replace(src, dst)
        if str(dst).endswith(MANIFEST) and point == "renamed":
            pause()

    write._write_manifest = paused_write_manifest
    write.os.replace = paused_replace
    write.write_added_form(experts_form_capture(41), Path(checkpoint), "model", read_manifest(checkpoint))


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_writer_killed_at_each_commit_point_leaves_the_checkpoint_before_or_after_and_the_lock_free(tmp_path, point):
    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    before = manifest_generation(read_manifest(checkpoint))
    ready = tmp_path / "ready"
    process = multiprocessing.get_context("spawn").Process(
        target=_killed_writer, args=(str(checkpoint), point, str(ready))
    )
    process.start()
    deadline = time.monotonic() + WAIT_S
    while not ready.exists():
        assert process.is_alive() and time.monotonic() < deadline, "the writer never reached its commit point"
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.join(WAIT_S)
    manifest = read_manifest(checkpoint)
    assert (manifest_generation(manifest) == before) == (point != "renamed")  # before, or after the rename
    assert len(manifest.added_forms) == (1 if point == "renamed" else 0)
    _assert_loadable(checkpoint)
    # the dead writer's lock went with it: the next writer commits at once
    started = time.monotonic()
    write.write_added_form(experts_form_capture(42), checkpoint, "model", manifest)
    assert time.monotonic() - started < 10
    _assert_loadable(checkpoint)


def test_add_form_checks_the_seal_it_replaces_with_the_key_it_was_made_with(tmp_path):
    key = SigningKey(b"k" * 32)
    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True, signing_key=key)
    manifest = read_manifest(checkpoint)
    forged = read_manifest(checkpoint)
    forged.seal = write.seal_manifest(forged)  # the same content, re-sealed by someone without the key
    with pytest.raises(IntegrityError, match="not adding a form"):
        write.write_added_form(experts_form_capture(), checkpoint, "model", forged, signing_key=key)
    with pytest.raises(IntegrityError):
        write.write_added_form(experts_form_capture(), checkpoint, "model", manifest, signing_key=SigningKey(b"x" * 32))
    added = write.write_added_form(experts_form_capture(), checkpoint, "model", manifest, signing_key=key)
    assert added.seal.mode == "mac" and len(added.added_forms) == 1


def test_cleaning_up_never_touches_another_hosts_temporaries(tmp_path):
    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    dead = 2**22 + 12345  # above any pid this machine hands out
    ours = checkpoint / f".model.0123456789abcdef.tensors.{this_host()}.{dead}.tmp"
    theirs = checkpoint / f".model.0123456789abcdef.tensors.another-host.{dead}.tmp"
    for tmp in (ours, theirs):
        tmp.write_bytes(b"half a tensor file")
    write.write_added_form(experts_form_capture(), checkpoint, "model", read_manifest(checkpoint))
    assert not ours.exists()  # this host's, its writer dead: removed
    assert theirs.exists()  # another host's: its pid means nothing here


def _conditional_upload(endpoint: str, key_id: str, secret: str, uri: str, source: str, etag: str, gate: str,
                        out: str) -> None:  # fmt: skip
    """One writer of an S3 manifest, in a process of its own: at the gate, a compare-and-swap on ``etag``."""
    from tensorizer_manifest.storage.remote import RemoteFile, RemoteOptions

    target = RemoteFile(uri, RemoteOptions(key_id, secret, endpoint))
    Path(out + ".ready").touch()
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.0005)
    try:
        target.upload_if(Path(source), etag)
        Path(out).write_text("committed")
    except ConcurrentWriteError:
        Path(out).write_text("ConcurrentWriteError")


@pytest.mark.parametrize("round_", range(3))
def test_two_writers_of_one_s3_manifest_at_once_one_commits_the_other_is_told(moto_s3, tmp_path, round_):
    from helpers.servers import BUCKET

    from tensorizer_manifest.storage.remote import RemoteFile, RemoteOptions

    options = RemoteOptions(moto_s3.key_id, moto_s3.secret, moto_s3.endpoint)
    uri = f"s3://{BUCKET}/writers-{os.getpid()}-{round_}/model.manifest.json"
    sources = [write_synthetic_checkpoint(tmp_path / n, seed=i) / MANIFEST for i, n in enumerate("abc")]
    target = RemoteFile(uri, options)
    target.upload_if(sources[0], None)
    etag = target.current_etag()
    context = multiprocessing.get_context("spawn")
    gate, outs = tmp_path / "gate", [tmp_path / "w1", tmp_path / "w2"]
    processes = [
        context.Process(target=_conditional_upload, args=(moto_s3.endpoint, moto_s3.key_id, moto_s3.secret, uri,
                                                          str(source), etag, str(gate), str(out)))
        for source, out in zip(sources[1:], outs, strict=True)
    ]  # fmt: skip
    for process in processes:
        process.start()
    deadline = time.monotonic() + WAIT_S
    while not all(Path(str(out) + ".ready").exists() for out in outs):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate.touch()
    for process in processes:
        process.join(WAIT_S)
    results = [out.read_text() for out in outs]
    assert sorted(results) == ["ConcurrentWriteError", "committed"], results
    winner = sources[1 + results.index("committed")]
    assert RemoteFile(uri, options).read_bytes() == winner.read_bytes()


def _seal_as_its_writer_would(document: dict) -> dict:
    """The ``digest`` seal of a manifest document, computed from the JSON alone (what any version's writer seals:
    its compact encoding with the seal null, and ``tensor_file.encryption`` left out while ``none``)."""
    import blake3
    import msgspec

    sealed = json.loads(json.dumps(document))
    sealed["seal"] = None
    if sealed["tensor_file"].get("encryption") == "none":
        del sealed["tensor_file"]["encryption"]
    data = b"tensorizer-manifest seal v1 digest\n" + msgspec.json.encode(sealed)
    return {"mode": "digest", "hash": "blake3:" + blake3.blake3(data).hexdigest()}


def test_a_form_a_newer_version_added_is_skipped_by_loaders_and_kept_by_every_writer(tmp_path):
    """A form gains a field in a newer version: this one skips that form alone (never the checkpoint), and an
    add-form made here keeps it byte for byte under a seal that still matches."""
    from tensorizer_manifest.format.schema import UnreadableForm

    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    write.write_added_form(experts_form_capture(), checkpoint, "model", read_manifest(checkpoint))
    document = json.loads((checkpoint / MANIFEST).read_bytes())
    document["added_forms"][0]["made_by"] = {"a_field_of_a_newer_version": [1, "two"]}
    document["seal"] = _seal_as_its_writer_would(document)
    (checkpoint / MANIFEST).write_text(json.dumps(document, indent=3))  # another writer's layout: seal unaffected

    manifest = read_manifest(checkpoint)
    (newer,) = manifest.added_forms
    assert isinstance(newer, UnreadableForm) and "made_by" in newer.reason
    report = validate_checkpoint(checkpoint)
    assert report.ok, report.problems  # the seal matched: the form was kept as it was written
    assert [w for w in report.warnings if "added form 0" in w and "cannot read it" in w and "loaders skip it" in w]

    write.write_added_form(experts_form_capture(7), checkpoint, "model", manifest)
    after = json.loads((checkpoint / MANIFEST).read_bytes())
    assert len(after["added_forms"]) == 2 and after["added_forms"][0] == document["added_forms"][0]
    assert after["seal"] == _seal_as_its_writer_would(after)
    assert validate_checkpoint(checkpoint).ok


def test_a_form_is_used_only_over_the_fallbacks_it_was_made_from(tmp_path):
    """A form records the fallbacks it was made from (``base``): moved over other fallbacks (a re-save of other
    weights), it is named and skipped, and says how to get it back."""
    from tensorizer_manifest.format.schema import form_base, seal_manifest

    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    with_form = write.write_added_form(experts_form_capture(), checkpoint, "model", read_manifest(checkpoint))
    (form,) = with_form.added_forms
    assert form.base == form_base(with_form, ["model.layers.0.mlp.experts"])
    assert validate_checkpoint(checkpoint).ok

    other = write_synthetic_checkpoint(tmp_path / "other", seed=5, fallbacks=True)
    resaved = read_manifest(other)
    assert form_base(resaved, ["model.layers.0.mlp.experts"]) != form.base
    (other / form.tensor_file.path).write_bytes((checkpoint / form.tensor_file.path).read_bytes())
    resaved.added_forms = [form]
    resaved.seal = seal_manifest(resaved)
    write._write_manifest(other, "model", resaved)
    problems = validate_checkpoint(other).problems
    assert [p.message for p in problems] == [
        f"added form 0 ({form.tensor_file.path}) was made from other raw fallbacks than this manifest's (the "
        "checkpoint was re-saved after it was added?): run add-form again"
    ]


def test_ranks_of_different_saves_are_refused_before_reading_naming_each_save(tmp_path):
    """Each rank commits its own manifest; all ranks of one save share its id, and a loader refuses a mix (a
    save that failed on some ranks after the others committed)."""
    from tensorizer_manifest.storage.checkpoint import check_one_save

    stems = ["model-tp0-of-2", "model-tp1-of-2"]
    first, second = "a" * 32, "b" * 32
    for rank, stem in enumerate(stems):
        write.write_checkpoint(make_capture(rank), tmp_path, stem, save_id=first)
    rank0 = read_manifest(tmp_path, stems[0])
    assert rank0.save_id == first and rank0.format_version == 2
    check_one_save(rank0, stems[0], tmp_path)  # one save: passes
    write.write_checkpoint(make_capture(9), tmp_path, stems[1], save_id=second)  # rank 1 alone saved again
    for stem in stems:
        with pytest.raises(IntegrityError, match=f"model-tp0-of-2 by save {first}; model-tp1-of-2 by save {second}"):
            check_one_save(read_manifest(tmp_path, stem), stem, tmp_path)

    one_rank = write_synthetic_checkpoint(tmp_path / "one")
    assert b"save_id" not in (one_rank / MANIFEST).read_bytes()  # one rank: no id, the manifest as before
    assert read_manifest(one_rank).format_version == 1


def test_a_prepared_save_abandoned_leaves_the_checkpoint_as_it_was(tmp_path):
    """What a rank does when another rank of its save failed: its tensor file goes, unless the manifest in place
    names it (a re-save of the same bytes has the same name), and no manifest changes."""
    checkpoint = write_synthetic_checkpoint(tmp_path / "c", seed=1)
    manifest_bytes = (checkpoint / MANIFEST).read_bytes()
    named = read_manifest(checkpoint).tensor_file.path

    other = write.prepare_checkpoint(make_capture(2), checkpoint, "model", save_id="c" * 32)
    assert other.tensor_name != named and (checkpoint / other.tensor_name).is_file()
    other.abandon()
    assert not (checkpoint / other.tensor_name).exists()

    same = write.prepare_checkpoint(make_capture(1), checkpoint, "model", save_id="d" * 32)
    assert same.tensor_name == named
    same.abandon()
    assert (checkpoint / MANIFEST).read_bytes() == manifest_bytes
    assert sorted(p.name for p in checkpoint.glob("*.tensors")) == [named]
    assert validate_checkpoint(checkpoint).ok
