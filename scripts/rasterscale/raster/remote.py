"""Rasters where they live: a scene's ``path`` may be an ``https://`` (or ``http://``) URL, an ``s3://`` URI or a GDAL
virtual path (``/vsicurl/``, ``/vsis3/``, ``/vsigs/``, ...) of a Cloud Optimized GeoTIFF. GDAL reads it by windowed
range requests (the header, then the blocks a window needs), never the whole file.

Every open of a scene's raster goes through :func:`open_raster`, with GDAL's settings for COGs from this one place:

- process-wide (:data:`NETWORK_SETTINGS`, only GDAL's network file systems read them, so local files are not
  affected): consecutive ranges merged into one request, HTTP/2 multiplexing, retries of throttled or failed
  requests, time limits, a bounded cache of fetched bytes (the decoded blocks' cache is GDAL_CACHEMAX, which a
  prediction rank bounds to ``predict.read_cache_mb``);
- at the open of a remote raster only (:data:`OPEN_SETTINGS`, these would change how local files open): no listing
  of the raster's folder (GDAL would otherwise look for side-car files, one request each) and the per-file read
  cache.

A variable already in the environment wins over both (``GDAL_HTTP_TIMEOUT=600 snakemake ...``). Credentials are
GDAL's own: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
``~/.aws/credentials`` and ``~/.aws/config``, an instance's role; ``AWS_S3_ENDPOINT``, ``AWS_HTTPS``,
``AWS_VIRTUAL_HOSTING`` for other S3 servers, ``AWS_NO_SIGN_REQUEST=YES`` for public buckets. Nothing here reads
or logs them, and what a message shows of a URL is redacted (:func:`shown`).

What tells one version of a remote raster from another (its ETag or Last-Modified, and size: the plan's header
cache keys remote headers by it) comes from the answer to the request GDAL makes for the file's size at every open
(:func:`remote_version`), so it costs no request of its own.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path

import rasterio
from rasterio.session import DummySession

from rasterscale.errors import InputError, redact
from rasterscale.raster.s3 import CREDENTIALS_HINT
from rasterscale.raster.vsi import http_headers

SCHEMES = {"s3://": "/vsis3/", "https://": "/vsicurl/https://", "http://": "/vsicurl/http://"}
VIRTUAL = "/vsi"  # any GDAL virtual file system path: no file on the local disk
# raster files a /vsicurl/ URL may name (GDAL requests no other name: no side-car probes); {noext}: a URL whose last
# path segment has no extension (an API's download link). The query string is not part of the name.
ALLOWED_EXTENSIONS = ".tif,.tiff,.vrt,.jp2,.img,{noext}"
NETWORK_SETTINGS = {
    "GDAL_HTTP_MERGE_CONSECUTIVE_RANGES": "YES",  # neighbouring blocks of a window in one request
    "GDAL_HTTP_MULTIPLEX": "YES",  # parallel range requests over one HTTP/2 connection where the server has it
    "GDAL_HTTP_MAX_RETRY": "3",  # a throttled or failed request (429, 5xx, timeouts) is retried...
    "GDAL_HTTP_RETRY_DELAY": "1",  # ...after 1 s, then longer
    "GDAL_HTTP_CONNECTTIMEOUT": "30",
    "GDAL_HTTP_TIMEOUT": "300",  # seconds for one request: a server that stops answering fails the read
    "CPL_VSIL_CURL_ALLOWED_EXTENSIONS": ALLOWED_EXTENSIONS,
    "CPL_VSIL_CURL_CACHE_SIZE": str(64 * 2**20),  # bytes of fetched blocks a process keeps (GDAL's: 16 MB)
}
OPEN_SETTINGS = {
    "GDAL_DISABLE_READDIR_ON_OPEN": "EMPTY_DIR",  # no folder listing, no side-car files: a COG holds its overviews
    "VSI_CACHE": "TRUE",  # a read cache per open file...
    "VSI_CACHE_SIZE": str(32 * 2**20),  # ...of 32 MB (bytes)
}


# GDAL's warnings of a request that failed and is retried, as rasterio logs them ("HTTP error code: 503 - <url>.
# Retrying again in 1.0 secs", "CURL error: ..."): a read that fails in the end says no more than libtiff's "got 0
# bytes", so the last of them tells why.
FAILED_REQUEST = re.compile(r"(HTTP error code: \d+|CURL error: [^.\n]+)")
THROTTLED = ("HTTP error code: 429", "HTTP error code: 503")


class _FailedRequests(logging.Handler):
    """The last failed request GDAL warned of, per reading thread."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        found = FAILED_REQUEST.search(record.getMessage())
        if found:
            self.seen.last = found[1]


_FAILED = _FailedRequests()


def watch_requests() -> None:
    """From here on in this thread, remember the last request GDAL warned of having failed (:func:`failed_request`);
    the handler on rasterio's logger of GDAL's messages is added once."""
    logger = logging.getLogger("rasterio._err")
    if _FAILED not in logger.handlers:
        logger.addHandler(_FAILED)
    _FAILED.seen.last = None


def failed_request() -> str | None:
    """Why the last request GDAL retried failed, in words, since this thread's :func:`watch_requests`; None if
    none did."""
    last: str | None = getattr(_FAILED.seen, "last", None)
    if last is None:
        return None
    if last.startswith(THROTTLED):
        return f"the server answered {last.replace('error code: ', '')} to every retry: it throttles the requests"
    return f"the server answered {last.replace('error code: ', '')} to every retry"


def is_remote(path: str | Path) -> bool:
    """Whether ``path`` names no local file: a URL (``https://``, ``http://``, ``s3://``) or a GDAL virtual path."""
    return isinstance(path, str) and (path.startswith(VIRTUAL) or path.startswith(tuple(SCHEMES)))


def gdal_path(path: str | Path) -> str:
    """The path GDAL opens: ``s3://b/k`` as ``/vsis3/b/k``, ``https://h/k`` as ``/vsicurl/https://h/k``; others as
    they are."""
    text = str(path)
    for scheme, prefix in SCHEMES.items():
        if text.startswith(scheme):
            return prefix + text[len(scheme) :]
    return text


def shown(path: str | Path) -> str:
    """A raster's name for a message or a log: a remote one as the URL it was given as (``/vsis3/b/k`` as
    ``s3://b/k``, ``/vsicurl/https://...`` as ``https://...``), its secrets redacted; a local one as it is."""
    text = str(path)
    if text.startswith("/vsis3/"):
        text = "s3://" + text[len("/vsis3/") :]
    elif text.startswith("/vsicurl/") and "://" in text:
        text = text[len("/vsicurl/") :]
    return redact(text)


def file_name(path: str | Path) -> str:
    """The file name of a raster, local or remote (a URL's last path segment, without its query)."""
    text = str(path)
    if is_remote(text):
        return text.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    return os.path.basename(text.rstrip(os.sep))  # Path(text).name, without pathlib's parsing (100,000 scenes)


def local_files(paths: Iterable[str]) -> list[str]:
    """The paths that name local files (a rule's inputs: Snakemake cannot wait for a remote raster as a file)."""
    return [path for path in paths if not is_remote(path)]


def configure_network() -> None:
    """GDAL's network settings for this process and the processes it starts (:data:`NETWORK_SETTINGS`), where the
    environment does not set them already. Idempotent."""
    for key, value in NETWORK_SETTINGS.items():
        os.environ.setdefault(key, value)


def open_settings() -> dict[str, str]:
    """The settings of a remote raster's open (:data:`OPEN_SETTINGS`), the environment's values where it has them."""
    return {key: os.environ.get(key, value) for key, value in OPEN_SETTINGS.items()}


def open_raster(path: str | Path) -> rasterio.io.DatasetReader:
    """Open a scene's raster for reading, local or remote. A remote one opens through GDAL's virtual file systems
    with this module's settings (GDAL's own credentials chain: no session of rasterio's); it is read window by
    window like a local file."""
    if not is_remote(path):
        return rasterio.open(path)
    configure_network()
    with rasterio.Env(session=DummySession(), **open_settings()):
        return rasterio.open(gdal_path(path))


def remote_version(path: str | Path) -> str | None:
    """What tells one version of a remote raster from another without reading it: its ETag (else its
    Last-Modified) and its size, from the response GDAL gets for the file's size (:func:`http_headers`). GDAL makes
    that request at every open anyway and keeps its answer, so an open after this one makes no other. None when the
    server gives no validator or no size, or the path is on no network file system."""
    configure_network()
    with rasterio.Env(session=DummySession(), **open_settings()):
        headers = http_headers(gdal_path(path))
    if not headers:
        return None
    validator = headers.get("etag") or headers.get("last-modified")
    if "content-range" in headers:  # the answer to a range request (bytes 0-16383/197016): the file's size last
        size = headers["content-range"].rpartition("/")[2]
    else:
        size = headers.get("content-length", "")
    if not validator or not size.isdigit():
        return None
    return f"{validator} {size}"


def remote_open_error(path: str | Path, err: BaseException) -> InputError:
    """The one line of a remote raster that will not open: its URL (redacted), GDAL's reason and where to look."""
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    text, name = str(path), file_name(path)
    hint = "check the URL"
    if text.startswith(("s3://", "/vsis3/")):
        hint = CREDENTIALS_HINT
    elif "." in name and not name.lower().endswith(tuple(ALLOWED_EXTENSIONS.split(",")[:-1])):
        hint += f" (GDAL requests only file names ending in {ALLOWED_EXTENSIONS}: set CPL_VSIL_CURL_ALLOWED_EXTENSIONS)"
    return InputError(f"{shown(path)}: remote raster cannot be opened ({reason}); {hint}")


def check_tiled(path: str | Path, striped: list[str]) -> None:
    """A remote raster must be tiled: a window of a striped one is whole raster rows, fetched again for every tile,
    and a tiled copy would have to be made from all of it. One line naming the fix otherwise."""
    if striped and is_remote(path):
        what = "is striped, not tiled" if striped == [str(path)] else "reads striped rasters"
        raise InputError(
            f"{shown(path)}: remote raster {what}: every window would fetch whole rows of the raster; make it a "
            "Cloud Optimized GeoTIFF (rio cogeo create in.tif out.tif, or gdal_translate -of COG in.tif out.tif) "
            "and point the scene at that, or copy it here as a local file (read from a tiled COG made once)"
        )
