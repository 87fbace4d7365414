"""Real servers on loopback for remote rasters, counting the bytes of the bodies they serve (what GDAL fetched): an
HTTP server with Range support (RangeHTTPServer's handler) in a thread of the test process, and an S3 server (moto's
server mode, with AWS's request signing and IAM policies enforced) in a process of its own, ended by its pid.

Run as a script, this module is that S3 server: ``python remote_servers.py`` prints its port, then serves."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from RangeHTTPServer import RangeRequestHandler


class Counter:
    """Body bytes and requests served per path (the query left out), thread-safe (a server answers each request in
    a thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes: dict[str, int] = {}
        self.requests: dict[str, int] = {}
        self.ranges: list[tuple[str, str]] = []  # (path, Range header) of each request with a body

    def add(self, path: str, nbytes: int, requests: int = 0, range_: str = "") -> None:
        path = path.split("?", 1)[0]
        with self._lock:
            self.bytes[path] = self.bytes.get(path, 0) + nbytes
            self.requests[path] = self.requests.get(path, 0) + requests
            if requests:
                self.ranges.append((path, range_))

    def reset(self) -> None:
        with self._lock:
            self.bytes, self.requests, self.ranges = {}, {}, []


class _CountingWriter:
    def __init__(self, out: Any, counter: Counter, path: str) -> None:
        self.out, self.counter, self.path = out, counter, path

    def write(self, data: bytes) -> int:
        self.counter.add(self.path, len(data))
        return self.out.write(data)


class _Handler(RangeRequestHandler):
    counter: Counter
    budget: Any  # called after each response (RangeServer.stop_after)

    def copyfile(self, source: Any, outputfile: Any) -> None:
        self.counter.add(self.path, 0, requests=1, range_=self.headers.get("Range") or "")
        super().copyfile(source, _CountingWriter(outputfile, self.counter, self.path))
        self.budget()

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


class RangeServer:
    """``python -m RangeHTTPServer``'s handler serving ``directory`` on 127.0.0.1 (a free port, kept over a
    stop and start: the URLs stay valid)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.counter = Counter()
        self.port = 0
        self.stop_when: Callable[[list[tuple[str, str]]], bool] | None = None  # see _budget
        self._server: ThreadingHTTPServer | None = None

    def _budget(self) -> None:
        """After each response: stop (a server that dies mid-run) once ``stop_when`` is true of the requests served
        so far (path, Range header); the response that made it true is the last."""
        if self.stop_when is not None and self.stop_when(list(self.counter.ranges)):
            self.stop_when = None
            threading.Thread(target=self.stop, daemon=True).start()  # not from a handler: shutdown() waits for it

    def start(self) -> RangeServer:
        handler = type("Handler", (_Handler,), {"counter": self.counter, "budget": staticmethod(self._budget)})
        serve = functools.partial(handler, directory=self.directory)
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), serve)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop answering: the listening socket closes, a new connection is refused."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def url(self, name: str, query: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{name}" + (f"?{query}" if query else "")


# ---------------------------------------------------------------------------------------------------------
# The S3 server: moto's, in a process of its own
# ---------------------------------------------------------------------------------------------------------

CONTROL = "/_rasterscale"  # the test's own requests to the server process: counts and faults, never S3's
REGION = "us-east-1"
ADMIN = ("admin-key-id", "admin-secret")  # moto's setup before its checks are on: any key is accepted
# The tests' user: everything on S3 but the objects under private/ of any bucket (AccessDenied).
POLICY = {
    "Version": "2012-10-17",
    "Statement": [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
        {"Effect": "Deny", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::*/private/*"},
    ],
}


class _Faults:
    """What the server does to the range requests for pixels (those not from byte 0: not a header's) after
    ``after`` of them: ``throttle`` answers each with S3's 503 SlowDown, ``drop`` breaks the connection after
    half of each body. Set by the test over :data:`CONTROL`."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self.after = 0
        self.seen = 0
        self._lock = threading.Lock()

    def set(self, mode: str | None, after: int) -> None:
        with self._lock:
            self.mode, self.after, self.seen = mode, after, 0

    def fault(self, environ: dict) -> str | None:
        """The fault to play on this request, if any (counted when it asks for pixels)."""
        range_ = environ.get("HTTP_RANGE", "")
        if environ.get("REQUEST_METHOD") != "GET" or not range_ or range_.startswith("bytes=0-"):
            return None
        with self._lock:
            if self.mode is None:
                return None
            self.seen += 1
            return self.mode if self.seen > self.after else None


SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate.'
    b"</Message></Error>"
)


class _ServerApp:
    """moto's WSGI app behind the test's controls: the bytes of the response bodies counted per path, the faults
    of :class:`_Faults` played, and :data:`CONTROL` answered (``GET .../counts``, ``POST .../reset``,
    ``POST .../fault`` with ``{"mode": ..., "after": n}``)."""

    def __init__(self, app: Any) -> None:
        self.app, self.counter, self.faults = app, Counter(), _Faults()

    def __call__(self, environ: dict, start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path.startswith(CONTROL):
            return self.control(path[len(CONTROL) :], environ, start_response)
        fault = self.faults.fault(environ)
        if fault == "throttle":
            start_response("503 Slow Down", [("Content-Type", "application/xml"), ("Retry-After", "0")])
            return [SLOW_DOWN]
        self.counter.add(path, 0, requests=1, range_=environ.get("HTTP_RANGE", ""))
        return self.body(path, self.app(environ, start_response), drop=fault == "drop")

    def body(self, path: str, body: Iterable[bytes], drop: bool) -> Iterator[bytes]:
        try:
            for chunk in body:
                if drop:  # half of it, then the connection breaks (the server ends the response early)
                    yield chunk[: len(chunk) // 2]
                    raise ConnectionAbortedError("dropped by the test")
                self.counter.add(path, len(chunk))
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()

    def control(self, what: str, environ: dict, start_response: Any) -> list[bytes]:
        if what == "/counts":
            with self.counter._lock:
                data = {"bytes": self.counter.bytes, "requests": self.counter.requests}
            answer = json.dumps(data).encode()
        else:
            length = int(environ.get("CONTENT_LENGTH") or 0)
            sent = json.loads(environ["wsgi.input"].read(length) or b"{}")
            if what == "/reset":
                self.counter.reset()
            elif what == "/fault":
                self.faults.set(sent.get("mode"), int(sent.get("after", 0)))
            answer = b"{}"
        start_response("200 OK", [("Content-Type", "application/json")])
        return [answer]


def serve() -> None:
    """The server process: moto on 127.0.0.1 (a free port, printed first), until it is ended."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class Quiet(MotoRequestHandler):
        def log(self, type: str, message: str, *args: Any) -> None:
            pass

    app = _ServerApp(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=Quiet)
    print(server.server_address[1], flush=True)
    threading.Thread(target=_end_with_parent, args=(os.getppid(),), daemon=True).start()
    server.serve_forever()


def _end_with_parent(parent: int) -> None:
    """End the server when the test process that started it is gone (killed before its fixture's teardown)."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(0)


class S3Server:
    """moto's S3 server in a process of its own on 127.0.0.1, with AWS's checks on: requests are signed, with an
    access key of its IAM user ``rasterscale`` (:attr:`key_id`, :attr:`secret_key`: random, moto's), whose policy
    denies the objects under ``private/`` (:data:`POLICY`). ``environment`` is what GDAL and boto3 need to reach it
    (the endpoint, plain HTTP, path-style addressing, the region), credentials apart. One per test session
    (``conftest.s3_server``): each test module puts its objects into a bucket of its own."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.key_id = self.secret_key = ""

    def start(self) -> S3Server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.process = subprocess.Popen(
            [sys.executable, __file__], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        assert self.process.stdout is not None
        self.port = int(self.process.stdout.readline())
        iam = self._client("iam", *ADMIN)
        iam.create_user(UserName="rasterscale")
        iam.put_user_policy(UserName="rasterscale", PolicyName="all-but-private", PolicyDocument=json.dumps(POLICY))
        key = iam.create_access_key(UserName="rasterscale")["AccessKey"]
        self.key_id, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
        self._post("/moto-api/reset-auth", b"0", "text/plain")  # from now on every request is checked
        return self

    def stop(self) -> None:
        """End the server process by its pid."""
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _client(self, service: str, key_id: str, secret: str) -> Any:
        import boto3

        return boto3.session.Session().client(  # a new session: not one that read the environment before
            service, endpoint_url=f"http://{self.endpoint}", aws_access_key_id=key_id,
            aws_secret_access_key=secret, region_name=REGION,
        )  # fmt: skip

    def client(self) -> Any:
        """A boto3 S3 client with the user's credentials."""
        return self._client("s3", self.key_id, self.secret_key)

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)

    def upload(self, path: Path, bucket: str, key: str) -> str:
        """Put a file into a bucket; its s3:// URI."""
        self.client().upload_file(str(path), bucket, key)
        return f"s3://{bucket}/{key}"

    def environment(self) -> dict[str, str]:
        """GDAL's and boto3's way to this server (no credentials)."""
        return {
            "AWS_S3_ENDPOINT": self.endpoint,
            "AWS_HTTPS": "NO",
            "AWS_VIRTUAL_HOSTING": "FALSE",
            "AWS_ENDPOINT_URL_S3": f"http://{self.endpoint}",
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
        }

    def credentials(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.key_id, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def _post(self, path: str, data: bytes, content_type: str = "application/json") -> bytes:
        request = urllib.request.Request(
            f"http://{self.endpoint}{path}", data=data, method="POST", headers={"Content-Type": content_type}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return bytes(response.read())

    def _counts(self) -> dict[str, dict[str, int]]:
        with urllib.request.urlopen(f"http://{self.endpoint}{CONTROL}/counts", timeout=30) as response:
            counts: dict[str, dict[str, int]] = json.loads(response.read())
        return counts

    def fetched(self, path: str) -> int:
        """Body bytes served for ``path`` (``/bucket/key``) since the last :meth:`reset`."""
        return self._counts()["bytes"].get(path, 0)

    def requests(self, path: str) -> int:
        """Requests answered for ``path`` since the last :meth:`reset`."""
        return self._counts()["requests"].get(path, 0)

    def reset(self) -> None:
        self._post(f"{CONTROL}/reset", b"{}")

    def fault(self, mode: str | None, after: int = 0) -> None:
        """From the next range request for pixels on, after ``after`` of them: ``throttle`` (503 SlowDown) or
        ``drop`` (a broken connection) each; None: none."""
        self._post(f"{CONTROL}/fault", json.dumps({"mode": mode, "after": after}).encode())


if __name__ == "__main__":
    serve()
