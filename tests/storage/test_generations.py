"""A local checkpoint of format version 3: one commit wins among racing processes, a byte-identical generation
does not pass for the one a writer read (no ABA), ``kill -9`` at any moment of a commit leaves the pointer on a
whole generation, and ``gc`` keeps what a recent reader may still read."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from tensorizer_manifest.errors import CheckpointNotFoundError, ConcurrentWriteError, IntegrityError
from tensorizer_manifest.format import generation as g
from tensorizer_manifest.format.schema import blake3_hex
from tensorizer_manifest.storage.generations import LocalCheckpoint

ROOT = Path(__file__).resolve().parents[2]


def _new(store: LocalCheckpoint, parent: str | None, payload: bytes = b"weights", gid: str | None = None):
    """A generation with one file of its own (``payload``) and the files of ``parent`` it keeps, committed."""
    gid = gid or g.new_generation_id()
    own = store.put(f"{g.generation_dir(gid)}/config.json", payload)
    files = [g.ModelFile(name="config.json", file=own)]
    return g.seal_generation(
        g.Generation(format_version=3, id=gid, parent=parent, producer="test", made_by="save", model_files=files)
    )


def test_commits_chain_and_the_pointer_names_the_document_by_hash(tmp_path):
    store = LocalCheckpoint(tmp_path)
    assert store.read_pointer() is None and store.current() is None
    first = _new(store, None)
    pointer = store.commit(first)
    assert pointer.generation == first.id
    document = (tmp_path / g.generation_document_path(first.id)).read_bytes()
    assert pointer.hash == blake3_hex(document)
    second = _new(store, first.id)
    store.commit(second)
    assert store.current() == second
    assert store.current().parent == first.id


def test_a_writer_whose_generation_was_replaced_commits_nothing(tmp_path):
    store = LocalCheckpoint(tmp_path)
    first = store.commit(_new(store, None)).generation
    store.commit(_new(store, first))
    late = _new(store, first)
    with pytest.raises(ConcurrentWriteError, match=first):
        store.commit(late)
    assert store.current_generation_id() != late.id


def test_a_byte_identical_save_is_still_a_new_generation_no_aba(tmp_path):
    """Version 2 compared content hashes: a re-save of the same source wrote the same manifest, and an add-form
    that started before it still passed. Ids never repeat, so here it cannot."""
    store = LocalCheckpoint(tmp_path)
    first = store.commit(_new(store, None, b"same")).generation
    add_form_started_from = store.current_generation_id()
    store.commit(_new(store, first, b"same"))  # a deterministic re-save: same bytes but the id
    with pytest.raises(ConcurrentWriteError):
        store.commit(_new(store, add_form_started_from, b"form"))


def test_files_are_never_replaced(tmp_path):
    store = LocalCheckpoint(tmp_path)
    store.put("generations/x/a", b"one")
    with pytest.raises(IntegrityError, match="never replaced"):
        store.put("generations/x/a", b"two")
    assert (tmp_path / "generations/x/a").read_bytes() == b"one"


def test_a_pointer_whose_document_was_swapped_is_refused(tmp_path):
    store = LocalCheckpoint(tmp_path)
    gid = store.commit(_new(store, None)).generation
    path = tmp_path / g.generation_document_path(gid)
    path.write_bytes(path.read_bytes().replace(b'"save"', b'"migrate"'))
    with pytest.raises(IntegrityError, match="not the ones the pointer names"):
        store.current()


def _race(root: str, parent: str | None, start, results) -> None:
    store = LocalCheckpoint(root)
    generation = _new(store, parent)
    start.wait(30)
    try:
        store.commit(generation)
        results.put(("won", generation.id))
    except ConcurrentWriteError:
        results.put(("lost", generation.id))


def test_of_processes_racing_from_one_generation_exactly_one_commits(tmp_path):
    store = LocalCheckpoint(tmp_path)
    first = store.commit(_new(store, None)).generation
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    racers = [context.Process(target=_race, args=(str(tmp_path), first, start, results)) for _ in range(6)]
    for racer in racers:
        racer.start()
    start.set()
    outcomes = [results.get(timeout=60) for _ in racers]
    for racer in racers:
        racer.join(30)
    won = [gid for outcome, gid in outcomes if outcome == "won"]
    assert len(won) == 1, outcomes
    assert store.current_generation_id() == won[0]


_COMMIT_FOREVER = """
import sys
from tensorizer_manifest.format import generation as g
from tensorizer_manifest.storage.generations import LocalCheckpoint
store = LocalCheckpoint(sys.argv[1])
print("ready", flush=True)
while True:
    gid = g.new_generation_id()
    own = store.put(f"{g.generation_dir(gid)}/config.json", b"x" * 4096)
    generation = g.seal_generation(g.Generation(format_version=3, id=gid, parent=store.current_generation_id(),
        producer="test", made_by="save", model_files=[g.ModelFile(name="config.json", file=own)]))
    store.commit(generation)
"""


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.03, 0.07, 0.13, 0.21])
def test_kill_9_at_any_moment_leaves_the_pointer_on_a_whole_generation(tmp_path, delay):
    store = LocalCheckpoint(tmp_path)
    store.commit(_new(store, None))
    writer = subprocess.Popen([sys.executable, "-c", _COMMIT_FOREVER, str(tmp_path)], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert writer.stdout.readline().strip() == b"ready"
        time.sleep(delay)
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(30)
    current = store.current()  # decodes, its document's hash is the pointer's
    for path in current.named_paths():
        assert (tmp_path / path).is_file(), path
    later = _new(store, current.id)  # and the next writer commits over it
    assert store.commit(later).generation == later.id


def _age(root: Path, relative: str, seconds_ago: float, now: float) -> None:
    for path in [root / relative] if (root / relative).is_file() else (root / relative).rglob("*"):
        os.utime(path, (now - seconds_ago, now - seconds_ago))


def test_gc_keeps_what_a_recent_reader_may_read_and_removes_the_rest(tmp_path):
    store = LocalCheckpoint(tmp_path)
    now = time.time()
    g1 = store.commit(_new(store, None, b"g1")).generation
    g2 = store.commit(_new(store, g1, b"g2")).generation
    g3 = store.commit(_new(store, g2, b"g3")).generation
    # g2 was committed an hour ago (g1 retired then), g3 a minute ago (g2 retired then).
    _age(tmp_path, g.generation_dir(g1), 7200, now)
    _age(tmp_path, g.generation_dir(g2), 3600, now)
    _age(tmp_path, g.generation_dir(g3), 60, now)
    _age(tmp_path, g.POINTER_NAME, 60, now)  # the pointer was swapped to g3 then
    young_orphan = store.put(f"{g.generation_dir(g.new_generation_id())}/model.tensors", b"being written").path
    old_orphan_id = g.new_generation_id()
    old_orphan = store.put(f"{g.generation_dir(old_orphan_id)}/model.tensors", b"killed writer").path
    _age(tmp_path, g.generation_dir(old_orphan_id), 2 * 86400, now)

    plan = store.plan_gc(grace_s=600, orphan_grace_s=86400, now=now)
    assert plan.current == g3
    assert plan.kept_generations == [g3, g2]  # g2 retired a minute ago: a reader may still read it
    assert sorted(plan.delete) == sorted(
        [old_orphan, f"{g.generation_dir(g1)}/config.json", g.commit_mark_path(g1), g.generation_document_path(g1)]
    )
    assert plan.delete[-1] == g.generation_document_path(g1)  # documents last
    assert young_orphan in plan.waiting
    removed = store.gc(plan)
    assert sorted(removed) == sorted(plan.delete)
    assert not (tmp_path / g.generation_dir(g1)).exists()
    assert store.current().id == g3
    for gid in (g2, g3):
        assert all((tmp_path / p).is_file() for p in store.read_generation(gid).named_paths())
    with pytest.raises(CheckpointNotFoundError, match=g1):
        store.read_generation(g1)

    later = store.plan_gc(grace_s=30, orphan_grace_s=86400, now=now)  # g2 retired over 30 s ago
    assert later.kept_generations == [g3]


def test_a_generation_whose_child_left_no_commit_mark_is_retired_no_earlier_than_its_grandchild_was_written(
    tmp_path,
):
    """A writer killed between its pointer swap and its mark: its parent's grace runs from the next writer's
    document, which that writer wrote after it read the child as current (a later time, never an earlier one)."""
    store = LocalCheckpoint(tmp_path)
    now = time.time()
    g1 = store.commit(_new(store, None, b"g1")).generation
    g2 = store.commit(_new(store, g1, b"g2")).generation
    g3 = store.commit(_new(store, g2, b"g3")).generation
    _age(tmp_path, g.generation_dir(g1), 7200, now)
    _age(tmp_path, g.generation_dir(g2), 3600, now)
    _age(tmp_path, g.generation_dir(g3), 1800, now)
    _age(tmp_path, g.POINTER_NAME, 1800, now)
    assert store.plan_gc(grace_s=2000, now=now).kept_generations == [g3, g2]  # g1 retired at g2's mark, 3600 s ago
    (tmp_path / g.commit_mark_path(g2)).unlink()
    assert store.plan_gc(grace_s=2000, now=now).kept_generations == [g3, g2, g1]  # at the latest 1800 s ago
    assert store.plan_gc(grace_s=1000, now=now).kept_generations == [g3]


def test_gc_keeps_a_file_the_current_generation_shares_with_an_old_one(tmp_path):
    store = LocalCheckpoint(tmp_path)
    now = time.time()
    g1 = _new(store, None, b"shared")
    store.commit(g1)
    kept = g1.model_files  # an add-form keeps the save's files: it names them, it does not copy them
    g2_id = g.new_generation_id()
    g2 = g.seal_generation(
        g.Generation(format_version=3, id=g2_id, parent=g1.id, producer="t", made_by="add-form", model_files=kept)
    )
    store.commit(g2)
    _age(tmp_path, g.generation_dir(g1.id), 7200, now)
    _age(tmp_path, g.generation_dir(g2_id), 3600, now)
    _age(tmp_path, g.POINTER_NAME, 3600, now)
    plan = store.plan_gc(grace_s=60, now=now)
    assert plan.delete == [g.commit_mark_path(g1.id), g.generation_document_path(g1.id)]
    store.gc(plan)
    assert (tmp_path / kept[0].file.path).read_bytes() == b"shared"


def test_gc_of_a_checkpoint_without_a_pointer_is_refused(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="format version 3"):
        LocalCheckpoint(tmp_path).plan_gc()


def test_gc_of_a_directory_that_does_not_exist_is_refused_and_creates_nothing(tmp_path):
    """Not a FileNotFoundError from the clock's scratch file (the CLI showed it as a traceback)."""
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint directory"):
        LocalCheckpoint(tmp_path / "none").plan_gc()
    assert not (tmp_path / "none").exists()


def test_a_commit_tried_again_after_a_failure_commits_once_and_another_over_a_new_parent_is_refused(tmp_path):
    """An upload whose pointer write failed (a timeout, a refusal) is tried again: the document it wrote is the
    same bytes, so the commit goes on; a try that did commit is not committed twice. The same generation id
    sealed over another parent (another document) is refused by name: a generation is committed once."""
    store = LocalCheckpoint(tmp_path)
    first = store.commit(_new(store, None)).generation
    second = _new(store, first)
    path = g.generation_document_path(second.id)
    store.create(path, g.encode_generation(second))  # the earlier try got this far, then its pointer write failed
    assert store.commit(second).generation == second.id and store.current_generation_id() == second.id
    assert store.commit(second).generation == second.id  # that try had committed: nothing happens again
    assert store.current() == second

    third = _new(store, second.id)
    store.commit(third)
    over_another = g.seal_generation(msgspec.structs.replace(second, parent=third.id, seal=None))
    with pytest.raises(IntegrityError, match=f"generation {second.id} was written before with other contents"):
        store.commit(over_another)
    assert store.current_generation_id() == third.id
