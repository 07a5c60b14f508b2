"""Faults while a fleet loads from one S3 bucket: moto's S3 server behind a fault-injecting proxy
(``helpers.servers.FaultProxy``), each fault with the typed error a reader gets and a clean reader of
the same bucket beside it that gets the right bytes.

- a server that stops mid-stream for one reader: ``RemoteUnreachableError`` for it, naming the URI;
- a connection cut mid-stream (the server still up): ``RemoteStorageError`` (cut short), never resumed;
- throttling (``503 SlowDown``, a plain 503): retried with backoff within ``remote.failures.RETRY_*``, then
  ``RemoteThrottledError`` naming the URI and what to do, in bounded time;
- an object replaced while it is read: ``If-Match`` with the first ETag makes every later request of
  the load a 412, so ``RemoteChangedError`` at once; another version's bytes inside one response (a
  broken cache) are caught by the content hashes (``IntegrityError``). Never a half-loaded model;
- a server that stops answering without closing the connection (before its answer, after its headers,
  mid-stream, a parallel reader's range, a HEAD or a listing): ``RemoteStalledError`` naming the URI once
  the stall timeout has passed with no byte, never a hang.

No credential appears in an error or a log line. Readers are told apart by the access key id they sign
with (moto accepts any), which the proxy records with the bytes it sent each of them.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch
from helpers.servers import BUCKET, Fault, FaultProxy, StallServer
from helpers.synthetic import fresh_synthetic_model, write_synthetic_checkpoint

from tensorizer_manifest._constants import STALL_TIMEOUT_ENV
from tensorizer_manifest.checks.validate import open_checked, validate_checkpoint
from tensorizer_manifest.errors import (
    IntegrityError,
    RemoteChangedError,
    RemoteStalledError,
    RemoteStorageError,
    RemoteThrottledError,
    RemoteUnreachableError,
)
from tensorizer_manifest.format.generation import POINTER_NAME
from tensorizer_manifest.load.restore import restore_tensors
from tensorizer_manifest.storage import tensor_file
from tensorizer_manifest.storage.checkpoint import load_manifest
from tensorizer_manifest.storage.remote import RemoteDir, RemoteFile, RemoteOptions, failures, objects
from tensorizer_manifest.storage.remote_checkpoint import upload_checkpoint
from tensorizer_manifest.storage.tensor_file import TensorFileReader, read_index

SECRET = "fleet-secret-never-shown-0a1b2c3d4e5f"


def reader_options(endpoint: str, n: int) -> RemoteOptions:
    """Reader ``n`` of a fleet: its own access key id (so the proxy tells readers apart), one secret."""
    return RemoteOptions(f"AKIAFLEETREADER{n:05d}", SECRET, endpoint)


def key_id(n: int) -> str:
    return f"AKIAFLEETREADER{n:05d}"


def load(uri: str, options: RemoteOptions, num_readers: int = 1) -> dict[str, torch.Tensor]:
    """What the loader does, without vLLM: manifest, every check, then the tensors with their hashes."""
    manifest, manifest_path = load_manifest(uri, remote=options)
    model = fresh_synthetic_model()
    with open_checked(manifest, manifest_path, num_readers=num_readers) as reader:
        restore_tensors(model, manifest, reader)
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_clean_message(exc: BaseException, uri: str, options: RemoteOptions) -> None:
    text = str(exc)
    assert uri in text, text
    for secret in (*options.secrets(), SECRET):
        assert secret not in text, text
    assert "X-Amz-" not in text and "Signature" not in text, text  # no presigned URL either


@pytest.fixture(scope="module")
def saved(tmp_path_factory, moto_s3):
    """A synthetic checkpoint written locally and uploaded straight to moto; its expected state."""
    local = write_synthetic_checkpoint(tmp_path_factory.mktemp("faults") / "ckpt", scale=64)
    uri = f"s3://{BUCKET}/faults-{uuid.uuid4().hex[:8]}"
    upload_checkpoint(local, uri, RemoteOptions(moto_s3.key_id, moto_s3.secret, moto_s3.endpoint))
    manifest, _ = load_manifest(local)
    tensors = local / manifest.tensor_file.path
    state = load(uri, RemoteOptions(moto_s3.key_id, moto_s3.secret, moto_s3.endpoint))
    return {"local": local, "uri": uri, "name": tensors.name, "tensors": tensors, "manifest": manifest, "state": state}


@pytest.fixture
def fast_retries(monkeypatch):
    """Waits of tenths of seconds, so the tests that exhaust the attempts stay quick (the total time is
    generous: a busy machine's slow answers must not end the retries before the attempts do)."""
    monkeypatch.setattr(failures, "RETRY_ATTEMPTS", 4)
    monkeypatch.setattr(failures, "RETRY_BASE_DELAY_S", 0.05)
    monkeypatch.setattr(failures, "RETRY_MAX_DELAY_S", 0.2)
    monkeypatch.setattr(failures, "RETRY_TOTAL_S", 20.0)


@pytest.fixture
def proxy(moto_s3):
    with FaultProxy(moto_s3) as p:
        yield p


def data_offset(saved) -> int:
    """Where the tensor data of the checkpoint's largest tensor starts, and a point in the middle of it."""
    index = read_index(saved["tensors"])
    entry = max(index.values(), key=lambda e: e.data_length)
    return entry.data_offset + entry.data_length // 2


def non_data(saved) -> int:
    """Bytes of the tensor file that are not tensor data: tensorizer's header, index and tensor headers."""
    return saved["tensors"].stat().st_size - sum(e.data_length for e in read_index(saved["tensors"]).values())


def other_version(saved) -> bytes:
    """The tensor file with one tensor's data changed: same size, header and index (what a broken
    re-upload or an overwrite in place looks like); only the content hashes can tell."""
    index = read_index(saved["tensors"])
    entry = max(index.values(), key=lambda e: e.data_length)
    data = bytearray(saved["tensors"].read_bytes())
    for i in range(entry.data_offset, entry.data_offset + entry.data_length, 97):
        data[i] ^= 0x5A
    return bytes(data)


def replace_object(moto_s3, key: str, data: bytes) -> None:
    moto_s3.client().put_object(Bucket=BUCKET, Key=key, Body=data)


def tensor_key(saved) -> str:
    return f"{saved['uri'].removeprefix(f's3://{BUCKET}/')}/{saved['name']}"


# -- a clean fleet through the proxy: the accounting the fault tests rely on --------------------------------------


@pytest.mark.parametrize("least_read_through", [1 << 20, 0], ids=["default", "no-least-budget"])
def test_a_clean_fleet_reads_each_tensor_file_once_per_reader(saved, proxy, monkeypatch, least_read_through):
    """Three readers at once, each one full read of the tensor file plus the checks' reads of its non-data bytes.
    This file is smaller than the least read-through budget (the checks then read it whole); without that
    floor they read its non-data bytes and 1% of it."""
    monkeypatch.setattr(tensor_file, "_READ_THROUGH_MIN", least_read_through)
    size = saved["tensors"].stat().st_size
    with ThreadPoolExecutor(3) as pool:
        states = list(pool.map(lambda n: load(saved["uri"], reader_options(proxy.url, n)), range(3)))
    assert all(same_state(s, saved["state"]) for s in states)
    for n in range(3):
        streams = [r for r in proxy.matching("GET", saved["name"], key_id(n)) if r.range is None]
        assert [r.sent for r in streams] == [size]  # one full read of the tensor file each
        # The checks' ranged reads come on top: each non-data byte once, and short tensor data read through to
        # save requests (at most 1% of the file, or 1 MiB).
        checks = proxy.fetched(saved["name"], key_id(n)) - size
        assert non_data(saved) <= checks <= non_data(saved) + max(least_read_through, size // 100), (checks, size)
        assert proxy.fetched(saved["name"], key_id(n)) == proxy.fetched(saved["name"], key_id(0))
    assert proxy.fetched(client=None) == sum(proxy.fetched(client=key_id(n)) for n in range(3))


# -- the server stops, a connection is cut ------------------------------------------------------------------------


def load_tensors(uri: str, options: RemoteOptions, num_readers: int) -> dict[str, torch.Tensor]:
    """Only the stream (no checks after it opens): the tensor file's tensors, as ``TensorFileReader`` reads them."""
    manifest, _ = load_manifest(uri, remote=options)
    with TensorFileReader(RemoteDir(uri, options) / manifest.tensor_file.path, num_readers=num_readers) as reader:
        return {key: tensor.clone() for key, tensor in reader.stream()}


@pytest.mark.parametrize(
    "how, num_readers", [("load", 1), ("stream", 1), ("stream", 2)], ids=["load", "stream", "stream-2-readers"]
)
def test_a_server_that_stops_mid_stream_is_unreachable_for_its_reader_only(saved, moto_s3, how, num_readers, caplog):
    """Reader 0's server (a proxy of its own) stops halfway through the tensor data; reader 1, on another
    server of the same bucket, reads at the same time and gets every byte right. The loader meets the
    stopped server at its next request (the checks after the stream opens); the stream alone meets it
    mid-read (curl's exit code, then a probe of the endpoint), or at a parallel reader's opening."""
    caplog.set_level(logging.DEBUG, logger="tensorizer_manifest")
    cut = data_offset(saved)
    read = load if how == "load" else load_tensors
    with FaultProxy(moto_s3) as dying, FaultProxy(moto_s3) as healthy:
        dying.add(Fault(path=saved["name"], ranged=False, stop_after=cut))
        start = threading.Barrier(2)

        def run(n: int, endpoint: str):
            start.wait()
            return read(saved["uri"], reader_options(endpoint, n), num_readers=num_readers)

        with ThreadPoolExecutor(2) as pool:
            failing = pool.submit(run, 0, dying.url)
            clean = pool.submit(run, 1, healthy.url)
            with pytest.raises(RemoteUnreachableError) as exc:
                failing.result(timeout=60)
            expected = (
                saved["state"] if how == "load" else load_tensors(saved["uri"], reader_options(healthy.url, 2), 1)
            )
            assert same_state(clean.result(timeout=60), expected)
        assert_clean_message(exc.value, f"{saved['uri']}/{saved['name']}", reader_options(dying.url, 0))
        assert "cannot be reached" in str(exc.value)
        [stopped] = [r for r in dying.requests if r.fault and r.fault.startswith("stopped")]
        assert stopped.sent == cut
        assert [r.sent for r in healthy.matching("GET", saved["name"], key_id(1)) if r.range is None] == [
            saved["tensors"].stat().st_size
        ]
    assert SECRET not in caplog.text and key_id(0) not in caplog.text


def test_a_connection_cut_mid_stream_fails_that_reader_and_is_not_resumed(saved, proxy, caplog):
    """The server stays up and cuts one reader's stream; the reader next to it, through the same proxy,
    is untouched. The cut stream is never re-opened to fetch the rest."""
    caplog.set_level(logging.DEBUG, logger="tensorizer_manifest")
    proxy.add(Fault(path=saved["name"], client=key_id(0), ranged=False, cut_after=data_offset(saved)))
    start = threading.Barrier(2)

    def read(n: int):
        start.wait()
        return load(saved["uri"], reader_options(proxy.url, n))

    with ThreadPoolExecutor(2) as pool:
        failing, clean = pool.submit(read, 0), pool.submit(read, 1)
        with pytest.raises(RemoteStorageError) as exc:
            failing.result(timeout=60)
        assert same_state(clean.result(timeout=60), saved["state"])
    assert not isinstance(exc.value, RemoteUnreachableError)  # the server is still there
    assert "cut short" in str(exc.value) or "closed the connection" in str(exc.value)
    assert_clean_message(exc.value, f"{saved['uri']}/{saved['name']}", reader_options(proxy.url, 0))
    streams = [r for r in proxy.matching("GET", saved["name"], key_id(0)) if r.range is None]
    assert len(streams) == 1 and streams[0].sent == data_offset(saved)  # not resumed, not re-read
    assert len([r for r in proxy.matching("GET", saved["name"], key_id(1)) if r.range is None]) == 1
    assert SECRET not in caplog.text


def test_a_ranged_read_cut_short_is_a_typed_error(saved, proxy):
    f = RemoteDir(saved["uri"], reader_options(proxy.url, 0)) / saved["name"]
    proxy.add(Fault(path=saved["name"], ranged=True, cut_after=1000))
    with pytest.raises(RemoteStorageError, match="cut short|ended .* early|closed the connection") as exc:
        b"".join(f.read_range(0, 5000))
    assert_clean_message(exc.value, str(f), f.options)
    assert len(proxy.matching("GET", saved["name"])) == 1  # a cut is never retried


# -- throttling ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", ["SlowDown", None], ids=["slowdown", "plain-503"])
def test_throttling_is_retried_and_the_load_succeeds(saved, proxy, fast_retries, code, caplog):
    """The first two HEADs and the first two GETs of the tensor file's stream are 503s; the load retries
    them (and only them) and gets every byte right; another reader through the proxy is not slowed."""
    caplog.set_level(logging.WARNING, logger="tensorizer_manifest.storage.remote")
    proxy.add(Fault(method="HEAD", path=saved["name"], client=key_id(0), status=503, code=code, times=2))
    proxy.add(Fault(method="GET", path=saved["name"], client=key_id(0), ranged=False, status=503, code=code, times=2))
    with ThreadPoolExecutor(2) as pool:
        states = list(pool.map(lambda n: load(saved["uri"], reader_options(proxy.url, n)), range(2)))
    assert all(same_state(s, saved["state"]) for s in states)
    streams = [r for r in proxy.matching("GET", saved["name"], key_id(0)) if r.range is None]
    assert [r.status for r in streams] == [503, 503, 200]
    assert [r.status for r in proxy.matching("HEAD", saved["name"], key_id(0))][:3] == [503, 503, 200]
    clean = proxy.matching(client=key_id(1))
    # Its one 404: the look for a format-3 pointer, which a format-2 checkpoint does not have.
    assert [r.status for r in clean if POINTER_NAME in r.path] == [404]
    assert all(r.status in (200, 206) for r in clean if POINTER_NAME not in r.path)
    assert "retrying" in caplog.text and saved["name"] in caplog.text
    assert SECRET not in caplog.text and key_id(0) not in caplog.text


@pytest.mark.parametrize("method", ["HEAD", "GET"])
def test_throttling_that_does_not_stop_is_a_typed_error_in_bounded_time(saved, proxy, fast_retries, method, caplog):
    caplog.set_level(logging.DEBUG, logger="tensorizer_manifest")
    options = reader_options(proxy.url, 0)
    f = RemoteDir(saved["uri"], options) / saved["name"]
    proxy.add(Fault(method=method, path=saved["name"], status=503, code="SlowDown", times=10_000))
    began = time.monotonic()
    with pytest.raises(RemoteThrottledError) as exc:
        f.size() if method == "HEAD" else f.open().close()
    elapsed = time.monotonic() - began
    assert elapsed <= 0.05 + 0.1 + 0.2 + 5, elapsed  # three short waits, four quick 503s, a client made
    assert len(proxy.matching(method, saved["name"])) == failures.RETRY_ATTEMPTS
    text = str(exc.value)
    assert_clean_message(exc.value, str(f), options)
    assert "throttling" in text and "request rate" in text and f"{failures.RETRY_ATTEMPTS} attempts" in text
    assert SECRET not in caplog.text and key_id(0) not in caplog.text


def test_the_total_retry_time_bounds_the_attempts(saved, proxy, monkeypatch):
    monkeypatch.setattr(failures, "RETRY_ATTEMPTS", 100)
    monkeypatch.setattr(failures, "RETRY_BASE_DELAY_S", 0.2)
    monkeypatch.setattr(failures, "RETRY_MAX_DELAY_S", 0.4)
    monkeypatch.setattr(failures, "RETRY_TOTAL_S", 1.5)
    f = RemoteDir(saved["uri"], reader_options(proxy.url, 0)) / saved["name"]
    proxy.add(Fault(method="HEAD", status=503, times=10_000))
    began = time.monotonic()
    with pytest.raises(RemoteThrottledError) as exc:
        f.size()
    # No retry starts after RETRY_TOTAL_S. The attempts (below) show it; the time only rules out the 100 attempts
    # (at least 20 s of waits), with room for a machine busy with other tests (4.7 s seen under three workers).
    assert time.monotonic() - began <= 1.5 + 10.0
    attempts = len(proxy.matching("HEAD"))
    assert 2 <= attempts <= 8 and f"{attempts} attempts" in str(exc.value)  # 1.5 s of 0.1-0.4 s waits, not 100


def test_a_throttled_parallel_reader_is_retried(saved, proxy, fast_retries):
    """tensorizer's second reader opens a ranged request of its own; a 503 there is retried too."""
    manifest, manifest_path = load_manifest(saved["uri"], remote=reader_options(proxy.url, 0))
    with open_checked(manifest, manifest_path, num_readers=2) as reader:
        assert reader.num_readers == 2
        ranged_before = len([r for r in proxy.matching("GET", saved["name"]) if r.range])
        proxy.add(Fault(path=saved["name"], ranged=True, status=503, code="SlowDown", times=2))
        model = fresh_synthetic_model()
        restore_tensors(model, manifest, reader)
    assert same_state({k: v for k, v in model.state_dict().items()}, saved["state"])
    forks = [r for r in proxy.matching("GET", saved["name"]) if r.range][ranged_before:]
    assert [r.status for r in forks][:3] == [503, 503, 206]


# -- the object replaced while it is read -------------------------------------------------------------------------


def test_an_object_replaced_between_the_checks_and_the_stream_is_refused_at_once(saved, proxy, moto_s3):
    """The checks read the pinned version's header; the object is replaced just before the stream opens:
    the stream asks for that version (If-Match), the server answers 412, the load stops there."""
    key = tensor_key(saved)
    original = saved["tensors"].read_bytes()
    proxy.add(
        Fault(path=saved["name"], ranged=False, before=lambda: replace_object(moto_s3, key, other_version(saved)))
    )
    options = reader_options(proxy.url, 0)
    try:
        with pytest.raises(RemoteChangedError) as exc:
            load(saved["uri"], options)
        assert_clean_message(exc.value, f"{saved['uri']}/{saved['name']}", options)
        assert "replaced" in str(exc.value) and "load again" in str(exc.value)
        [stream] = [r for r in proxy.matching("GET", saved["name"]) if r.range is None]
        assert stream.status == 412 and stream.sent < 1000  # no byte of the new version was read
    finally:
        replace_object(moto_s3, key, original)
    assert same_state(load(saved["uri"], options), saved["state"])  # a new load reads the object as it is


def test_an_object_replaced_while_parallel_readers_stream_it_is_refused(saved, proxy, moto_s3):
    """The first stream has opened (old version); the object is replaced; tensorizer's second reader
    opens its range with the same If-Match and gets 412: the read fails, no tensor of two versions."""
    key = tensor_key(saved)
    original = saved["tensors"].read_bytes()
    options = reader_options(proxy.url, 0)
    manifest, manifest_path = load_manifest(saved["uri"], remote=options)
    try:
        with open_checked(manifest, manifest_path, num_readers=2) as reader:
            assert reader.num_readers == 2 and reader.path.etag
            replace_object(moto_s3, key, other_version(saved))
            with pytest.raises(RemoteChangedError) as exc:
                restore_tensors(fresh_synthetic_model(), manifest, reader)
        assert_clean_message(exc.value, f"{saved['uri']}/{saved['name']}", options)
        assert any(r.status == 412 for r in proxy.matching("GET", saved["name"]) if r.range)
    finally:
        replace_object(moto_s3, key, original)


def test_without_conditional_reads_the_hashes_catch_a_replaced_object(saved, proxy, moto_s3, monkeypatch):
    """The same replacement with If-Match off (a server that ignores it, as far as the reader knows): the
    new version's header is the same, its data is not; the content hashes stop the load."""
    monkeypatch.setattr(objects, "CONDITIONAL_READS", False)
    key = tensor_key(saved)
    original = saved["tensors"].read_bytes()
    proxy.add(
        Fault(path=saved["name"], ranged=False, before=lambda: replace_object(moto_s3, key, other_version(saved)))
    )
    try:
        with pytest.raises(IntegrityError, match="content hash of"):
            load(saved["uri"], reader_options(proxy.url, 0))
    finally:
        replace_object(moto_s3, key, original)


def test_a_server_that_switches_versions_inside_one_response_is_caught_by_the_hashes(saved, proxy):
    """A broken cache sends the first bytes of one version and the rest of another, under one ETag: no
    request-level check can see it; the content hashes do, both at load and in ``validate``."""
    swap = Fault(
        path=saved["name"], ranged=False, swap_after=data_offset(saved) - 4096, replacement=other_version(saved)
    )
    proxy.add(swap)
    options = reader_options(proxy.url, 0)
    with pytest.raises(IntegrityError, match="content hash of") as exc:
        load(saved["uri"], options)
    assert SECRET not in str(exc.value)
    assert swap.applied == 1
    swap.times = 100  # validate's streams too (its index, then its hashes)
    report = validate_checkpoint(saved["uri"], remote=options)
    assert not report.ok
    assert any(p.kind is IntegrityError and "content hash" in p.message for p in report.problems), report.problems


def test_a_replaced_object_is_seen_by_a_later_head_of_the_same_read(saved, proxy, moto_s3):
    key = tensor_key(saved)
    original = saved["tensors"].read_bytes()
    f = RemoteDir(saved["uri"], reader_options(proxy.url, 0)) / saved["name"]
    assert f.size() == len(original) and f.etag
    try:
        replace_object(moto_s3, key, other_version(saved))
        with pytest.raises(RemoteChangedError):
            f.size()
        assert f.size() == len(original)  # the error let go of the old version: a new read pins the new one
        assert b"".join(f.read_range(0, 64)) == other_version(saved)[:64]
    finally:
        replace_object(moto_s3, key, original)


def test_the_proxy_leaves_nothing_running(moto_s3):
    before = threading.active_count()
    with FaultProxy(moto_s3) as p:
        url = p.url
        assert RemoteFile(f"s3://{BUCKET}/absent", reader_options(url, 0)).exists() is False
    assert RemoteFile(f"s3://{BUCKET}/absent", reader_options(url, 0))._reachable() is False
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


# -- a server that stops answering without closing the connection -------------------------------------------------

STALL_S = 2.0
#: The stall timeout where the reads go through moto and the fault proxy: a stall there must come from the fault,
#: and on a busy 2-core machine moto (a Python server) and the proxy once took over 2 s to answer the manifest's
#: HEAD (stop 42's CI), a stall before the fault was ever reached.
STALL_THROUGH_MOTO_S = 6.0
#: A stalled read must fail within the stall timeout and this much more: curl averages its speed over the last
#: 5 seconds, so a stream that stops mid-transfer is seen up to about 6 s late; a busy machine is slow to start
#: curl and boto3, and the load's own checks run first.
STALL_SLACK_S = 12.0


def bounded(call, timeout_s: float = STALL_S) -> tuple[BaseException | None, float]:
    """``call()`` in a thread: what it raised (None: nothing) and how long it took; a test failure when it is
    still running after the stall timeout and the slack (the read hangs). Stopping the server then ends it."""
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    began = time.monotonic()
    thread.start()
    thread.join(timeout_s + STALL_SLACK_S)
    assert not thread.is_alive(), f"still reading {timeout_s + STALL_SLACK_S:.0f} s after the server stopped answering"
    return outcome.get("error"), time.monotonic() - began


def assert_stalled(error: BaseException | None, elapsed: float, uri: str, options: RemoteOptions) -> None:
    timeout_s = options.stall_timeout_s or STALL_S  # None: set through the environment, to STALL_S
    assert isinstance(error, RemoteStalledError), repr(error)
    assert timeout_s - 0.5 <= elapsed <= timeout_s + STALL_SLACK_S, elapsed  # the timeout ended it, nothing else
    text = str(error)
    assert_clean_message(error, uri, options)
    assert f"nothing for {timeout_s:g} s" in text and STALL_TIMEOUT_ENV in text and "check the server" in text, text


_HEADERS = b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-99/1000\r\nContent-Length: 100\r\n\r\n"


@pytest.mark.parametrize(
    "headers, set_by",
    [(None, "option"), (None, "environment"), (_HEADERS, "option")],
    ids=["no-answer", "no-answer-env", "headers-then-nothing"],
)
def test_a_ranged_read_from_a_server_that_sends_nothing_is_stalled(headers, set_by, monkeypatch):
    """A server accepts the connection (and maybe answers the headers), then sends nothing and keeps it open:
    the ranged read fails once the stall timeout has passed, naming the URI, and is not retried."""
    if set_by == "environment":
        monkeypatch.setenv(STALL_TIMEOUT_ENV, f"{STALL_S:g}")
    with StallServer(headers) as server:
        options = RemoteOptions(stall_timeout_s=STALL_S if set_by == "option" else None)
        f = RemoteFile(f"{server.url}/ckpt/model.0123456789abcdef.tensors", options)
        error, elapsed = bounded(lambda: b"".join(f.read_range(0, 100)))
        assert_stalled(error, elapsed, str(f), options)
        assert "opening it" in str(error) if headers is None else "reading it" in str(error)
        assert server.accepted == 1


@pytest.mark.parametrize("what", ["head", "listing"])
def test_an_s3_request_to_a_server_that_sends_nothing_is_stalled(what):
    """boto3's HEAD and listing through the same setting (botocore's read timeout)."""
    with StallServer() as server:
        options = RemoteOptions(key_id(0), SECRET, server.url, stall_timeout_s=STALL_S)
        target = RemoteFile(f"s3://{BUCKET}/stall/model.tensors", options) if what == "head" else None
        prefix = RemoteDir(f"s3://{BUCKET}/stall", options)
        error, elapsed = bounded(target.size if target is not None else prefix.list_names)
        assert_stalled(error, elapsed, str(target or prefix), options)
        assert server.accepted == 1


@pytest.mark.parametrize("how", ["load", "stream"])
def test_a_stream_that_stalls_mid_load_is_stalled_for_its_reader_only(saved, proxy, how, caplog):
    """The tensor file's stream stops halfway through the tensor data, its connection open (the server is
    still up); the load fails with ``RemoteStalledError`` within the stall timeout, and the reader next to
    it, through the same proxy, is untouched. The stalled stream is not re-opened."""
    caplog.set_level(logging.DEBUG, logger="tensorizer_manifest")
    proxy.add(Fault(path=saved["name"], client=key_id(0), ranged=False, stall_after=data_offset(saved)))
    stalled = RemoteOptions(key_id(0), SECRET, proxy.url, stall_timeout_s=STALL_THROUGH_MOTO_S)
    read = load if how == "load" else partial(load_tensors, num_readers=1)
    with ThreadPoolExecutor(1) as pool:
        clean = pool.submit(read, saved["uri"], reader_options(proxy.url, 1))
        error, elapsed = bounded(lambda: read(saved["uri"], stalled), STALL_THROUGH_MOTO_S)
        state = clean.result(timeout=60)
    expected = saved["state"] if how == "load" else load_tensors(saved["uri"], reader_options(proxy.url, 2), 1)
    assert same_state(state, expected)
    assert_stalled(error, elapsed, f"{saved['uri']}/{saved['name']}", stalled)
    streams = [r for r in proxy.matching("GET", saved["name"], key_id(0)) if r.range is None]
    assert len(streams) == 1 and streams[0].fault == f"stalled after {data_offset(saved)}"
    assert streams[0].sent == data_offset(saved)
    assert SECRET not in caplog.text and key_id(0) not in caplog.text


def test_a_parallel_reader_whose_range_stalls_is_stalled(saved, proxy):
    """tensorizer's second reader opens a ranged request of its own (a fork of the stream): the server
    answers its headers and nothing more; the load fails with ``RemoteStalledError``, not a hang."""
    options = RemoteOptions(key_id(0), SECRET, proxy.url, stall_timeout_s=STALL_THROUGH_MOTO_S)
    manifest, manifest_path = load_manifest(saved["uri"], remote=options)

    def read() -> None:
        with open_checked(manifest, manifest_path, num_readers=2) as reader:
            assert reader.num_readers == 2
            proxy.add(Fault(path=saved["name"], ranged=True, stall_after=0, times=10))
            restore_tensors(fresh_synthetic_model(), manifest, reader)

    error, elapsed = bounded(read, STALL_THROUGH_MOTO_S)
    assert_stalled(error, elapsed, f"{saved['uri']}/{saved['name']}", options)
    assert any(r.fault == "stalled after 0" for r in proxy.matching("GET", saved["name"]) if r.range)


def test_an_opening_that_gets_no_answer_is_classified_by_curls_own_exit_code(monkeypatch):
    """tensorizer asks curl's exit code as soon as curl's output ends, often before curl has exited; the
    stream waits for it, so a stalled opening is a stall and a refused one unreachable, without a probe."""
    from helpers.servers import closed_endpoint

    monkeypatch.setattr(RemoteFile, "_reachable", lambda self: pytest.fail("classified by a probe, not curl's code"))
    f = RemoteFile(f"{closed_endpoint()}/ckpt/model.tensors")
    for _ in range(20):
        with pytest.raises(RemoteUnreachableError, match=r"curl exit code 7\)"):
            f.open(0, 10)
