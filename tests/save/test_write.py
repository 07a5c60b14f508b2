"""Crash safety of saving: kill -9 a save at many moments and inspect what it left behind.

The requirement: files are written under temporary names and renamed into
place, the manifest last; a save killed at any moment leaves no checkpoint that
looks loadable, and never damages a good checkpoint already at OUT.

Each kill point is ``(anchor, delay)``: wait until the save has reached a stage
(seen by polling the directory), sleep ``delay`` seconds, then SIGKILL the
process and wait for it to be gone before looking at the directory. Stages, in
the order a save passes through them:

* ``spawn``        the process has just been started
* ``tmp``          the hidden temporary tensor file exists
* ``tensors``      a new ``model.<hex>.tensors`` has been renamed into place
* ``manifest_tmp`` the hidden temporary manifest exists (lives a few ms: may be missed)
* ``commit``       ``model.manifest.json`` has been (re)placed by this process

Polling can miss short-lived stages; waiting is for "this stage or a later
one", so a missed stage just moves that kill point a little later. Many kill
points, not precise timing, give the coverage.

The saving process runs ``tests/helpers/synthetic.py OUT SCALE`` (rewrite a checkpoint
at OUT forever, a new seed each time). Importing torch costs several CPU
seconds on a small CI machine, so most kill points use processes forked from
one "zygote" process that has imported torch, tensorizer and the writer once
and then runs the script's ``__main__`` with ``runpy``; one kill point of the
first test starts the script the plain way, ``python tests/helpers/synthetic.py OUT SCALE``.
Either way the process killed is a separate process executing that script.
"""

from __future__ import annotations

import filecmp
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tensorizer_manifest.checks.validate import validate_checkpoint
from tensorizer_manifest.errors import CheckpointNotFoundError
from tensorizer_manifest.format.schema import MANIFEST_SUFFIX, TENSORS_SUFFIX
from tensorizer_manifest.storage.checkpoint import find_manifest, read_manifest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/helpers/synthetic.py"
#: One write of the synthetic checkpoint at this scale (~24 MB of tensors) takes ~0.2-0.8 s on 2 cores.
SCALE = "4096"
MANIFEST = "model" + MANIFEST_SUFFIX
#: The writers' lock file (``write.manifest_lock``): it stays, empty, beside the manifest.
LOCK = f".{MANIFEST}.lock"
WAIT_S = 90.0  # generous ceiling for any single wait on a loaded machine

STAGES = ("spawn", "tmp", "tensors", "manifest_tmp", "commit")
posix_only = pytest.mark.skipif(not hasattr(os, "fork"), reason="kills savers with fork and SIGKILL (POSIX)")

_ZYGOTE = rf"""
import os, runpy, signal, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import tensorizer  # noqa: F401  (imported lazily by the writer: pay for it once, here)
import helpers.synthetic  # noqa: F401  (torch and tensorizer_manifest, imported once)
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "spawn":
        pid = os.fork()
        if pid == 0:
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)
            sys.argv = [{SCRIPT!r}, *args]
            try:
                runpy.run_path({SCRIPT!r}, run_name="__main__")
            finally:
                os._exit(3)
        print(pid, flush=True)
    elif cmd == "kill":
        pid = int(args[0])
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        print(status, flush=True)
"""


class Zygote:
    """A process that imported the writer once and forks savers on demand."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        assert self._readline() == "ready"

    def _readline(self) -> str:
        if not self._sel.select(timeout=WAIT_S):
            raise AssertionError("the zygote process did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the zygote process died (exit {self.proc.poll()})")
        return line.strip()

    def _ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._readline()

    def spawn(self, out: Path) -> Saver:
        pid = int(self._ask(f"spawn {out} {SCALE}"))

        def kill() -> int:
            return int(self._ask(f"kill {pid}"))  # SIGKILL, then waitpid: returns the wait status

        def alive() -> bool:  # not our child: ask /proc whether it has exited (a zombie, "Z")
            try:
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            except (OSError, IndexError):
                return True

        return Saver(pid, kill, alive)

    def close(self) -> None:
        self.proc.kill()  # it holds nothing; its savers have all been killed and reaped
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def spawn_plain(out: Path) -> Saver:
    """``python tests/helpers/synthetic.py OUT SCALE`` in a fresh interpreter."""
    proc = subprocess.Popen([sys.executable, SCRIPT, str(out), SCALE], cwd=ROOT, stdout=subprocess.DEVNULL)

    def kill() -> int:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=WAIT_S)
        return -proc.returncode if proc.returncode < 0 else proc.returncode << 8

    return Saver(proc.pid, kill, lambda: proc.poll() is None)


class Saver:
    def __init__(self, pid: int, kill, alive) -> None:
        self.pid = pid
        self._kill = kill
        self.alive = alive
        self.killed = False

    def kill(self) -> None:
        """SIGKILL; returns only once the process is gone. It must still have been running."""
        status = self._kill()
        self.killed = True
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"the saver (pid {self.pid}) was not running when killed (wait status {status}): it crashed on its own"
        )


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def _stage(out: Path, baseline_tensors: set[str], baseline_manifest_ino: int | None) -> int:
    """The furthest stage of the first save that the directory shows now."""
    names = os.listdir(out) if out.is_dir() else []
    stage = 0
    try:
        ino = os.stat(out / MANIFEST).st_ino
    except FileNotFoundError:
        ino = None
    if ino is not None and ino != baseline_manifest_ino:
        return STAGES.index("commit")
    for name in names:
        if name.startswith(".") and name.endswith(".tmp"):
            if ".manifest.json." in name:
                stage = max(stage, STAGES.index("manifest_tmp"))
            elif ".tensors." in name:
                stage = max(stage, STAGES.index("tmp"))
        elif name.endswith(TENSORS_SUFFIX) and name not in baseline_tensors:
            stage = max(stage, STAGES.index("tensors"))
    return stage


def kill_at(spawn, out: Path, anchor: str, delay: float) -> dict:
    """Start a saver into ``out``, kill it ``delay`` s after it reaches ``anchor``; what it reached."""
    baseline_tensors = {n for n in os.listdir(out) if n.endswith(TENSORS_SUFFIX)} if out.is_dir() else set()
    try:
        baseline_ino = os.stat(out / MANIFEST).st_ino
    except FileNotFoundError:
        baseline_ino = None
    target = STAGES.index(anchor)
    started = time.monotonic()
    saver = spawn(out)
    try:
        reached = 0
        deadline = time.monotonic() + WAIT_S
        while reached < target:
            reached = max(reached, _stage(out, baseline_tensors, baseline_ino))
            if reached >= target:
                break
            if not saver.alive():
                raise AssertionError(f"the saver (pid {saver.pid}) exited on its own before stage {anchor!r}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the saver never reached stage {anchor!r} (got to {STAGES[reached]!r})")
            time.sleep(0.0005)
        if delay:
            time.sleep(delay)
        saver.kill()
    finally:
        if not saver.killed:
            try:
                saver._kill()
            except Exception:
                pass
    return {"anchor": anchor, "delay": delay, "reached": STAGES[reached], "seconds": time.monotonic() - started}


def check_no_lookalikes(out: Path) -> list[str]:
    """Hidden leftovers must be ``.*.tmp`` and must not end like a checkpoint file; returns them (the writers'
    lock file, which stays, aside)."""
    hidden = [n for n in os.listdir(out) if n.startswith(".") and n != LOCK]
    for name in hidden:
        assert name.endswith(".tmp"), f"hidden leftover {name!r} is not a .tmp file"
        assert not name.endswith((MANIFEST_SUFFIX, TENSORS_SUFFIX)), f"leftover {name!r} looks like a checkpoint file"
    manifests = [n for n in os.listdir(out) if n.endswith(MANIFEST_SUFFIX)]
    assert manifests in ([], [MANIFEST]), f"unexpected manifest-like files: {manifests}"
    return hidden


class References:
    """What the saver writes for each seed (1, 2, ...), made in-process: the same tensors give the
    same content-derived tensor file name and the same bytes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tensors: dict[str, Path] = {}  # tensor file name -> a complete copy
        self.seeds: dict[str, int] = {}  # tensor file name -> seed
        self._next_seed = 0

    def _make(self) -> None:
        from helpers.synthetic import write_synthetic_checkpoint

        seed = self._next_seed
        self._next_seed += 1
        out = write_synthetic_checkpoint(self.root / f"seed{seed}", seed=seed, scale=int(SCALE))
        name = read_manifest(out / MANIFEST).tensor_file.path
        self.tensors[name] = out / name
        self.seeds[name] = seed

    def seed_of_manifest(self, manifest_path: Path) -> int | None:
        """Which save wrote this manifest (by the tensor file it names), or None."""
        name = read_manifest(manifest_path).tensor_file.path
        while name not in self.seeds and self._next_seed < 12:
            self._make()
        return self.seeds.get(name)

    def check_complete_tensor_file(self, path: Path) -> None:
        """A ``.tensors`` file outside a temporary name must be whole: byte-identical to a finished save."""
        while path.name not in self.tensors and self._next_seed < 12:
            self._make()
        assert path.name in self.tensors, f"{path.name} is not a tensor file any save of the saver would write"
        assert filecmp.cmp(path, self.tensors[path.name], shallow=False), f"{path.name} is incomplete or damaged"


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> References:
    return References(tmp_path_factory.mktemp("references"))


# Kill points for a first save into an empty directory. ``spawn``/0 kills before
# anything is written; ``commit`` kill points come after the first save has
# committed (during the cleanup that follows, or during the next save).
FIRST_SAVE_POINTS = [
    ("spawn", 0.0),
    ("spawn", 0.05),
    ("tmp", 0.0),
    ("tmp", 0.01),
    ("tmp", 0.03),
    ("tmp", 0.08),
    ("tmp", 0.15),
    ("tmp", 0.3),
    ("tensors", 0.0),
    ("tensors", 0.002),
    ("manifest_tmp", 0.0),
    ("commit", 0.0),
    ("commit", 0.002),
    ("commit", 0.05),
    ("commit", 0.3),
]


@posix_only
def test_killed_first_save_leaves_nothing_loadable_or_a_complete_checkpoint(zygote, references, tmp_path):
    outcomes: Counter[str] = Counter()
    details = []
    points = [(zygote.spawn, *p) for p in FIRST_SAVE_POINTS] + [(spawn_plain, "tmp", 0.02)]
    for i, (spawn, anchor, delay) in enumerate(points):
        out = tmp_path / f"out{i}"
        out.mkdir()
        info = kill_at(spawn, out, anchor, delay)
        hidden = check_no_lookalikes(out)
        orphans = sorted(n for n in os.listdir(out) if n.endswith(TENSORS_SUFFIX))
        for name in orphans:
            references.check_complete_tensor_file(out / name)
        others = set(os.listdir(out)) - set(orphans) - set(hidden) - {MANIFEST, "config.json", LOCK}
        assert not others, f"kill at {info}: unexpected files {others}"
        report = validate_checkpoint(out)
        if (out / MANIFEST).exists():
            assert report.ok, (
                f"kill at {info}: a manifest is in place but the checkpoint is not valid: {report.problems}"
            )
            seed = references.seed_of_manifest(out / MANIFEST)
            assert seed is not None and seed >= 1, f"kill at {info}: the manifest is not one the saver writes whole"
            tensor_name = read_manifest(out / MANIFEST).tensor_file.path
            extra = [n for n in orphans if n != tensor_name]
            outcome = (
                f"complete (save {seed})"
                + (" + unreferenced .tensors" if extra else "")
                + (" + .tmp" if hidden else "")
            )
        else:
            assert not report.ok
            assert [p.kind for p in report.problems] == [CheckpointNotFoundError], report.problems
            with pytest.raises(CheckpointNotFoundError):
                find_manifest(out)
            outcome = "no manifest" + (" + complete .tensors" if orphans else "") + (" + .tmp" if hidden else "")
            if not os.listdir(out):
                outcome = "no manifest (empty)"
        outcomes[outcome] += 1
        details.append((info, outcome))
        shutil.rmtree(out)
    print("\nfirst save, kill points -> outcome:")
    for info, outcome in details:
        print(
            f"  {info['anchor']:>12} +{info['delay']:<6} "
            f"(reached {info['reached']:>12}, {info['seconds']:5.2f} s): {outcome}"
        )
    print("outcomes:", dict(outcomes))
    assert sum(n for k, n in outcomes.items() if k.startswith("no manifest")) >= 1, outcomes
    assert sum(n for k, n in outcomes.items() if k.startswith("complete")) >= 1, outcomes
    # Killing after the temporary tensor file exists but before the commit must have been exercised.
    assert any(
        o.startswith("no manifest") and i["reached"] in ("tmp", "tensors", "manifest_tmp") for i, o in details
    ), details


# Kill points for a save over a good checkpoint.
OVERWRITE_POINTS = [
    ("spawn", 0.0),
    ("tmp", 0.0),
    ("tmp", 0.03),
    ("tmp", 0.1),
    ("tmp", 0.25),
    ("tensors", 0.0),
    ("tensors", 0.001),
    ("tensors", 0.002),
    ("tensors", 0.005),
    ("manifest_tmp", 0.0),
    ("commit", 0.0),
    ("commit", 0.001),
    ("commit", 0.01),
    ("commit", 0.4),
]


@posix_only
def test_killed_save_never_damages_a_good_checkpoint(zygote, references, tmp_path):
    from helpers.synthetic import write_synthetic_checkpoint

    template = write_synthetic_checkpoint(tmp_path / "template", seed=0, scale=int(SCALE))
    assert validate_checkpoint(template).ok
    old_manifest = (template / MANIFEST).read_bytes()

    assert references.seed_of_manifest(template / MANIFEST) == 0

    outcomes: Counter[str] = Counter()
    details = []
    points = [(zygote.spawn, *p) for p in OVERWRITE_POINTS]
    last = None
    for i, (spawn, anchor, delay) in enumerate(points):
        out = tmp_path / f"out{i}"
        shutil.copytree(template, out)
        info = kill_at(spawn, out, anchor, delay)
        hidden = check_no_lookalikes(out)
        report = validate_checkpoint(out)
        assert report.ok, f"kill at {info} damaged the checkpoint at OUT: {report.problems}"
        referenced = read_manifest(out / MANIFEST).tensor_file.path
        seed = references.seed_of_manifest(out / MANIFEST)
        assert seed is not None, f"kill at {info}: the manifest is not one any save writes whole"
        is_old = seed == 0
        if is_old:
            assert (out / MANIFEST).read_bytes() == old_manifest, f"kill at {info}: the old manifest was modified"
        tensors = sorted(n for n in os.listdir(out) if n.endswith(TENSORS_SUFFIX))
        assert referenced in tensors
        # Anything else not hidden is a whole tensor file nobody references: the old one not yet
        # deleted, or a new one whose manifest never got written. Never a partial file.
        extra = [n for n in tensors if n != referenced]
        assert len(extra) <= 1, f"kill at {info}: more than one unreferenced tensor file: {extra}"
        for name in tensors:
            references.check_complete_tensor_file(out / name)
        others = set(os.listdir(out)) - set(tensors) - set(hidden) - {MANIFEST, "config.json", LOCK}
        assert not others, f"kill at {info}: unexpected files {others}"
        outcome = (
            ("old" if is_old else f"new (save {seed})")
            + (" + unreferenced .tensors" if extra else "")
            + (" + .tmp" if hidden else "")
        )
        outcomes[outcome] += 1
        details.append((info, outcome))
        if last is not None:
            shutil.rmtree(last)
        last = out
    print("\nsave over a good checkpoint, kill points -> outcome:")
    for info, outcome in details:
        print(
            f"  {info['anchor']:>12} +{info['delay']:<6} "
            f"(reached {info['reached']:>12}, {info['seconds']:5.2f} s): {outcome}"
        )
    print("outcomes:", dict(outcomes))
    assert any(o.startswith("old") for o in outcomes), outcomes
    assert any(o.startswith("new") for o in outcomes), outcomes

    # The next successful save into the last directory cleans up unreferenced tensor files
    # (other processes' hidden .tmp files are left alone; they never look like a checkpoint).
    write_synthetic_checkpoint(last, seed=12345, scale=1)
    assert validate_checkpoint(last).ok
    tensors = [n for n in os.listdir(last) if n.endswith(TENSORS_SUFFIX)]
    assert tensors == [read_manifest(last / MANIFEST).tensor_file.path]
    check_no_lookalikes(last)


def test_leftover_temporary_files_do_not_confuse_lookup(tmp_path):
    from helpers.synthetic import write_synthetic_checkpoint

    # Beside a good checkpoint: ignored.
    out = write_synthetic_checkpoint(tmp_path / "good", seed=0, scale=1)
    name = read_manifest(out / MANIFEST).tensor_file.path
    (out / f".{name}.123.tmp").write_bytes(b"\0" * 100)  # a truncated tensor file
    (out / f".model.deadbeefdeadbeef{TENSORS_SUFFIX}.124.tmp").write_bytes(b"junk")
    (out / f".{MANIFEST}.125.tmp").write_bytes(b'{"format_version": ')  # a truncated manifest
    assert find_manifest(out) == out / MANIFEST
    report = validate_checkpoint(out)
    assert report.ok, report.problems
    assert report.tensor_path == out / name

    # Alone in a directory: nothing that looks like a checkpoint.
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / f".model.0123456789abcdef{TENSORS_SUFFIX}.123.tmp").write_bytes(b"\0" * 100)
    (lone / f".{MANIFEST}.123.tmp").write_bytes(b"{}")
    with pytest.raises(CheckpointNotFoundError):
        find_manifest(lone)
    report = validate_checkpoint(lone)
    assert not report.ok
    assert [p.kind for p in report.problems] == [CheckpointNotFoundError]


def test_the_manifest_records_the_prefix_and_is_sealed_last(tmp_path):
    from helpers.synthetic import make_capture

    from tensorizer_manifest.format.schema import SigningKey, seal_hash
    from tensorizer_manifest.save.write import write_checkpoint
    from tensorizer_manifest.storage.tensor_file import prefix_hash, prefix_size, read_index

    manifest = write_checkpoint(make_capture(), tmp_path / "a", "model")
    tensor_path = tmp_path / "a" / manifest.tensor_file.path
    ref = manifest.tensor_file
    assert ref.prefix_size == prefix_size(read_index(tensor_path), ref.size) < ref.size
    assert ref.prefix_hash == prefix_hash(tensor_path, ref.prefix_size)
    assert manifest.seal.mode == "digest" and manifest.seal.hash == seal_hash(manifest, "digest")
    key = SigningKey(b"k" * 32)
    signed = write_checkpoint(make_capture(), tmp_path / "b", "model", signing_key=key)
    assert signed.seal.mode == "mac" and signed.seal.hash == seal_hash(signed, "mac", key)


def test_pre_step_copies_on_disk_write_the_same_bytes_and_are_released_after_the_tensor_file(tmp_path):
    from helpers.synthetic import make_capture

    from tensorizer_manifest.live_model.layers import PreStepCopies, TensorSlot
    from tensorizer_manifest.save.write import write_checkpoint
    from tensorizer_manifest.storage.spill import SpillFile

    write_checkpoint(make_capture(seed=3), tmp_path / "memory", "model")
    spilled = make_capture(seed=3)
    spilled.spill = SpillFile(tmp_path)
    copies = PreStepCopies(spilled.spill)
    for layer in spilled.layers:  # every layer's tensors on disk, as the capture keeps raw layers'
        for name, slot in layer.tensors.items():
            stand_in, stored = copies.keep(slot.tensor)
            layer.tensors[name] = TensorSlot(stand_in, slot.kind, slot.persistent, slot.identity, stored)
    assert spilled.spill.count > 0
    write_checkpoint(spilled, tmp_path / "disk", "model", release=True)
    assert spilled.spill.closed
    names = sorted(p.name for p in (tmp_path / "memory").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "disk").iterdir())
    for name in names:
        assert filecmp.cmp(tmp_path / "memory" / name, tmp_path / "disk" / name, shallow=False), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "memory"]  # the spill file had no name


def test_an_encrypted_save_records_it_seals_with_the_key_and_names_each_write_apart(tmp_path):
    from helpers.synthetic import make_capture

    from tensorizer_manifest.format.schema import ENCRYPTION_TENSORIZER, EncryptionKey, SigningKey, seal_hash
    from tensorizer_manifest.progress import ProgressUpdate
    from tensorizer_manifest.save.write import write_checkpoint

    key = EncryptionKey(b"e" * 32)
    updates: list[ProgressUpdate] = []
    first = write_checkpoint(make_capture(), tmp_path / "a", "model", encryption_key=key, progress=updates.append)
    assert first.tensor_file.encryption == ENCRYPTION_TENSORIZER
    assert first.seal.mode == "mac-encryption-key"
    assert first.seal.hash == seal_hash(first, "mac-encryption-key", encryption_key=key)
    assert [u.tensors for u in updates] == list(range(1, first.tensor_file.tensor_count + 1))
    stored = sum(r.nbytes for _, r in first.ordered_records() if r.key is not None)
    assert updates[-1] == ProgressUpdate(first.tensor_file.tensor_count, stored, first.tensor_file.tensor_count, stored)
    # fresh nonces: a second save of the same model is another file, so it never replaces the one a manifest names
    second = write_checkpoint(make_capture(), tmp_path / "a", "model", encryption_key=key)
    assert second.tensor_file.path != first.tensor_file.path
    assert [p.name for p in (tmp_path / "a").glob("*.tensors")] == [second.tensor_file.path]
    signed = write_checkpoint(
        make_capture(), tmp_path / "b", "model", signing_key=SigningKey(b"s" * 32), encryption_key=key
    )
    assert signed.seal.mode == "mac" and signed.tensor_file.encryption == ENCRYPTION_TENSORIZER
    plain = write_checkpoint(make_capture(), tmp_path / "c", "model")
    assert plain.tensor_file.encryption == "none" and "-" not in plain.tensor_file.path


def test_an_added_form_gets_its_own_tensor_file_and_the_whole_checkpoint_validates(tmp_path):
    from helpers.synthetic import experts_form_capture, write_synthetic_checkpoint

    from tensorizer_manifest.save.write import write_added_form

    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    before = read_manifest(checkpoint / "model.manifest.json")
    manifest = write_added_form(experts_form_capture(), checkpoint, "model", before)
    (form,) = manifest.added_forms
    assert form.tensor_file.path != before.tensor_file.path and (checkpoint / form.tensor_file.path).is_file()
    assert [m.path for m in form.modules] == ["model.layers.0.mlp.experts"] and form.modules[0].form["isa"] == "amx"
    assert manifest.tensor_file == before.tensor_file and manifest.modules == before.modules
    report = validate_checkpoint(checkpoint)
    assert report.ok, report.problems
    assert report.hashes_checked == report.stored == before.tensor_file.tensor_count + 1
    assert read_manifest(checkpoint / "model.manifest.json") == manifest


def test_an_interrupted_add_form_leaves_the_checkpoint_as_it_was(tmp_path, monkeypatch):
    from helpers.synthetic import experts_form_capture, write_synthetic_checkpoint

    from tensorizer_manifest.save import write

    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    manifest_bytes = (checkpoint / "model.manifest.json").read_bytes()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before the manifest was renamed into place")

    monkeypatch.setattr(write, "_write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        write.write_added_form(experts_form_capture(), checkpoint, "model", read_manifest(checkpoint))
    assert (checkpoint / "model.manifest.json").read_bytes() == manifest_bytes
    assert validate_checkpoint(checkpoint).ok  # the new tensor file, if any, is named by no manifest


def test_damaged_bytes_of_an_added_form_are_caught_by_their_content_hash(tmp_path):
    from helpers.synthetic import experts_form_capture, write_synthetic_checkpoint

    from tensorizer_manifest.save.write import write_added_form
    from tensorizer_manifest.storage.tensor_file import read_index

    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    form = write_added_form(experts_form_capture(), checkpoint, "model", read_manifest(checkpoint)).added_forms[0]
    path = checkpoint / form.tensor_file.path
    entry = read_index(path)[form.modules[0].tensors[0].key]
    data = bytearray(path.read_bytes())
    data[entry.data_offset + 3] ^= 0x10
    path.write_bytes(bytes(data))
    problems = validate_checkpoint(checkpoint).problems
    assert len(problems) == 1 and form.tensor_file.path in problems[0].where and "content hash" in problems[0].message


def test_a_file_system_without_locks_is_a_typed_refusal_and_nothing_is_committed(tmp_path, monkeypatch):
    import errno

    from helpers.synthetic import experts_form_capture, write_synthetic_checkpoint

    from tensorizer_manifest.errors import ConfigurationError
    from tensorizer_manifest.save import write
    from tensorizer_manifest.storage import files

    checkpoint = write_synthetic_checkpoint(tmp_path / "c", fallbacks=True)
    manifest_bytes = (checkpoint / MANIFEST).read_bytes()

    def no_locks(fd, operation):  # what flock answers on a mount without locks (some FUSE and SMB mounts)
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(files.fcntl, "flock", no_locks)
    with pytest.raises(ConfigurationError, match="cannot lock files") as refused:
        write.write_added_form(experts_form_capture(), checkpoint, "model", read_manifest(checkpoint))
    assert str(checkpoint) in str(refused.value)
    assert (checkpoint / MANIFEST).read_bytes() == manifest_bytes


def test_with_a_base_the_form_set_stores_only_what_vllms_step_changed():
    """A layer whose tensors are as vLLM's weight loaders left them, each a parameter they filled on this rank,
    is left to the base: recorded (form, content hash), not stored. Anything else is stored: a buffer (the
    loaders never fill one), an alias, a form the step made, a parameter they did not fill. A raw fallback made
    by the loaders is the base's too. The records then pass the manifest's checks only beside a base."""
    from helpers.synthetic import make_capture

    from tensorizer_manifest.checks.records import check_manifest
    from tensorizer_manifest.format.schema import fed_from_base, held_by_base
    from tensorizer_manifest.save.write import build_manifest

    capture = make_capture(fallbacks=True)
    for layer in capture.layers:  # the restorer's layers made runtime state only, but the experts' own form
        layer.as_loaded = layer.path != "model.layers.0.mlp.experts"
    filled = {
        "model.embed_tokens": ["weight"],
        "model.layers.0.mlp.down_proj": ["weight", "weight_scale"],
        "model.norm": ["weight"],
        "lm_head": ["weight"],
        "model.layers.0.mlp.experts": ["w13_weight"],
    }
    capture.base_fills = filled
    manifest, to_store = build_manifest(capture, "model.0123456789abcdef.tensors", beside_a_base=True)
    layers = manifest.module_map()
    fed = {path for path, record in layers.items() if fed_from_base(record.tensors)}
    assert fed == {"model.embed_tokens"}  # down_proj and norm hold a buffer; lm_head is embed's alias
    assert fed_from_base(layers["model.layers.0.mlp.experts"].fallback)
    assert not fed_from_base(layers["model.layers.0.mlp.experts"].tensors)
    stored = {key for key, _ in to_store}
    assert "model.embed_tokens.weight" not in stored and not any(key.startswith("fallback:") for key in stored)
    assert {
        "model.layers.0.mlp.down_proj.weight",
        "model.norm.weight",
        "model.layers.0.mlp.experts.w13_weight",
    } <= stored
    assert manifest.tensor_file.tensor_count == len(to_store)
    embed = layers["model.embed_tokens"].tensors[0]
    assert held_by_base(embed) and embed.nbytes and embed.hash.startswith("blake3:")

    assert check_manifest(manifest, "m", check_the_seal=False, base_available=True)[0] == []
    (problem, *_), _ = check_manifest(manifest, "m", check_the_seal=False)
    assert f"'model.embed_tokens.weight' has {64 * 32 * 2} bytes but no tensor file key" in problem.message  # bf16
    assert "in a checkpoint without one" in problem.message

    capture.base_fills = {**filled, "model.embed_tokens": []}  # a parameter the loaders did not fill: stored
    manifest, _ = build_manifest(capture, "model.0123456789abcdef.tensors", beside_a_base=True)
    assert not fed_from_base(manifest.module_map()["model.embed_tokens"].tensors)
    capture.base_fills = filled  # written where no base goes (format version 2): everything stored, as before
    manifest, to_store = build_manifest(capture, "model.0123456789abcdef.tensors")
    assert not any(fed_from_base(m.tensors) or fed_from_base(m.fallback) for m in manifest.modules)


def test_a_layer_with_some_tensors_in_the_base_and_some_not_is_refused():
    import msgspec
    from helpers.synthetic import make_capture

    from tensorizer_manifest.checks.records import check_manifest
    from tensorizer_manifest.save.write import build_manifest

    capture = make_capture()
    capture.base_fills = {"model.layers.0.mlp.down_proj": ["weight", "weight_scale"]}
    capture.layers[1].as_loaded = True
    del capture.layers[1].module._buffers["empty"]  # now all its tensors are parameters the loaders filled
    capture.layers[1].tensors.pop("empty")
    manifest, _ = build_manifest(capture, "model.0123456789abcdef.tensors", beside_a_base=True)
    layer = manifest.modules[1]
    assert layer.path == "model.layers.0.mlp.down_proj" and all(t.key is None for t in layer.tensors)
    half = [msgspec.structs.replace(layer.tensors[0], key="model.layers.0.mlp.down_proj.weight"), layer.tensors[1]]
    edited = msgspec.structs.replace(
        manifest, modules=[*manifest.modules[:1], msgspec.structs.replace(layer, tensors=half), *manifest.modules[2:]]
    )
    messages = [p.message for p in check_manifest(edited, "m", check_the_seal=False, base_available=True)[0]]
    assert any("some of its tensors are in the base, some not" in m for m in messages), messages
