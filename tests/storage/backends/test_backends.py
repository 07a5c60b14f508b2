"""Every storage backend passes one suite: a local directory, an S3 prefix (moto's S3 server on 127.0.0.1) and an
HTTP server (read-only: each write refused, typed). Whole and ranged reads, listing with the storage's clock,
create-once refusing an existing object, the pointer's compare-and-swap (two writers, one wins, the other gets
``ConcurrentWriteError``), and the commit protocol of format version 3 (``generations.CheckpointStore``) through
each. A new backend is one more case of ``backend``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tensorizer_manifest.errors import CheckpointNotFoundError, ConcurrentWriteError, ConfigurationError
from tensorizer_manifest.format import generation as g
from tensorizer_manifest.storage.backends import (
    Backend,
    HttpReadOnlyBackend,
    LocalBackend,
    S3Backend,
    backend_for,
)
from tensorizer_manifest.storage.generations import CheckpointStore, LocalCheckpoint
from tensorizer_manifest.storage.remote import RemoteDir

BACKENDS = ["local", "s3", "http"]


@dataclass
class Case:
    """A backend under test, and a way to put an object there by the side (over HTTP nothing writes)."""

    name: str
    backend: Backend
    seed: Callable[[str, bytes], None]

    @property
    def writable(self) -> bool:
        return self.name != "http"


def _seed_file(root: Path) -> Callable[[str, bytes], None]:
    def seed(key: str, data: bytes) -> None:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)

    return seed


@pytest.fixture(params=BACKENDS)
def case(request, tmp_path) -> Iterator[Case]:
    if request.param == "local":
        yield Case("local", LocalBackend(tmp_path / "ckpt"), _seed_file(tmp_path / "ckpt"))
    elif request.param == "s3":
        from helpers.remote import fresh_prefix, options_for
        from helpers.servers import BUCKET

        server = request.getfixturevalue("moto_s3")
        root = RemoteDir(fresh_prefix("backends"), options_for(server))
        client = server.client()
        top = root.uri.removeprefix(f"s3://{BUCKET}/")
        yield Case(
            "s3", S3Backend(root), lambda key, data: client.put_object(Bucket=BUCKET, Key=f"{top}/{key}", Body=data)
        )
    else:
        from helpers.servers import RangeHTTPServer

        served = tmp_path / "served"
        served.mkdir()
        with RangeHTTPServer(served) as server:
            yield Case("http", HttpReadOnlyBackend(RemoteDir(server.url)), _seed_file(served))


def test_backend_for_picks_one_per_kind_of_location(tmp_path):
    assert isinstance(backend_for(tmp_path), LocalBackend)
    assert isinstance(backend_for(RemoteDir("s3://bucket/prefix")), S3Backend)
    assert isinstance(backend_for(RemoteDir("https://host/prefix")), HttpReadOnlyBackend)
    for backend in (
        LocalBackend(tmp_path),
        S3Backend(RemoteDir("s3://b/p")),
        HttpReadOnlyBackend(RemoteDir("http://h/p")),
    ):
        assert isinstance(backend, Backend)


# --- reading ---------------------------------------------------------------------------------------------------


def test_a_small_object_is_read_whole_with_its_version_and_a_missing_one_is_none(case):
    case.seed("generations/x/doc.json", b'{"a": 1}')
    assert case.backend.read("generations/x/doc.json") == b'{"a": 1}'
    data, version = case.backend.read_versioned("generations/x/doc.json")
    assert data == b'{"a": 1}' and isinstance(version, str) and version
    assert case.backend.read("generations/x/none.json") is None
    assert case.backend.read_versioned("none.json") is None


def test_ranged_reads_size_and_existence(case):
    payload = bytes(range(256)) * 8
    case.seed("model.tensors", payload)
    assert case.backend.size("model.tensors") == len(payload)
    assert case.backend.read_range("model.tensors", 10, 300) == payload[10:300]
    assert case.backend.read_range("model.tensors", 0, len(payload)) == payload
    assert case.backend.exists("model.tensors") and not case.backend.exists("other.tensors")
    with pytest.raises(CheckpointNotFoundError):  # the remote kind is one too
        case.backend.size("other.tensors")


def test_listing_below_a_prefix_and_at_the_top_with_the_storage_s_clock(case):
    for key in ("config.json", "generations/a/doc.json", "generations/a/rank/m.json", "generations/b/doc.json"):
        case.seed(key, b"x")
    if not case.writable:
        with pytest.raises(ConfigurationError, match="cannot be listed"):
            case.backend.files("generations")
        with pytest.raises(ConfigurationError, match="cannot be listed"):
            case.backend.names()
        return
    listed = case.backend.files("generations")
    assert [key for key, _ in listed] == [
        "generations/a/doc.json",
        "generations/a/rank/m.json",
        "generations/b/doc.json",
    ]
    now = case.backend.clock()
    assert all(now - 120 < written <= now + 1 for _, written in listed)
    assert case.backend.modified("config.json") == pytest.approx(dict(case.backend.files(""))["config.json"], abs=1)
    assert case.backend.modified("none.json") is None
    assert case.backend.names() == ["config.json"]
    assert case.backend.names("generations/a") == ["doc.json"]
    assert case.backend.files("nothing-here") == []


# --- writing ---------------------------------------------------------------------------------------------------


def test_create_once_refuses_an_existing_object(case):
    if not case.writable:
        with pytest.raises(ConfigurationError, match="http\\(s\\) is read-only"):
            case.backend.create("generations/x/doc.json", b"one")
        return
    assert case.backend.create("generations/x/doc.json", b"one")
    assert not case.backend.create("generations/x/doc.json", b"two")
    assert case.backend.read("generations/x/doc.json") == b"one"


def test_the_pointer_swap_is_a_compare_and_swap(case):
    """Two writers read one version; the first swap wins, the second finds another version and writes nothing. A
    swap with no version creates only; a swap tried again after it landed (its answer lost) is done."""
    if not case.writable:
        with pytest.raises(ConfigurationError, match="http\\(s\\) is read-only"):
            case.backend.swap("pointer.json", b"first", None, lambda: None)
        return
    backend = case.backend
    assert backend.swap("pointer.json", b"first", None, lambda: None)
    assert not backend.swap("pointer.json", b"other", None, lambda: None)  # there is one now
    _, read_by_a = backend.read_versioned("pointer.json")
    _, read_by_b = backend.read_versioned("pointer.json")
    assert backend.swap("pointer.json", b"from a", read_by_a, lambda: None)
    assert not backend.swap("pointer.json", b"from b", read_by_b, lambda: None)
    assert backend.read("pointer.json") == b"from a"
    assert backend.swap("pointer.json", b"from a", read_by_a, lambda: None)  # a's try again: it landed


def test_a_failed_check_stops_the_swap(case):
    if not case.writable:
        return
    case.backend.swap("pointer.json", b"first", None, lambda: None)
    _, version = case.backend.read_versioned("pointer.json")

    def check() -> None:
        raise CheckpointNotFoundError("a file the new version names is gone")

    with pytest.raises(CheckpointNotFoundError, match="is gone"):
        case.backend.swap("pointer.json", b"second", version, check)
    assert case.backend.read("pointer.json") == b"first"


def test_replace_upload_and_delete(case, tmp_path):
    source = tmp_path / "large.tensors"
    source.write_bytes(b"t" * 4096)
    if not case.writable:
        for write in (lambda: case.backend.replace("config.json", b"{}"), lambda: case.backend.upload("a", source)):
            with pytest.raises(ConfigurationError, match="http\\(s\\) is read-only"):
                write()
        with pytest.raises(ConfigurationError, match="only s3:// objects can be removed"):
            case.backend.delete("config.json")
        return
    backend = case.backend
    backend.replace("config.json", b"{}")
    backend.replace("config.json", b'{"b": 2}')
    assert backend.read("config.json") == b'{"b": 2}'
    backend.upload("generations/x/model.tensors", source)
    assert backend.size("generations/x/model.tensors") == 4096
    backend.delete("config.json")
    backend.delete("config.json")  # gone already: no error
    assert backend.read("config.json") is None


# --- the commit protocol, through each backend --------------------------------------------------------------


def _generation(store: CheckpointStore, parent: str | None, payload: bytes) -> g.Generation:
    gid = g.new_generation_id()
    own = store.put(f"{g.generation_dir(gid)}/config.json", payload)
    files = [g.ModelFile(name="config.json", file=own)]
    return g.seal_generation(
        g.Generation(format_version=3, id=gid, parent=parent, producer="test", made_by="save", model_files=files)
    )


def test_two_writers_commit_over_one_generation_one_wins_the_other_is_refused(case, tmp_path):
    if not case.writable:  # a checkpoint written elsewhere reads the same over HTTP; writing it is refused
        local = LocalCheckpoint(tmp_path / "elsewhere")
        first = local.commit(_generation(local, None, b"first")).generation
        for key, _ in LocalBackend(local.root).files(""):
            case.seed(key, (local.root / key).read_bytes())
        remote = CheckpointStore(case.backend)
        assert remote.current_generation_id() == first and remote.current() == local.current()
        with pytest.raises(ConfigurationError, match="read-only"):
            remote.put(f"{g.generation_dir(g.new_generation_id())}/config.json", b"x")
        with pytest.raises(ConfigurationError):
            remote.plan_gc()
        return
    a, b = CheckpointStore(case.backend), CheckpointStore(case.backend)
    first = a.commit(_generation(a, None, b"first")).generation
    assert b.current_generation_id() == first
    from_a, from_b = _generation(a, first, b"a"), _generation(b, first, b"b")
    a.commit(from_a)
    with pytest.raises(ConcurrentWriteError, match=f"another writer committed generation {from_a.id}"):
        b.commit(from_b)
    assert CheckpointStore(case.backend).current() == from_a
    a.commit(from_a)  # a try again of a commit that landed: done, not refused


def test_gc_through_the_backend_removes_a_retired_generation_and_a_stale_orphan(case):
    if not case.writable:
        return
    store = CheckpointStore(case.backend)
    first = store.commit(_generation(store, None, b"first")).generation
    orphan = _generation(store, first, b"never committed")
    second = store.commit(_generation(store, first, b"second")).generation
    plan = store.plan_gc(grace_s=0, orphan_grace_s=0, now=store.clock() + 1)
    assert plan.kept_generations == [second]
    assert f"{g.generation_dir(orphan.id)}/config.json" in plan.delete
    store.gc(plan)
    left = {key.split("/")[1] for key, _ in case.backend.files(g.GENERATIONS_DIR)}
    assert left == {second}
    assert store.current().id == second


def test_the_top_level_is_refreshed_from_the_current_generation(case):
    if not case.writable:
        return
    store = CheckpointStore(case.backend)
    case.backend.replace("tokenizer.json", b"an older save's")
    store.commit(_generation(store, None, b'{"model_type": "llama"}'))
    store.refresh_top_level()
    assert case.backend.read("config.json") == b'{"model_type": "llama"}'
    assert case.backend.read("tokenizer.json") is None  # vLLM would read it; this generation has none


def test_a_local_generation_is_published_to_each_backend_over_the_one_current_there(case, tmp_path):
    """``remote_checkpoint.publish``: what every writer to S3 does, through any backend; a second save's generation
    goes over the first there, sealed again with its parent there."""
    from tensorizer_manifest.storage.remote_checkpoint import publish

    staged = []
    for k in range(2):
        local = LocalCheckpoint(tmp_path / f"staging-{k}")
        staged.append((local.root, local.commit(_generation(local, None, b'{"k": %d}' % k)).generation))
    store = CheckpointStore(case.backend)
    if not case.writable:
        with pytest.raises(ConfigurationError, match="read-only"):
            publish(staged[0][0], store)
        return
    first = publish(staged[0][0], store)
    second = publish(staged[1][0], store)
    assert (first.id, second.id, second.parent) == (staged[0][1], staged[1][1], first.id)
    assert CheckpointStore(case.backend).current() == second
    assert case.backend.read("config.json") == b'{"k": 1}'
