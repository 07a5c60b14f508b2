"""Storage servers for the remote-checkpoint tests, all on 127.0.0.1 and all stopped by their owner.

- ``MotoS3``: moto's S3-compatible server in a subprocess (``python -m moto.server``). By default it
  accepts any credentials; ``auth=True`` makes it check them (moto's IAM: a user and an access key are
  made first), so a wrong secret is refused as real S3 refuses it. moto checks credentials only on
  requests signed in the Authorization header, not on presigned URLs (it answers those 500 when it
  enforces auth), so the auth server is for the refusal tests only.
- ``RangeHTTPServer``: a directory served over plain HTTP with Range support (Python's http.server has
  none), in a thread; ``cut_after`` makes it send only that many bytes of a ``.tensors`` file streamed
  whole (no Range: what a reader opens; the checks before it read ranges), then drop the connection,
  as a server that dies mid-read; ``ranges=False`` ignores Range headers, as some servers do.
- ``FaultProxy``: an HTTP proxy in front of ``MotoS3`` (a thread, a free port) that passes requests
  through untouched and injects ``Fault``s into the ones that match: an answer (``503 SlowDown``), a
  connection cut (or reset) after so many body bytes, the proxy itself stopping mid-response (the server
  a reader talks to is gone), a stall (no more bytes, the connection kept open), another version's bytes
  from some offset on, or a hook run before or during a response (to replace the object on the server). It
  records every request and the body bytes sent to each client (the access key id a request is signed
  with), so a test can count what a reader fetched.
- ``StallServer``: a bare TCP server that accepts connections and then sends nothing (or only an HTTP
  answer's headers) without closing them, until it is stopped: a server that stops answering.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3

REGION = "us-east-1"
BUCKET = "checkpoints"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_endpoint() -> str:
    """An http endpoint on 127.0.0.1 where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"


#: The longest a stalled connection (``StallServer``, ``Fault.stall_after``) is held open when its owner
#: forgets to stop it: nothing waits on it for ever.
STALL_HOLD_S = 120.0


class StallServer:
    """A server on 127.0.0.1 that accepts every connection, reads what the client sends, answers ``headers``
    (the bytes of an HTTP status line and headers; None: nothing at all), then sends nothing more and keeps
    the connection open until stopped. ``with StallServer() as s: s.url``; ``accepted`` counts connections."""

    def __init__(self, headers: bytes | None = None):
        self.headers = headers
        self.accepted = 0
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._connections: list[socket.socket] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        deadline = time.monotonic() + STALL_HOLD_S
        while not self._stopped.is_set() and time.monotonic() < deadline:
            try:
                connection, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._connections.append(connection)
            with contextlib.suppress(OSError):
                connection.settimeout(2)
                connection.recv(1 << 16)  # the request (its first segment is enough)
                if self.headers is not None:
                    connection.sendall(self.headers)
        for connection in self._connections:  # stopped, or held for STALL_HOLD_S
            with contextlib.suppress(OSError):
                connection.close()

    def __enter__(self) -> StallServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(10)
        self._sock.close()
        for connection in self._connections:
            with contextlib.suppress(OSError):
                connection.close()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class MotoS3:
    """moto's S3 server on a free port; ``with MotoS3() as s3: s3.endpoint, s3.key_id, s3.secret``."""

    def __init__(self, auth: bool = False, log: Path | None = None):
        self.auth = auth
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.key_id, self.secret = "AKIATESTKEYID0000001", "test-secret-never-shown-9f8e7d6c5b4a"
        self._log = log
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> MotoS3:
        env = dict(os.environ)
        for name in list(env):
            if name.startswith("AWS_"):
                env.pop(name)
        if self.auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"  # the IAM calls below, then every request is checked
        out = open(self._log, "wb") if self._log else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait()
            if self.auth:
                iam = boto3.client(
                    "iam",
                    endpoint_url=self.endpoint,
                    region_name=REGION,
                    aws_access_key_id="x",
                    aws_secret_access_key="y",
                )
                iam.create_user(UserName="tester")
                iam.put_user_policy(
                    UserName="tester",
                    PolicyName="all",
                    PolicyDocument='{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"*","Resource":"*"}]}',
                )
                key = iam.create_access_key(UserName="tester")["AccessKey"]
                self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
            self.client().create_bucket(Bucket=BUCKET)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.1)
        raise RuntimeError("moto server did not start")

    def client(self):
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=self.key_id,
            aws_secret_access_key=self.secret,
        )

    def env(self) -> dict[str, str]:
        """Credentials and endpoint as the environment gives them."""
        return {
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": REGION,
        }

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _RangeHandler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # as real servers answer (tensorizer's reader expects HTTP/1.1 or 2)
    cut_after: int | None = None
    ranges: bool = True

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def send_head(self):  # noqa: C901 - one small HTTP/1.1 range implementation
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404, "Not Found")
            return None
        size = path.stat().st_size
        begin, end = 0, size
        match = _RANGE.match(self.headers.get("Range", "")) if self.ranges else None
        if match:
            begin = int(match.group(1))
            end = min(size, int(match.group(2)) + 1) if match.group(2) else size
            if begin >= size or end <= begin:
                self.send_error(416, "Range Not Satisfiable")
                return None
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {begin}-{end - 1}/{size}")
        else:
            self.send_response(200)
        if self.ranges:
            self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - begin))
        self.end_headers()
        f = open(path, "rb")  # noqa: SIM115 - closed by copyfile
        f.seek(begin)
        self._remaining = end - begin
        # Only the whole-file stream a reader opens is cut (the checks before it read ranges).
        self._truncate = self.cut_after is not None and path.name.endswith(".tensors") and not match
        self._served_from = begin
        return f

    def copyfile(self, source, outputfile) -> None:
        try:
            remaining = self._remaining
            if self._truncate:
                remaining = max(0, min(remaining, self.cut_after - self._served_from))
            while remaining:
                chunk = source.read(min(remaining, 1 << 16))
                if not chunk:
                    break
                outputfile.write(chunk)
                remaining -= len(chunk)
            if self._truncate:
                self.close_connection = True
                outputfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            source.close()


class RangeHTTPServer:
    """``directory`` over HTTP on 127.0.0.1, with Range requests; ``with RangeHTTPServer(d) as srv: srv.url``."""

    def __init__(self, directory: Path, cut_after: int | None = None, ranges: bool = True):
        handler = type("Handler", (_RangeHandler,), {"cut_after": cut_after, "ranges": ranges})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(directory)))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RangeHTTPServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# -- a fault-injecting proxy in front of an S3 server --------------------------------------------------------------

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding",
     "upgrade"}
)  # fmt: skip
_CREDENTIAL = re.compile(r"(?:Credential=|X-Amz-Credential=|AWSAccessKeyId=)([A-Za-z0-9]+)")


def client_of(headers, query: str) -> str | None:
    """Who sent a request: the access key id it is signed with (header or presigned URL), or ``X-Fleet-Client``."""
    from urllib.parse import unquote

    tag = headers.get("X-Fleet-Client")
    if tag:
        return tag
    match = _CREDENTIAL.search(headers.get("Authorization", "")) or _CREDENTIAL.search(unquote(query))
    return match.group(1) if match else None


@dataclass
class Fault:
    """A fault for the requests that match: ``method``, a ``path`` substring, a ``client``, with or without a
    Range header (``ranged``); it applies to the ``nth`` matching request and the ``times - 1`` after it.

    What it does, one of: ``status`` (answer that instead of forwarding; with ``code`` an S3 error body, as
    ``503 SlowDown``); ``cut_after`` (forward, then close that connection after so many body bytes: FIN, or
    RST with ``reset``); ``stop_after`` (forward, then stop the whole proxy after so many body bytes: the
    server is gone, nothing listens there any more); ``stall_after`` (forward, then send nothing more after
    so many body bytes, 0: the headers only, the connection kept open until the proxy stops);
    ``swap_after`` (after so many body bytes, send the bytes of ``replacement`` at the same offsets: another
    version of the object from there on); ``drop_answer`` (forward, let the server apply it, then close the
    connection before a byte of the answer: a write that landed and whose answer was lost).
    ``before`` runs before forwarding, ``during`` once after ``during_after`` body bytes (e.g. replace the
    object on the server).
    """

    method: str | None = "GET"
    path: str | None = None
    client: str | None = None
    ranged: bool | None = None
    nth: int = 1
    times: int = 1
    status: int | None = None
    code: str | None = None
    cut_after: int | None = None
    reset: bool = False
    stop_after: int | None = None
    stall_after: int | None = None
    swap_after: int | None = None
    replacement: bytes | None = None
    drop_answer: bool = False
    before: Callable[[], None] | None = None
    during: Callable[[], None] | None = None
    during_after: int = 0
    seen: int = 0
    applied: int = 0

    def matches(self, method: str, path: str, client: str | None, ranged: bool) -> bool:
        return (
            (self.method is None or method == self.method)
            and (self.path is None or self.path in path)
            and (self.client is None or client == self.client)
            and (self.ranged is None or ranged == self.ranged)
        )


@dataclass
class Request:
    """One request the proxy saw: who, what, the answer, and how many body bytes it sent back."""

    method: str
    path: str
    client: str | None
    range: str | None
    status: int = 0
    sent: int = 0
    fault: str | None = None


class _Cut(Exception):
    pass


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy: FaultProxy

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        self.proxy._track(self.connection, True)

    def finish(self) -> None:
        self.proxy._track(self.connection, False)
        with contextlib.suppress(OSError):
            super().finish()

    def do_GET(self) -> None:
        self._forward()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                chunk = self.rfile.read(size + 2)[:size]
                if not size:
                    break
                chunks.append(chunk)
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self) -> None:
        import http.client
        from urllib.parse import urlsplit

        parts = urlsplit(self.path)
        ranged = "Range" in self.headers
        record = Request(self.command, parts.path, client_of(self.headers, parts.query), self.headers.get("Range"))
        fault = self.proxy._fault_for(record, ranged)
        self.proxy._record(record)
        body = self._body()
        try:
            if fault is not None and fault.before is not None:
                fault.before()
            if fault is not None and fault.status is not None:
                self._answer_error(record, fault)
                return
            upstream = http.client.HTTPConnection("127.0.0.1", self.proxy.upstream_port, timeout=60)
            try:
                upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():  # Host too, untouched: signatures still verify
                    if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                        conditional = name.lower() in ("if-match", "if-none-match") and self.command == "PUT"
                        if not (conditional and self.proxy.ignore_conditions):
                            upstream.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    upstream.putheader("Content-Length", str(len(body)))
                upstream.endheaders(body or None)
                response = upstream.getresponse()
                self._relay(record, fault, response)
            finally:
                upstream.close()
        except _Cut:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _answer_error(self, record: Request, fault: Fault) -> None:
        record.status, record.fault = fault.status, f"status {fault.status}"
        payload = b""
        if fault.code and self.command != "HEAD":
            payload = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{fault.code}</Code>'
                f"<Message>Please reduce your request rate.</Message><Resource>{record.path}</Resource>"
                "<RequestId>FAULTPROXY</RequestId></Error>"
            ).encode()
        reason = {503: "Slow Down" if fault.code == "SlowDown" else "Service Unavailable"}.get(fault.status)
        self.send_response_only(fault.status, reason)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if payload:
            self.wfile.write(payload)

    def _relay(self, record: Request, fault: Fault | None, response) -> None:
        record.status = response.status
        if fault is not None and fault.drop_answer:
            record.fault = "answer dropped"
            response.read()
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            self.connection.close()
            raise _Cut
        headers = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
        has_body = self.command != "HEAD" and response.status not in (204, 304)
        length = response.getheader("Content-Length")
        data = None
        if has_body and length is None:
            data = response.read()
            headers.append(("Content-Length", str(len(data))))
        self.send_response_only(response.status, response.reason)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if not has_body:
            return
        start = 0
        content_range = response.getheader("Content-Range") or ""
        match = re.match(r"bytes (\d+)-", content_range)
        if match:
            start = int(match.group(1))
        sent, during_done = 0, False
        while True:
            chunk = data if data is not None else response.read(1 << 16)
            data = b"" if data is not None else None
            if not chunk:
                return
            if fault is not None:
                if fault.stall_after is not None and sent + len(chunk) >= fault.stall_after:
                    self._send(record, chunk[: max(0, fault.stall_after - sent)])
                    self._stall(record, fault)
                limit = fault.cut_after if fault.cut_after is not None else fault.stop_after
                if limit is not None and sent + len(chunk) >= limit:
                    self._send(record, chunk[: max(0, limit - sent)])
                    self._cut(record, fault)
                swap = fault.swap_after
                if swap is not None and fault.replacement is not None and sent + len(chunk) > swap:
                    keep = max(0, fault.swap_after - sent)
                    at = start + sent + keep
                    chunk = chunk[:keep] + fault.replacement[at : at + len(chunk) - keep]
                    record.fault = f"swapped after {fault.swap_after}"
            self._send(record, chunk)
            sent += len(chunk)
            if fault is not None and fault.during is not None and not during_done and sent >= fault.during_after:
                during_done = True
                fault.during()

    def _send(self, record: Request, data: bytes) -> None:
        if data:
            self.wfile.write(data)
            record.sent += len(data)
            self.proxy._count(record, len(data))

    def _stall(self, record: Request, fault: Fault) -> None:
        """Send nothing more, the connection open, until the proxy stops (at most ``STALL_HOLD_S``)."""
        record.fault = f"stalled after {fault.stall_after}"
        self.proxy._stopping.wait(STALL_HOLD_S)
        raise _Cut

    def _cut(self, record: Request, fault: Fault) -> None:
        import struct

        if fault.stop_after is not None:
            record.fault = f"stopped after {fault.stop_after}"
            self.proxy._stop_listening()
        else:
            record.fault = f"{'reset' if fault.reset else 'cut'} after {fault.cut_after}"
        if fault.reset:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
        self.connection.close()
        raise _Cut


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3 server (``MotoS3``), which injects ``Fault``s and records
    every request (``requests``; ``fetched`` sums the body bytes sent back, by path and client).

    Point a client's endpoint at ``url``; requests and answers pass through unchanged (the Host header
    too, so signatures still verify) unless a fault matches. ``with FaultProxy(s3) as proxy: ...``; faults can
    be added while it runs (``add``). Stopped, nothing of it is left running.
    """

    def __init__(self, upstream: MotoS3 | str, faults: list[Fault] | None = None, ignore_conditions: bool = False):
        endpoint = upstream if isinstance(upstream, str) else upstream.endpoint
        self.upstream_port = int(endpoint.rsplit(":", 1)[1].rstrip("/"))
        self.faults: list[Fault] = list(faults or [])
        self.ignore_conditions = ignore_conditions
        """Drop ``If-Match`` and ``If-None-Match`` from writes: a server that ignores conditional writes."""
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._bytes: dict[tuple[str, str | None], int] = {}
        handler = type("Handler", (_ProxyHandler,), {"proxy": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._listening = False
        self._stopping = threading.Event()  # set: stalled responses end

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def _fault_for(self, record: Request, ranged: bool) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(record.method, record.path, record.client, ranged):
                    fault.seen += 1
                    if fault.nth <= fault.seen < fault.nth + fault.times:
                        fault.applied += 1
                        record.fault = "matched"
                        return fault
        return None

    def _record(self, record: Request) -> None:
        with self._lock:
            self.requests.append(record)

    def _count(self, record: Request, n: int) -> None:
        with self._lock:
            key = (record.path, record.client)
            self._bytes[key] = self._bytes.get(key, 0) + n

    def _track(self, connection: socket.socket, add: bool) -> None:
        with self._lock:
            (self._connections.add if add else self._connections.discard)(connection)

    def fetched(self, path: str | None = None, client: str | None = None) -> int:
        """Body bytes sent back for requests to ``path`` (a substring) from ``client`` (None: any)."""
        with self._lock:
            return sum(
                n
                for (p, c), n in self._bytes.items()
                if (path is None or path in p) and (client is None or c == client)
            )

    def matching(self, method: str | None = None, path: str | None = None, client: str | None = None) -> list[Request]:
        with self._lock:
            return [
                r
                for r in self.requests
                if (method is None or r.method == method)
                and (path is None or path in r.path)
                and (client is None or r.client == client)
            ]

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._listening = True
        return self

    def _stop_listening(self) -> None:
        """Stop accepting connections and drop every open one (the server went away)."""
        if not self._listening:
            return
        self._listening = False
        self._server.shutdown()  # called from a handler's thread, not the serving one
        self._server.server_close()
        with self._lock:
            open_now = list(self._connections)
        for connection in open_now:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self._stopping.set()
        self._stop_listening()
        with self._lock:  # those a stop mid-response already dropped are gone; any later ones too
            open_now = list(self._connections)
        for connection in open_now:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive():
            self._thread.join(10)

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
