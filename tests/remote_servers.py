"""Real servers on loopback for remote rasters: an HTTP server with Range support (RangeHTTPServer's handler) and an
S3-compatible server (moto's server mode), each in a thread of the test process, counting the bytes of the bodies
it serves (what GDAL fetched)."""

from __future__ import annotations

import functools
import threading
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


class _CountingApp:
    """A WSGI middleware counting the bytes of the response bodies."""

    def __init__(self, app: Any, counter: Counter) -> None:
        self.app, self.counter = app, counter

    def __call__(self, environ: dict, start_response: Any) -> Iterator[bytes]:
        path = environ.get("PATH_INFO", "")
        self.counter.add(path, 0, requests=1, range_=environ.get("HTTP_RANGE", ""))
        body: Iterable[bytes] = self.app(environ, start_response)
        try:
            for chunk in body:
                self.counter.add(path, len(chunk))
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


class S3Server:
    """moto's S3 server on 127.0.0.1 (a free port) with a bucket; ``environment`` is what GDAL needs to reach it
    (the endpoint, plain HTTP, path-style addressing, a region)."""

    def __init__(self, bucket: str = "scenes") -> None:
        self.bucket = bucket
        self.counter = Counter()
        self._server: Any = None

    def start(self) -> S3Server:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        class Quiet(MotoRequestHandler):
            def log(self, type: str, message: str, *args: Any) -> None:
                pass

        app = _CountingApp(DomainDispatcherApplication(create_backend_app), self.counter)
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=Quiet)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.client().create_bucket(Bucket=self.bucket)
        return self

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=f"http://{self.endpoint}",
            aws_access_key_id="test-key-id",
            aws_secret_access_key="test-secret-key",
            region_name="us-east-1",
        )

    def upload(self, path: Path, key: str) -> str:
        """Put a file into the bucket; its s3:// URI."""
        self.client().upload_file(str(path), self.bucket, key)
        return f"s3://{self.bucket}/{key}"

    def environment(self) -> dict[str, str]:
        return {
            "AWS_S3_ENDPOINT": self.endpoint,
            "AWS_HTTPS": "NO",
            "AWS_VIRTUAL_HOSTING": "FALSE",
            "AWS_REGION": "us-east-1",
        }

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
