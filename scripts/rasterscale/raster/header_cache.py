"""The plan's raster headers: read in parallel ahead of the checks, and kept across invocations.

The dry run checks every scene's raster from its header (:func:`rasterscale.raster.headers.check_raster`). At
thousands of scenes, two things make that cheap:

- **Read ahead** (:class:`HeaderReads`). The headers of the scenes' rasters are read in scene order, ahead of the
  checks, by bounded thread pools, at most :data:`AHEAD` ahead of the check that needs them, so memory stays flat
  at any number of scenes: :data:`REMOTE_WORKERS` threads for remote rasters, whose reads wait on the network, and
  :data:`LOCAL_WORKERS` for local files on a network file system (NFS, Lustre, GPFS...: a cluster's shared
  storage, :func:`on_network_file_system`), whose opens wait on it too. A local file on a local disk is read by the
  checks' own thread, as it comes: its header read (~1 ms) is CPU, mostly Python and GDAL holding the interpreter's
  lock, and threads beside the checks only slowed them down (by half a millisecond a scene, measured). The checks
  run in series in the calling thread and get each header when they ask for it
  (:func:`rasterscale.raster.headers.headers_from`): a read's error (a raster that will not open) is raised there,
  in the check of its scene, so the plan stops at the scene and with the line it stops at when the headers are
  read in series. GDAL's configuration is a thread's own (rasterio.Env): a read enters
  :mod:`rasterscale.raster.remote`'s settings in its thread (``open_raster``), and the caller's rasterio.Env, if
  one is entered, is entered there too.
- **Kept** (:class:`HeaderCache`). What the checks use of a header (:class:`RasterInfo`, and where a GeoTIFF's
  blocks reach past its end) is kept in one SQLite file of the working directory
  (:data:`rasterscale.jobs.paths.HEADER_CACHE`: ``.snakemake/rasterscale/headers.sqlite``), by the raster's path as
  given and its version (:func:`header_version`): a local file's size and mtime (ns), with those of its sidecar
  files; a remote one's ETag (else Last-Modified) and size, from the response GDAL gets for its size
  (:func:`rasterscale.raster.remote.remote_version`), the request every open makes first: a raster in the cache
  costs that one request and no range request, one not in it no more requests than without the cache. A raster
  without a version is read every time: a VRT (its header depends on its sources), a server that sends no
  validator. A changed file's entry is replaced. CRSs are kept once each, as WKT. Only the plan of Snakemake's
  main process uses the cache (jobs neither read nor write it); it writes in SQLite transactions, so another
  process reads whole ones. Each entry carries its checksum (SQLite checks its pages' structure, not what they
  hold): one not as written gives the cache up as a file that cannot be read does. A file that cannot be read
  (cut short, garbage) is made again, with one warning; one that another process keeps locked for longer than
  :data:`LOCK_WAIT_S` (or the environment's ``RASTERSCALE_LOCK_WAIT_S`` seconds) is left to it and the headers are
  read without the cache, with one warning. Delete it to clear the cache.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sqlite3
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import rasterio
from affine import Affine
from rasterio.crs import CRS

from rasterscale.atomic import said_no_space
from rasterscale.raster.headers import CheckedHeader, RasterInfo, headers_from, read_checked_header, siblings
from rasterscale.raster.remote import file_name, is_remote, remote_version

REMOTE_WORKERS = 16  # remote headers read at once: each waits on a round trip
LOCAL_WORKERS = min(8, os.cpu_count() or 1)  # headers of local files on a network file system read at once
# file systems (/proc/self/mounts' types) whose files' opens wait on the network: their headers are read ahead
NETWORK_FILE_SYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph", "glusterfs",
                        "panfs", "wekafs", "9p", "afs", "fuse.")  # fmt: skip
AHEAD = 512  # headers read ahead of the check that needs them, at most
KEPT = 64  # headers the checks took last, kept for their next question (a scene's checks ask two or three times)
WRITE_EVERY = 2000  # new entries written to the file in one transaction
FORMAT = "2"  # of the cache's tables: a file of another format, GDAL or rasterio is emptied (2: entries checksummed)
LOCK_WAIT_S = 30.0  # how long a connection waits for another process's lock before it goes on without the cache
LOCK_WAIT_VARIABLE = "RASTERSCALE_LOCK_WAIT_S"  # an environment variable's number of seconds overrides LOCK_WAIT_S
# what SQLite raises over a damaged file: its errors, and a UnicodeDecodeError where Python decodes its message
# naming the garbage (a damaged schema: "malformed database schema (<its bytes>)")
DAMAGED = (sqlite3.Error, UnicodeDecodeError)
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS crs (id INTEGER PRIMARY KEY, wkt TEXT NOT NULL UNIQUE)",
    "CREATE TABLE IF NOT EXISTS headers (path TEXT PRIMARY KEY, version TEXT NOT NULL, info TEXT NOT NULL, "
    "crs INTEGER)",
)


def header_version(path: str) -> str | None:
    """What tells one version of a raster from another without opening it: a local file's size and mtime (ns), with
    those of its sidecar files (``x.tif.msk``, ``x.tif.aux.xml``, ``x.tfw``: GDAL reads them with it); a remote
    one's ETag or Last-Modified and size. None for a VRT (its header depends on its sources) and a remote raster
    whose server gives no validator. An OSError for a local file that is gone."""
    if file_name(path).lower().endswith(".vrt"):
        return None
    if is_remote(path):
        return remote_version(path)
    parts = [_stat_version(Path(path))]
    folder = Path(path).parent
    for name in siblings(path):
        try:
            parts.append(f"{name}:{_stat_version(folder / name)}")
        except OSError:
            parts.append(name)
    return ";".join(parts)


def _stat_version(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


class HeaderCache:
    """The headers kept across invocations: one SQLite file (see the module). Thread-safe: the reading threads ask
    it and add to it; what they add is written in transactions of :data:`WRITE_EVERY` entries and at
    :meth:`close`. A file that fails later than its opening is given up for this run and removed (the next run
    makes it again), with one warning."""

    def __init__(self, file: Path, warn: Callable[[str], None]) -> None:
        self.file = file
        self._warn = warn
        self._wait = lock_wait_s()
        self._db: sqlite3.Connection | None = _connect(file, self._wait)
        self._lock = threading.Lock()
        self._new: list[tuple[str, str, str, str | None]] = []  # (path, version, info, CRS as WKT)
        self._crs: dict[int, CRS] = {}  # the CRSs read, by id: one object per CRS
        self._crs_ids: dict[str, int] = {}  # the CRSs written, by WKT
        try:  # an empty cache (the first run in a folder) is not asked: a question less a raster
            self._empty = not self._db.execute("SELECT EXISTS (SELECT 1 FROM headers)").fetchone()[0]
        except DAMAGED:
            self._db.close()
            raise

    @classmethod
    def open(cls, file: Path, warn: Callable[[str], None]) -> HeaderCache | None:
        """The cache in ``file``, made when absent; one that cannot be read is made again (one warning line), and
        None when that fails too (the headers are then read without a cache)."""
        try:
            return cls(file, warn)
        except (*DAMAGED, OSError) as err:
            if is_locked(err):  # another process holds it (a stuck one: a live one's transactions take milliseconds)
                warn(f"{file}: the header cache is locked by another process ({_reason(err)} for {lock_wait_s():g} "
                     "s); every raster's header is read this time")  # fmt: skip
                return None
            reason = _reason(err)
        try:
            file.unlink(missing_ok=True)
            cache = cls(file, warn)
        except (*DAMAGED, OSError) as err:
            warn(f"{file}: the header cache cannot be read ({reason}) nor made again ({_reason(err)}); every "
                 "raster's header is read this time")  # fmt: skip
            return None
        warn(f"{file}: the header cache cannot be read ({reason}); it is made again (every raster's header is read "
             "this time)")  # fmt: skip
        return cache

    def get(self, path: str, version: str) -> CheckedHeader | None:
        """The kept header of ``path`` at ``version``, or None."""
        with self._lock:
            if self._db is None or self._empty:
                return None
            try:
                row = self._db.execute(
                    "SELECT h.info, h.crs, c.wkt FROM headers h LEFT JOIN crs c ON c.id = h.crs "
                    "WHERE h.path = ? AND h.version = ?",
                    (path, version),
                ).fetchone()
                if row is None:
                    return None
                text = _verified(path, version, row[0], row[2])
                return _decode(path, text, self._crs_of(row[1], row[2]))
            except (sqlite3.Error, ValueError, TypeError, IndexError) as err:
                self._give_up(err)
                return None

    def put(self, path: str, version: str, checked: CheckedHeader) -> None:
        """Keep ``path``'s header at ``version`` (replacing another version's)."""
        info = checked[0]
        wkt = info.crs.to_wkt() if info.crs is not None else None
        entry = (path, version, _encode(path, version, checked, wkt), wkt)
        with self._lock:
            if self._db is None:
                return
            self._new.append(entry)
            if len(self._new) >= WRITE_EVERY:
                self._write()

    def close(self) -> None:
        """Write what was added, and close the file."""
        with self._lock:
            if self._db is None:
                return
            self._write()
            if self._db is not None:
                self._db.close()
                self._db = None

    def _crs_of(self, crs_id: int | None, wkt: str | None) -> CRS | None:
        if crs_id is None or wkt is None:
            return None
        if crs_id not in self._crs:
            self._crs[crs_id] = CRS.from_wkt(wkt)
        return self._crs[crs_id]

    def _write(self) -> None:
        """The added entries in one transaction (called with the lock held)."""
        db, new = self._db, self._new
        if db is None or not new:
            return
        self._new = []
        try:
            db.execute("BEGIN IMMEDIATE")
            rows = [(path, version, info, self._crs_id(db, wkt)) for path, version, info, wkt in new]
            db.executemany("INSERT OR REPLACE INTO headers (path, version, info, crs) VALUES (?, ?, ?, ?)", rows)
            db.execute("COMMIT")
        except DAMAGED as err:
            self._give_up(err)

    def _crs_id(self, db: sqlite3.Connection, wkt: str | None) -> int | None:
        if wkt is None:
            return None
        if wkt not in self._crs_ids:
            db.execute("INSERT OR IGNORE INTO crs (wkt) VALUES (?)", (wkt,))
            self._crs_ids[wkt] = int(db.execute("SELECT id FROM crs WHERE wkt = ?", (wkt,)).fetchone()[0])
        return self._crs_ids[wkt]

    def _give_up(self, err: BaseException) -> None:
        """The file failed after its opening: not used again this run, removed (one warning)."""
        db, self._db, self._new = self._db, None, []
        if db is not None:
            with contextlib.suppress(sqlite3.Error):
                db.close()
        if is_locked(err):  # the file is another process's now: left to it
            self._warn(f"{self.file}: the header cache is locked by another process ({_reason(err)} for "
                       f"{self._wait:g} s); the headers read are not kept this time")  # fmt: skip
            return
        with contextlib.suppress(OSError):
            self.file.unlink(missing_ok=True)
        if said_no_space(err):  # a write ran out of space
            self._warn(f"{self.file}: no space left on device; the header cache is removed, and made again by the "
                       "next run")  # fmt: skip
            return
        self._warn(f"{self.file}: the header cache cannot be read ({_reason(err)}); it is removed, and made again "
                   "by the next run")  # fmt: skip


def lock_wait_s() -> float:
    """How long a connection to the cache waits for another process's lock (then the plan goes on without the
    cache): :data:`LOCK_WAIT_S`, or the seconds of the environment's :data:`LOCK_WAIT_VARIABLE` (read when the
    cache is opened: a warm process forked for each command sees the command's environment)."""
    try:
        seconds = float(os.environ.get(LOCK_WAIT_VARIABLE, ""))
    except ValueError:
        return LOCK_WAIT_S
    return seconds if 0 <= seconds < float("inf") else LOCK_WAIT_S


def _connect(file: Path, wait: float) -> sqlite3.Connection:
    """The cache's database, its tables made; emptied when of another format, GDAL or rasterio; ``wait``: seconds
    a statement waits for another connection's lock. Raises one of :data:`DAMAGED` (a file that is no database or
    is damaged, a lock held longer) or OSError."""
    file.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(file, timeout=wait, check_same_thread=False, isolation_level=None)
    try:
        expected = {"format": FORMAT, "gdal": rasterio.__gdal_version__, "rasterio": rasterio.__version__}
        db.execute("BEGIN IMMEDIATE")
        for statement in SCHEMA:
            db.execute(statement)
        if dict(db.execute("SELECT key, value FROM meta").fetchall()) != expected:
            for table in ("headers", "crs", "meta"):
                db.execute(f"DELETE FROM {table}")
            db.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", expected.items())
        db.execute("COMMIT")
    except BaseException:
        db.close()
        raise
    return db


def is_locked(err: BaseException) -> bool:
    """Whether SQLite gave up waiting for another connection's lock (the file itself may be sound)."""
    return isinstance(err, sqlite3.OperationalError) and "locked" in str(err)


def _reason(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _encode(path: str, version: str, checked: CheckedHeader, wkt: str | None) -> str:
    """A header as the cache keeps it (its CRS apart, as ``wkt``): a JSON list, after the entry's checksum
    (:func:`_checksum`)."""
    info, cut = checked
    fields: list[Any] = [info.width, info.height, info.count, list(info.transform)[:6]]
    fields += [[list(shape) for shape in info.block_shapes], list(info.dtypes), info.alpha, info.nodata]
    fields += [info.dataset_mask, info.driver, list(cut) if cut is not None else None]
    text = json.dumps(fields, separators=(",", ":"))
    return _checksum(path, version, text, wkt) + text


CHECKSUM_DIGITS = 8  # an entry's CRC-32, in hex, before its header's JSON


def _checksum(path: str, version: str, text: str, wkt: str | None) -> str:
    """The CRC-32 of a whole entry (its path, version, header's JSON and CRS's WKT): SQLite checks its pages'
    structure, not what they hold, and a figure of a header changed in place (a flipped byte) or its CRS's row lost
    would read as another header, undetected."""
    data = "\0".join((path, version, text, wkt if wkt is not None else "\0")).encode()
    return f"{zlib.crc32(data):0{CHECKSUM_DIGITS}x}"


def _verified(path: str, version: str, stored: str, wkt: str | None) -> str:
    """The header's JSON of an entry as stored (:func:`_encode`); a ValueError when it does not match its checksum."""
    checksum, text = stored[:CHECKSUM_DIGITS], stored[CHECKSUM_DIGITS:]
    if checksum != _checksum(path, version, text, wkt):
        raise ValueError(f"the entry of {path} does not match its checksum: the file is damaged")
    return text


def _decode(path: str, text: str, crs: CRS | None) -> CheckedHeader:
    """The header of :func:`_encode`'s text."""
    width, height, count, transform, blocks, dtypes, alpha, nodata, mask, driver, cut = json.loads(text)
    info = RasterInfo(
        path,
        int(width),
        int(height),
        int(count),
        crs,
        Affine(*transform),
        tuple((int(rows), int(cols)) for rows, cols in blocks),
        tuple(str(dtype) for dtype in dtypes),
        None if alpha is None else int(alpha),
        None if nodata is None else float(nodata),
        bool(mask),
        str(driver),
    )
    return info, (int(cut[0]), int(cut[1])) if cut is not None else None


class HeaderReads:
    """The headers of ``paths`` (the scenes' rasters, in the order the checks take them) read ahead by thread pools
    (see the module), through ``cache`` when given. :meth:`header` answers the checks: a path read ahead waits for
    its read (and raises its error), another is read then and there."""

    def __init__(self, paths: Iterable[str], cache: HeaderCache | None = None) -> None:
        self._order = list(dict.fromkeys(paths))
        self._index = {path: index for index, path in enumerate(self._order)}
        self._cache = cache
        self._next = 0  # the index in _order of the next path to read
        self._pending: OrderedDict[str, Future[CheckedHeader]] = OrderedDict()  # in the order of _order
        self._taken: OrderedDict[str, CheckedHeader] = OrderedDict()
        self._options = rasterio.env.getenv() if rasterio.env.hasenv() else {}  # the caller's rasterio.Env
        self._cwd = os.getcwd()
        self._pools: dict[bool, ThreadPoolExecutor] = {}  # by is_remote
        self._fill()

    def header(self, path: str) -> CheckedHeader:
        """``path``'s header and :func:`rasterscale.raster.headers.truncated_end`, as
        :func:`rasterscale.raster.headers.read_checked_header` gives them (its errors too)."""
        if path in self._taken:
            self._taken.move_to_end(path)
            return self._taken[path]
        future = self._pending.pop(path, None)
        if path in self._index:  # paths before it the checks passed by (a scene without its raster): reads dropped
            while self._pending and self._index[next(iter(self._pending))] < self._index[path]:
                self._pending.popitem(last=False)[1].cancel()
        self._fill()
        checked = future.result() if future is not None else self.read(path)
        self._taken[path] = checked
        while len(self._taken) > KEPT:
            self._taken.popitem(last=False)
        return checked

    def read(self, path: str) -> CheckedHeader:
        """One header, from the cache when it holds this version of it, else read (and kept)."""
        if self._options:
            with rasterio.Env(**self._options):
                return self._read(path)
        return self._read(path)

    def _read(self, path: str) -> CheckedHeader:
        cache = self._cache
        version = header_version(path) if cache is not None else None
        if cache is not None and version is not None:
            kept = cache.get(path, version)
            if kept is not None:
                return kept
        checked = read_checked_header(path)
        if cache is not None and version is not None:
            cache.put(path, version, checked)
        return checked

    def _fill(self) -> None:
        """Start reads in order until :data:`AHEAD` are pending."""
        while self._next < len(self._order) and len(self._pending) < AHEAD:
            path = self._order[self._next]
            self._next += 1
            remote = is_remote(path)
            if path not in self._taken and (remote or on_network_file_system(os.path.join(self._cwd, path))):
                self._pending[path] = self._pool(remote).submit(self.read, path)

    def _pool(self, remote: bool) -> ThreadPoolExecutor:
        if remote not in self._pools:
            workers, name = (REMOTE_WORKERS, "remote") if remote else (LOCAL_WORKERS, "local")
            self._pools[remote] = ThreadPoolExecutor(workers, thread_name_prefix=f"rasterscale-{name}-headers")
        return self._pools[remote]

    def close(self, wait: bool = True) -> None:
        """Cancel the reads not started, end the threads, and write the cache. ``wait``: for the reads still running
        (none once the checks took every header); not waited for (the checks stopped at an error), what they find is
        not kept."""
        for pool in self._pools.values():
            pool.shutdown(wait=wait, cancel_futures=True)
        self._pending.clear()
        if self._cache is not None:
            self._cache.close()


def on_network_file_system(path: str) -> bool:
    """Whether a local file (an absolute path) lies on a network file system (:data:`NETWORK_FILE_SYSTEMS`, from
    /proc/self/mounts; none where there is no such file), once per folder."""
    kind = _file_system(os.path.dirname(path))
    return kind.startswith(NETWORK_FILE_SYSTEMS)


@functools.lru_cache(maxsize=1024)
def _file_system(folder: str) -> str:
    """The type of the file system that holds ``folder`` (its real path's longest mount point); "" when unknown."""
    real = os.path.realpath(folder)
    found, kind = "", ""
    for point, fstype in _mounts():
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(found):
            found, kind = point, fstype
    return kind


@functools.lru_cache(maxsize=1)
def _mounts() -> tuple[tuple[str, str], ...]:
    """(mount point, file system type) of this process's mounts (Linux); none elsewhere."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ()
    mounts = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:  # a space in a mount point is written \040 (octal escapes)
            point = re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), fields[1])
            mounts.append((point, fields[2]))
    return tuple(mounts)


@contextlib.contextmanager
def plan_headers(paths: Iterable[str], cache_file: Path | None, warn: Callable[[str], None]) -> Iterator[HeaderReads]:
    """Within the block, this thread's header checks get their headers from a :class:`HeaderReads` of ``paths``,
    kept in ``cache_file`` when given (``warn``: its one warning when it cannot be read)."""
    cache = HeaderCache.open(cache_file, warn) if cache_file is not None else None
    reads = HeaderReads(paths, cache)
    try:
        with headers_from(reads.header):
            yield reads
    except BaseException:
        reads.close(wait=False)
        raise
    reads.close()
