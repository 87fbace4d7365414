"""What GDAL's network file systems know of a remote file that rasterio does not expose: the HTTP headers of the
response that told GDAL the file's size (``VSIGetFileMetadata(path, "HEADERS")``: a HEAD request, or for some file
systems a first range request, made by GDAL itself with its settings, retries and credentials). GDAL keeps what
that response told it, so a raster opened after it is read without another request for its size.

The call goes through the GDAL library rasterio loaded, so it shares rasterio's GDAL: its configuration, caches
and credentials (another package may have loaded a GDAL of its own in the same process: pyogrio's wheels do). It is
found beside rasterio's package (a wheel's copy) or among the process's mapped files, and told from another GDAL by
a configuration option that rasterio sets and it must read. Where it cannot be found, :func:`http_headers` answers
None and nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import rasterio
from rasterio.env import get_gdal_config, set_gdal_config

LIBRARY_DIRS = ("rasterio.libs", "rasterio/.dylibs")  # where rasterio's wheels keep GDAL (Linux, macOS)
PROBE = "RASTERSCALE_WHICH_GDAL"  # a configuration option rasterio sets to tell its GDAL from another
_FINDING = threading.Lock()  # the first calls come from several reading threads at once


def _gdal() -> ctypes.CDLL | None:
    """rasterio's GDAL library, or None when it cannot be found (looked for once)."""
    with _FINDING:
        return _find_gdal()


@functools.lru_cache(maxsize=1)
def _find_gdal() -> ctypes.CDLL | None:
    for path in dict.fromkeys([*_wheel_gdal(), *_mapped_gdal()]):
        try:
            lib = ctypes.CDLL(path)
            lib.CPLGetConfigOption.restype = ctypes.c_char_p
            lib.CPLGetConfigOption.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
            if not _is_rasterios(lib):
                continue
            lib.VSIGetFileMetadata.restype = ctypes.POINTER(ctypes.c_char_p)
            lib.VSIGetFileMetadata.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p]
            lib.CSLDestroy.argtypes = [ctypes.c_void_p]
            lib.CSLDestroy.restype = None
            lib.CPLPushErrorHandler.argtypes = [ctypes.c_void_p]
            lib.CPLPushErrorHandler.restype = None
            lib.CPLPopErrorHandler.restype = None
            lib.VSICurlClearCache.restype = None
        except (OSError, AttributeError):
            continue
        return lib
    return None


def _is_rasterios(lib: ctypes.CDLL) -> bool:
    """Whether ``lib`` is the GDAL rasterio calls: it reads the option rasterio sets."""
    token = f"{os.getpid()}-{id(lib)}"
    before = get_gdal_config(PROBE)
    set_gdal_config(PROBE, token)
    try:
        return bool(lib.CPLGetConfigOption(PROBE.encode(), None) == token.encode())
    finally:
        set_gdal_config(PROBE, before)


def _wheel_gdal() -> Iterator[str]:
    """The GDAL library a rasterio wheel carries beside its package."""
    site = Path(rasterio.__file__).resolve().parents[1]
    for folder in LIBRARY_DIRS:
        for found in sorted((site / folder).glob("libgdal*")):
            yield str(found)


def _mapped_gdal() -> Iterator[str]:
    """The GDAL libraries mapped into this process (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            names = [line.rsplit(maxsplit=1)[-1] for line in maps]
    except OSError:
        return
    for name in dict.fromkeys(names):
        if Path(name).name.startswith("libgdal"):
            yield name


def clear_cache() -> None:
    """Forget what GDAL keeps of remote files in this process (their sizes, validators and fetched bytes), as a new
    process starts: GDAL's ``VSICurlClearCache``."""
    lib = _gdal()
    if lib is not None:
        lib.VSICurlClearCache()


def http_headers(path: str) -> dict[str, str] | None:
    """The HTTP headers (names lower-cased) GDAL got for a remote file's size, from one request GDAL makes (GDAL's
    own errors silenced: an open of the file tells them); None when GDAL got no answer, the path is on no network
    file system, or rasterio's GDAL cannot be called. Runs under the calling thread's GDAL configuration."""
    lib = _gdal()
    if lib is None:
        return None
    lib.CPLPushErrorHandler(ctypes.cast(lib.CPLQuietErrorHandler, ctypes.c_void_p))
    try:
        listed = lib.VSIGetFileMetadata(path.encode(), b"HEADERS", None)
    finally:
        lib.CPLPopErrorHandler()
    if not listed:
        return None
    headers = {}
    try:
        index = 0
        while listed[index] is not None:
            name, _, value = listed[index].decode("utf-8", "replace").partition("=")
            headers[name.strip().lower()] = value.strip()
            index += 1
    finally:
        lib.CSLDestroy(ctypes.cast(listed, ctypes.c_void_p))
    return headers or None
