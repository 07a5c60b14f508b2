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
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
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
