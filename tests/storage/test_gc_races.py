"""``gc`` never loses to a committing writer: writers and ``gc`` as processes of their own (the installed
``tensorizer-manifest gc``), stopped at named steps (``_failpoints``), a gc whose clock runs two days fast, a
writer that waited long before its commit, and an S3 pointer PUT whose answer was lost. Each ends in a checkpoint
that loads as one committed save, or in a typed refusal; no writer exits 0 having lost its work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import writer_process
from helpers.synthetic import save_generation

from tensorizer_manifest.checks.validate import validate_checkpoint
from tensorizer_manifest.format import generation as g
from tensorizer_manifest.storage.checkpoint import load_manifest
from tensorizer_manifest.storage.generations import LocalCheckpoint

GC = [str(Path(sys.executable).with_name("tensorizer-manifest")), "gc"]
TWO_DAYS_FAST = """
import time
_real = time.time
time.time = lambda: _real() + 2 * 86400
"""


@pytest.fixture
def source(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    (source / "tokenizer.json").write_text('{"version": "1.0"}\n')
    return source


@pytest.fixture
def gate(tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    return gate


def _gc(*args: str, env: dict | None = None, wait: bool = True):
    command = [*GC, *args]
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def _loads_as(root: Path, generation_id: str) -> None:
    """The checkpoint's pointer names ``generation_id``, every file it names is there, and it validates."""
    store = LocalCheckpoint(root)
    current = store.current()
    assert current.id == generation_id
    missing = [path for path in current.named_paths() if not (root / path).is_file()]
    assert not missing, missing
    report = validate_checkpoint(root)
    assert report.ok, report.problems


def test_gc_with_its_defaults_never_removes_a_writer_paused_before_its_commit(tmp_path, source, gate):
    root = tmp_path / "ckpt"
    save_generation(root, source, seed=0)
    writer = writer_process.start("local", str(root), str(source), "1", pause_at="before-commit", gate=gate)
    pending = writer_process.wait_until_paused(gate, "before-commit", writer)
    collected = _gc(str(root), "--json")  # its document is written: not yet committed
    assert collected.returncode == 0, collected.stderr
    assert not any(pending in path for path in json.loads(collected.stdout)["removed"])
    code, output = writer_process.release(gate, "before-commit", writer)
    assert code == 0 and f"committed {pending}" in output, output
    _loads_as(root, pending)


def test_a_commit_between_gc_reading_the_pointer_and_listing_the_files_is_kept(tmp_path, source, gate):
    root = tmp_path / "ckpt"
    first = save_generation(root, source, seed=0)
    env = {**os.environ, "TENSORIZER_MANIFEST_PAUSE_AT": f"gc-after-pointer:{gate}"}
    collector = _gc(str(root), "--grace", "0", "--json", env=env, wait=False)
    assert writer_process.wait_until_paused(gate, "gc-after-pointer", collector) == first.id
    writer = writer_process.start("local", str(root), str(source), "1")
    output, _ = writer.communicate(timeout=120)  # commits while gc holds the pointer it read
    assert writer.returncode == 0, output
    committed = output.split("committed ")[1].split()[0]
    code, gc_output = writer_process.release(gate, "gc-after-pointer", collector)
    assert code == 0, gc_output
    _loads_as(root, committed)


def test_a_gc_whose_clock_runs_two_days_fast_removes_no_young_file(tmp_path, source, gate):
    """Ages come from the storage's clock, not the gc host's."""
    root = tmp_path / "ckpt"
    save_generation(root, source, seed=0)
    fast = tmp_path / "fast-clock"
    fast.mkdir()
    (fast / "sitecustomize.py").write_text(TWO_DAYS_FAST)
    writer = writer_process.start("local", str(root), str(source), "1", pause_at="before-commit", gate=gate)
    pending = writer_process.wait_until_paused(gate, "before-commit", writer)
    env = {**os.environ, "PYTHONPATH": str(fast)}
    probe = subprocess.run([sys.executable, "-c", "import time; print(time.time())"], env=env, capture_output=True)
    assert float(probe.stdout) > time.time() + 86400  # the gc's clock is fast indeed
    collected = _gc(str(root), "--json", env=env)
    assert collected.returncode == 0, collected.stderr
    assert json.loads(collected.stdout)["removed"] == []
    code, output = writer_process.release(gate, "before-commit", writer)
    assert code == 0 and f"committed {pending}" in output, output
    _loads_as(root, pending)


def test_a_parent_stays_its_grace_after_a_commit_that_waited_longer_than_the_grace(tmp_path, source, gate):
    """A generation is retired when the pointer swaps, not when its child's document was written: a writer that
    waited (a lock, retries, a pause) must not leave the generation readers just read past its grace."""
    root = tmp_path / "ckpt"
    first = save_generation(root, source, seed=0)
    writer = writer_process.start("local", str(root), str(source), "1", pause_at="before-commit", gate=gate)
    pending = writer_process.wait_until_paused(gate, "before-commit", writer)
    manifest, path = load_manifest(root)  # a loader reads the first generation's pointer...
    time.sleep(6)  # ...while the writer waits longer than the grace below
    code, output = writer_process.release(gate, "before-commit", writer)
    assert code == 0 and f"committed {pending}" in output, output
    store = LocalCheckpoint(root)
    swapped = (root / g.POINTER_NAME).stat().st_mtime  # by the storage's clock, as gc measures
    # A second after the swap, however long this loaded machine took since: the first generation was current a
    # moment ago (and its child's document was written 7 s before, past the grace).
    store.gc(store.plan_gc(grace_s=4, now=swapped + 1))
    assert load_manifest(root, generation=store.read_generation(first.id)) == (manifest, path)
    assert all((root / p).is_file() for p in first.named_paths())
    _loads_as(root, pending)


def test_a_commit_whose_files_gc_removed_meanwhile_is_refused_and_the_pointer_stays(tmp_path, source, gate):
    root = tmp_path / "ckpt"
    first = save_generation(root, source, seed=0)
    writer = writer_process.start("local", str(root), str(source), "1", pause_at="before-commit", gate=gate)
    pending = writer_process.wait_until_paused(gate, "before-commit", writer)
    collected = _gc(str(root), "--orphan-grace", "0")  # asked to: the writer's folder goes
    assert collected.returncode == 0, collected.stderr
    assert not (root / g.generation_dir(pending) / "model.manifest.json").exists()
    code, output = writer_process.release(gate, "before-commit", writer)
    assert code == 1 and "refused:" in output and pending in output, output
    assert "nothing was committed" in output, output
    _loads_as(root, first.id)


def test_gc_keeps_a_pinned_generation_past_its_grace(tmp_path, source):
    root = tmp_path / "ckpt"
    pinned = save_generation(root, source, seed=0)
    middle = save_generation(root, source, seed=1)
    current = save_generation(root, source, seed=2)
    collected = _gc(str(root), "--grace", "0", "--keep", pinned.id, "--json")
    assert collected.returncode == 0, collected.stderr
    report = json.loads(collected.stdout)
    assert pinned.id in report["kept_generations"] and middle.id not in report["kept_generations"]
    assert all((root / p).is_file() for p in pinned.named_paths())
    assert not (root / g.generation_document_path(middle.id)).exists()
    _loads_as(root, current.id)
    assert validate_checkpoint(root / g.generation_dir(pinned.id)).ok  # still loadable as vLLM's model
    unknown = _gc(str(root), "--keep", "not-an-id")
    assert unknown.returncode == 2 and "not-an-id" in unknown.stderr


# -- S3 (moto on 127.0.0.1) ----------------------------------------------------------------------------------------


def _staged(tmp_path: Path, source: Path, seed: int) -> Path:
    staging = tmp_path / f"staging-{seed}"
    save_generation(staging, source, seed=seed)
    return staging


def _s3(server):
    from helpers.remote import fresh_prefix, options_for

    return fresh_prefix("gc"), options_for(server)


def _s3_args(options) -> list[str]:
    return ["--s3-access-key-id", options.access_key_id, "--s3-secret-access-key", options.secret_access_key,
            "--s3-endpoint", options.endpoint]  # fmt: skip


def test_gc_on_s3_never_removes_a_writer_paused_before_its_commit(moto_s3, tmp_path, source, gate):
    from tensorizer_manifest.storage.generations import S3Checkpoint
    from tensorizer_manifest.storage.remote import RemoteDir
    from tensorizer_manifest.storage.remote_checkpoint import publish_to_s3

    uri, options = _s3(moto_s3)
    publish_to_s3(_staged(tmp_path, source, 0), uri, options)
    credentials = ",".join((options.access_key_id, options.secret_access_key, options.endpoint))
    staged = _staged(tmp_path, source, 1)
    writer = writer_process.start("s3", str(staged), uri, credentials, pause_at="before-commit", gate=gate)
    pending = writer_process.wait_until_paused(gate, "before-commit", writer)
    collected = _gc(uri, "--grace", "0", "--json", *_s3_args(options))
    assert collected.returncode == 0, collected.stderr
    assert not any(pending in path for path in json.loads(collected.stdout)["removed"])
    code, output = writer_process.release(gate, "before-commit", writer)
    assert code == 0 and f"committed {pending}" in output, output
    store = S3Checkpoint(RemoteDir(uri, options))
    assert store.current_generation_id() == pending
    report = validate_checkpoint(uri, remote=options)
    assert report.ok, report.problems
    again = _gc(uri, "--grace", "0", "--json", *_s3_args(options))  # the first generation is past its grace
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["kept_generations"] == [pending]
    assert validate_checkpoint(uri, remote=options).ok


def test_an_s3_pointer_put_that_landed_and_whose_answer_was_lost_is_a_commit(moto_s3, tmp_path, source):
    """The PUT is tried again on a lost connection; the retry's 412 is this writer's own commit, not another's."""
    from helpers.servers import Fault, FaultProxy

    from tensorizer_manifest.storage.generations import S3Checkpoint
    from tensorizer_manifest.storage.remote import RemoteDir, RemoteOptions
    from tensorizer_manifest.storage.remote_checkpoint import publish_to_s3

    uri, options = _s3(moto_s3)
    first = publish_to_s3(_staged(tmp_path, source, 0), uri, options)
    staged = _staged(tmp_path, source, 1)
    with FaultProxy(moto_s3) as proxy:
        fault = proxy.add(Fault(method="PUT", path=g.POINTER_NAME, drop_answer=True))
        through = RemoteOptions(options.access_key_id, options.secret_access_key, proxy.url)
        second = publish_to_s3(staged, uri, through)
        assert fault.applied == 1
    store = S3Checkpoint(RemoteDir(uri, options))
    assert store.current_generation_id() == second.id and second.parent == first.id
    top = RemoteDir(uri, options) / "config.json"
    assert top.read_bytes() == (source / "config.json").read_bytes()  # refreshed after its commit
    assert validate_checkpoint(uri, remote=options).ok


def test_gc_on_s3_aborts_a_killed_writer_s_upload_and_removes_its_scratch_keys_past_the_orphan_grace(
    moto_s3, tmp_path, source
):
    from tensorizer_manifest.storage.remote import RemoteDir, unfinished_uploads
    from tensorizer_manifest.storage.remote.objects import PROBE_SCRATCH_PREFIX
    from tensorizer_manifest.storage.remote_checkpoint import publish_to_s3

    uri, options = _s3(moto_s3)
    publish_to_s3(_staged(tmp_path, source, 0), uri, options)
    client, prefix = moto_s3.client(), uri.split("/", 3)[3]
    key = f"{prefix}/{g.generation_dir(g.new_generation_id())}/model.0123456789abcdef.tensors"
    upload = client.create_multipart_upload(Bucket=uri.split("/")[2], Key=key)["UploadId"]
    client.upload_part(Bucket=uri.split("/")[2], Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1024)
    scratch = f"{PROBE_SCRATCH_PREFIX}0123456789abcdef"
    (RemoteDir(uri, options) / scratch).put_bytes(b"probe")  # a probe killed before it removed its key
    kept = _gc(uri, "--json", *_s3_args(options))  # the default orphan grace: a writer may be at it
    assert kept.returncode == 0, kept.stderr
    assert len(unfinished_uploads(RemoteDir(uri, options))) == 1
    assert scratch in RemoteDir(uri, options).list_names()
    collected = _gc(uri, "--orphan-grace", "0", "--json", *_s3_args(options))
    assert collected.returncode == 0, collected.stderr
    assert unfinished_uploads(RemoteDir(uri, options)) == []
    assert scratch not in RemoteDir(uri, options).list_names()
    assert not [n for n in RemoteDir(uri, options).list_names() if n.startswith(".tensorizer-manifest-clock")]
    assert validate_checkpoint(uri, remote=options).ok
