"""The plan's raster headers (rasterscale.raster.header_cache): read in parallel by a thread pool, and kept across
invocations in .snakemake/rasterscale/headers.sqlite, so that a second dry run reads no header. Over local files and
a loopback HTTP server with Range support (tests/remote_servers.py's), which counts its requests, can delay its
answers and tells how many it answered at once. Each "invocation" here is a plan built in this process after what a
process keeps of headers is forgotten (rasterscale's per-process cache of local headers, GDAL's of remote files)."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import rasterio
from affine import Affine

from conftest import write_raster
from rasterscale.errors import InputError
from rasterscale.jobs import paths
from rasterscale.raster import header_cache, headers, vsi
from rasterscale.raster.headers import check_raster
from rasterscale.workflow.checks import build_plan
from rasterscale.workflow.storage import job_plan, plan_to_json
from remote_servers import RangeServer, _Handler

SIDE = 64  # the scenes' rasters: 64 x 64 px, 3-band uint8, one 128 px block (tiled)


class SlowServer(RangeServer):
    """A RangeServer that waits ``delay`` seconds (``delays[name]`` for a file of its own) before it answers a
    request, and records every request (method, path, User-Agent) and the most it was answering at once."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.delay = 0.0
        self.delays: dict[str, float] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.most_at_once = 0
        self._at_once = 0
        self._lock = threading.Lock()

    def start(self) -> SlowServer:
        server = self

        class Handler(_Handler):
            counter = self.counter
            budget = staticmethod(self._budget)

            def do_GET(self) -> None:
                server.answer(self, _Handler.do_GET)

            def do_HEAD(self) -> None:
                server.answer(self, _Handler.do_HEAD)

        self._server = ThreadingHTTPServer(
            ("127.0.0.1", self.port), functools.partial(Handler, directory=self.directory)
        )
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def answer(self, handler: Any, method: Callable[[Any], None]) -> None:
        path = handler.path.split("?", 1)[0]
        with self._lock:
            self.requests.append((handler.command, path, handler.headers.get("User-Agent", "")))
            self._at_once += 1
            self.most_at_once = max(self.most_at_once, self._at_once)
        try:
            time.sleep(self.delays.get(path.lstrip("/"), self.delay))
            method(handler)
        finally:
            with self._lock:
                self._at_once -= 1

    def reset(self) -> None:
        self.counter.reset()
        self.requests.clear()
        self.most_at_once = 0

    @property
    def heads(self) -> list[str]:
        return [path for method, path, _ in self.requests if method == "HEAD"]

    @property
    def paths(self) -> set[str]:
        return {path for _, path, _ in self.requests}

    @property
    def range_requests(self) -> list[tuple[str, str]]:
        return [(path, range_) for path, range_ in self.counter.ranges if range_]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    www = tmp_path_factory.mktemp("www")
    server = SlowServer(www).start()
    yield server
    server.stop()


@pytest.fixture
def workdir(tmp_path, monkeypatch, server):
    monkeypatch.chdir(tmp_path)
    server.reset()
    server.delay, server.delays = 0.0, {}
    return tmp_path


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The rasters whose headers are read (GDAL's name of each), in any thread: every real read of a header goes
    through headers.raster_info."""
    names: list[str] = []

    def counted(src: Any) -> headers.RasterInfo:
        names.append(str(src.name))
        return raster_info(src)

    raster_info = headers.raster_info
    monkeypatch.setattr(headers, "raster_info", counted)
    return names


@pytest.fixture
def reading_threads(monkeypatch, opened) -> list[str]:
    """The thread that read each header of ``opened``."""
    threads: list[str] = []

    def counted(src: Any) -> headers.RasterInfo:
        threads.append(threading.current_thread().name)
        return raster_info(src)

    raster_info = headers.raster_info
    monkeypatch.setattr(headers, "raster_info", counted)
    return threads


def new_process() -> None:
    """Forget what this process keeps of headers, as the next invocation (a new process) starts: rasterscale's
    local headers, GDAL's sizes and bytes of remote files."""
    headers._read_checked_header.cache_clear()
    headers._folder_names.cache_clear()
    assert vsi._gdal() is not None, "rasterio's GDAL library was not found"
    vsi.clear_cache()


def training_scene(workdir: Path) -> dict:
    """The trained scene every config has (a plan needs a model: this one is trained), local."""
    write_raster(workdir / "t.tif", 600, 600)
    (workdir / "t.csv").write_text("image_path,xmin,ymin,xmax,ymax,label\nt.tif,10,10,50,50,tree\n")
    return {"t": {"path": "t.tif", "annotations": "t.csv"}}


def config(workdir: Path, scenes: dict[str, str], **scene_keys: dict) -> dict:
    """The trained scene, then ``scenes`` (name: path or URL), every one predicted."""
    entries = {name: {"path": path, **scene_keys.get(name, {})} for name, path in scenes.items()}
    return {
        "scenes": {**training_scene(workdir), **entries},
        "tiling": {"patch_size": 128, "overlap": 16},
        "train": {"scenes": ["t"], "validation_fraction": 0.5},
        "predict": {"scenes": "all", "accelerator": "cpu"},
        "project": {"seams": False},
    }


def scene_raster(path: Path, index: int = 0, side: int = SIDE) -> Path:
    transform = Affine(0.1, 0, 404000.0 + 10 * index, 0, -0.1, 3285000.0)
    return write_raster(path, side, side, transform=transform)


def local_scenes(workdir: Path, count: int, prefix: str = "l") -> dict[str, str]:
    (workdir / "rasters").mkdir(exist_ok=True)
    return {f"{prefix}{k:02d}": str(scene_raster(workdir / "rasters" / f"{prefix}{k:02d}.tif", k).relative_to(workdir))
            for k in range(count)}  # fmt: skip


def remote_scenes(server: SlowServer, count: int, prefix: str) -> dict[str, str]:
    return {f"{prefix}{k:02d}": server.url(str(scene_raster(server.directory / f"{prefix}{k:02d}.tif", k).name))
            for k in range(count)}  # fmt: skip


def plan_twice(
    raw: dict, workdir: Path, opened: list[str], server: SlowServer
) -> tuple[str, list[str], str, list[str]]:
    """The plan of two invocations' dry runs (stored as JSON) and the headers each read; the server's records are
    the second's."""
    new_process()
    first = plan_to_json(build_plan(raw, workdir, cache_headers=True))
    read_first = list(opened)
    opened.clear()
    server.reset()
    new_process()
    second = plan_to_json(build_plan(raw, workdir, cache_headers=True))
    return first, read_first, second, list(opened)


# ---------------------------------------------------------------------------------------------------------
# (a) a second dry run reads no header
# ---------------------------------------------------------------------------------------------------------


def test_a_second_dry_run_reads_no_header_local_or_remote(workdir, server, opened):
    scenes = {**local_scenes(workdir, 6), **remote_scenes(server, 6, "a")}
    raw = config(workdir, scenes)
    first, read_first, second, read_second = plan_twice(raw, workdir, opened, server)
    assert len(read_first) == 13 and len(set(read_first)) == 13  # each raster's header once (the trained one too)
    assert (workdir / paths.HEADER_CACHE).is_file()
    assert read_second == []
    assert second == first  # the same plan from the kept headers: sizes, CRS, transforms, bands, footprints
    # the remote rasters: one HEAD each (GDAL asks for the size of a file it opens; here it tells the version),
    # and no range request: their headers are not fetched
    assert server.range_requests == [] and sorted(server.heads) == [f"/a{k:02d}.tif" for k in range(6)]
    assert len(server.requests) == 6


def test_the_kept_header_is_the_read_one(workdir, server):
    """Every field of a header the cache gives back equals the read one (CRS, transform, blocks, bands, mask,
    nodata, driver), and a truncated GeoTIFF's end is kept as found (its one-line error stays)."""
    masked = write_raster(workdir / "masked.tif", 40, 30, count=4, alpha=True, nodata=None)
    nodata = write_raster(workdir / "nodata.tif", 50, 20, nodata=0)
    cut = write_raster(workdir / "cut.tif", 300, 300, transform=Affine(0.5, 0, 1.0, 0, -0.5, 2.0))
    with open(cut, "r+b") as handle:
        handle.truncate(cut.stat().st_size - 1000)
    cache = header_cache.HeaderCache(workdir / "h.sqlite", warn=pytest.fail)
    for path in (str(masked), str(nodata), str(cut)):
        checked = headers.read_checked_header(path)
        cache.put(path, "v1", checked)
        cache.close()
        cache = header_cache.HeaderCache(workdir / "h.sqlite", warn=pytest.fail)
        assert cache.get(path, "v1") == checked and cache.get(path, "v2") is None
    assert cache.get(str(cut), "v1")[1] is not None  # type: ignore[index]
    cache.close()


def test_a_jobs_reparse_neither_reads_nor_writes_the_cache(workdir, server, opened):
    raw = config(workdir, local_scenes(workdir, 3))
    job_plan(raw, workdir)  # no plan stored: the job builds it, without the cache
    assert not (workdir / paths.HEADER_CACHE).exists() and len(opened) == 4


# ---------------------------------------------------------------------------------------------------------
# (b) a changed raster is read again, the others are not
# ---------------------------------------------------------------------------------------------------------


def test_a_changed_raster_is_read_again_and_only_it(workdir, server, opened):
    scenes = {**local_scenes(workdir, 4), **remote_scenes(server, 3, "b")}
    raw = config(workdir, scenes)
    new_process()
    build_plan(raw, workdir, cache_headers=True)
    # a local raster rewritten (another size and place), another given a sidecar file, a remote one replaced
    scene_raster(workdir / "rasters/l01.tif", index=7, side=SIDE + 16)
    (workdir / "rasters/l02.tif.aux.xml").write_text("<PAMDataset/>")
    remote = scene_raster(server.directory / "b02.tif", index=9, side=SIDE + 32)
    later = time.time() + 5  # a new Last-Modified (HTTP dates are whole seconds)
    os.utime(remote, (later, later))
    opened.clear()
    server.reset()
    new_process()
    plan = build_plan(raw, workdir, cache_headers=True)
    assert sorted(opened) == sorted(["rasters/l01.tif", "rasters/l02.tif", f"/vsicurl/{scenes['b02']}"])
    assert {path for path, _ in server.range_requests} == {"/b02.tif"}
    width = plan.footprints["l01"].bounds[2] - plan.footprints["l01"].bounds[0]
    assert width == pytest.approx((SIDE + 16) * 0.1)  # the new header, not the kept one
    assert plan.footprints["b02"].bounds[0] == pytest.approx(404000.0 + 90)
    opened.clear()
    new_process()
    build_plan(raw, workdir, cache_headers=True)
    assert opened == []  # the new versions replaced the old ones


# ---------------------------------------------------------------------------------------------------------
# (c) a cache that cannot be read
# ---------------------------------------------------------------------------------------------------------


def cached(workdir: Path) -> tuple[dict, str, Path]:
    """A config of three local scenes, its plan built without a cache (as JSON), and the cache file a build with
    one left."""
    raw = config(workdir, local_scenes(workdir, 3))
    new_process()
    expected = plan_to_json(build_plan(raw, workdir))  # no cache at all
    new_process()
    build_plan(raw, workdir, cache_headers=True)
    return raw, expected, workdir / paths.HEADER_CACHE


# a cache's bytes -> the bytes of it damaged, and SQLite's reason
DAMAGED_CACHES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "text": (lambda cache: b"not a database, " * 100, "file is not a database"),
    "random bytes": (lambda cache: random.Random(0).randbytes(len(cache)), "file is not a database"),
    "cut to a few bytes": (lambda cache: cache[:10], "file is not a database"),
    "cut to its first page": (lambda cache: cache[:4096], "database disk image is malformed"),
}


@pytest.mark.parametrize("damage", DAMAGED_CACHES)
def test_a_damaged_cache_warns_once_gives_the_plan_of_no_cache_and_is_made_again(workdir, server, opened, damage):
    """A cache that cannot be read at its opening (garbage in its place, cut short): one warning line, the plan the
    one built without a cache, and the file made again, which the next invocation reads every header from."""
    raw, expected, cache = cached(workdir)
    damaged, reason = DAMAGED_CACHES[damage]
    assert cache.stat().st_size > 4096  # more than its first page: cut, it misses tables
    cache.write_bytes(damaged(cache.read_bytes()))
    warnings: list[str] = []
    opened.clear()
    new_process()
    assert plan_to_json(build_plan(raw, workdir, warnings.append, cache_headers=True)) == expected
    assert len(opened) == 4  # every header read
    told = [line for line in warnings if "header cache" in line]
    assert told == [
        f"{cache}: the header cache cannot be read ({reason}); it is made again (every raster's header is read this "
        "time)"
    ]
    opened.clear()
    new_process()
    warnings.clear()
    assert plan_to_json(build_plan(raw, workdir, warnings.append, cache_headers=True)) == expected
    assert opened == [] and not [line for line in warnings if "header cache" in line]


def test_a_cache_cut_short_warns_once_and_gives_the_plan_of_no_cache(workdir, server, opened):
    """A cache cut to half its size (a copy interrupted, a disk that filled): one warning line, the plan equal to
    the one built without a cache, the file made again for the next run."""
    import sqlite3

    raw, expected, cache = cached(workdir)
    with sqlite3.connect(cache) as db:  # a cache with room to cut: rows of other rasters too
        db.executemany(
            "INSERT INTO headers (path, version, info) VALUES (?, 'v', ?)", [(f"x{n}", "x" * 400) for n in range(200)]
        )
    db.close()
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    warnings: list[str] = []
    opened.clear()
    new_process()
    plan = build_plan(raw, workdir, warnings.append, cache_headers=True)
    assert plan_to_json(plan) == expected and len(opened) == 4
    told = [line for line in warnings if "header cache" in line]
    assert len(told) == 1 and told[0].startswith(f"{cache}: the header cache cannot be read ("), told
    opened.clear()
    new_process()
    assert plan_to_json(build_plan(raw, workdir, cache_headers=True)) == expected and opened == []


@pytest.mark.parametrize(
    "change",
    [
        "UPDATE headers SET info = replace(info, '[64,64,3,', '[65,64,3,') WHERE path = 'rasters/l01.tif'",
        "DELETE FROM crs",
    ],
    ids=["a figure changed in place", "its CRSs lost"],
)
def test_an_entry_not_as_written_is_caught_by_its_checksum(workdir, server, opened, change):
    """What SQLite does not see (it checks its pages' structure, not what they hold): a header's figure changed in
    place (a flipped byte: the raster would read 65 px wide), the CRSs' rows lost (the rasters would read without
    a CRS). The entry's checksum catches it: one warning, the cache given up and removed, the plan of no cache."""
    import sqlite3

    raw, expected, cache = cached(workdir)
    with contextlib.closing(sqlite3.connect(cache)) as db, db:
        assert db.execute(change).rowcount > 0
    warnings: list[str] = []
    new_process()
    assert plan_to_json(build_plan(raw, workdir, warnings.append, cache_headers=True)) == expected
    told = [line for line in warnings if "header cache" in line]
    assert len(told) == 1 and told[0].startswith(f"{cache}: the header cache cannot be read (the entry of "), told
    assert told[0].endswith(
        "does not match its checksum: the file is damaged); it is removed, and made again by the next run"
    )
    assert not cache.exists()


@contextlib.contextmanager
def locked_by_another_process(file: Path) -> Iterator[None]:
    """Another process holds SQLite's exclusive lock on ``file`` (BEGIN EXCLUSIVE: no other connection reads or
    writes it) for the block (a stuck process: it lets go only when it is killed)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(file)], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.kill()
        holder.wait()


LOCK_HOLDER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_cache_locked_by_another_process_warns_once_and_is_left_to_it(workdir, server, opened, monkeypatch):
    """Another process holds the cache's lock (a stuck dry run): after LOCK_WAIT_S the plan goes on without the
    cache, one warning line, the plan equal, and the file is left to its holder (not removed)."""
    raw = config(workdir, local_scenes(workdir, 2))
    new_process()
    expected = plan_to_json(build_plan(raw, workdir, cache_headers=True))
    cache = workdir / paths.HEADER_CACHE
    with locked_by_another_process(cache):
        monkeypatch.setattr(header_cache, "LOCK_WAIT_S", 0.3)
        warnings: list[str] = []
        opened.clear()
        new_process()
        plan = build_plan(raw, workdir, warnings.append, cache_headers=True)
    assert plan_to_json(plan) == expected and len(opened) == 3 and cache.exists()
    told = [line for line in warnings if "header cache" in line]
    assert told == [
        f"{cache}: the header cache is locked by another process (database is locked for 0.3 s); every raster's "
        "header is read this time"
    ]


def test_a_cache_locked_after_its_opening_is_given_up_once_and_left_to_its_holder(workdir, monkeypatch):
    """Another process takes the lock while the plan reads the cache: the read waits RASTERSCALE_LOCK_WAIT_S (the
    environment's, over LOCK_WAIT_S), then the cache is given up for this run with one warning line (no second
    wait, no second line when the plan ends and would write), its file left to the holder as it was."""
    monkeypatch.setenv(header_cache.LOCK_WAIT_VARIABLE, "0.25")
    path = str(scene_raster(workdir / "a.tif"))
    cache_file = workdir / paths.HEADER_CACHE
    first = header_cache.HeaderCache.open(cache_file, pytest.fail)
    assert first is not None
    first.put(path, "v1", headers.read_checked_header(path))
    first.close()
    kept = cache_file.read_bytes()
    warnings: list[str] = []
    cache = header_cache.HeaderCache.open(cache_file, warnings.append)
    assert cache is not None and warnings == []
    with locked_by_another_process(cache_file):
        started = time.monotonic()
        assert cache.get(path, "v1") is None and cache.get(path, "v1") is None
        cache.put(path, "v2", headers.read_checked_header(path))
        cache.close()
        waited = time.monotonic() - started
    assert 0.25 <= waited < 5 and cache_file.read_bytes() == kept
    assert warnings == [
        f"{cache_file}: the header cache is locked by another process (database is locked for 0.25 s); the headers "
        "read are not kept this time"
    ]


def test_a_cache_of_another_format_is_emptied_silently(workdir, server, opened, monkeypatch):
    raw = config(workdir, local_scenes(workdir, 2))
    new_process()
    build_plan(raw, workdir, cache_headers=True)
    monkeypatch.setattr(header_cache, "FORMAT", "0")  # or of another GDAL or rasterio
    opened.clear()
    new_process()
    warnings: list[str] = []
    build_plan(raw, workdir, warnings.append, cache_headers=True)
    assert len(opened) == 3 and not [line for line in warnings if "header cache" in line]


# ---------------------------------------------------------------------------------------------------------
# (d) remote headers are read in parallel
# ---------------------------------------------------------------------------------------------------------


def test_remote_headers_are_read_at_once_with_gdals_settings(workdir, server, opened, reading_threads):
    """24 remote scenes whose every answer takes 0.2 s: the server answers several of the plan's requests at once.
    GDAL's settings apply in the reading threads: remote.py's (no folder listing, no side-car file requested: only
    the rasters are), and the caller's rasterio.Env (its User-Agent)."""
    scenes = remote_scenes(server, 24, "d")
    server.delay = 0.2
    new_process()
    with rasterio.Env(GDAL_HTTP_USERAGENT="rasterscale-test"):
        plan = build_plan(config(workdir, scenes))
    assert len(plan.footprints) == 25 and len(opened) == 25
    assert server.most_at_once > 1  # (a server's count may pass the pool's size by a request ending as one starts)
    remote_threads = set(reading_threads) - {"MainThread"}  # the trained scene's, local, is read by the checks
    assert 1 < len(remote_threads) <= header_cache.REMOTE_WORKERS
    files = [f"/d{k:02d}.tif" for k in range(24)]
    assert sorted({path for path, _ in server.range_requests}) == files and sorted(server.paths) == files
    assert {agent for _, _, agent in server.requests} == {"rasterscale-test"}
    assert not [thread.name for thread in threading.enumerate() if "headers" in thread.name]  # the pool ended


def test_local_headers_are_read_ahead_on_a_network_file_system_only(workdir, reading_threads, monkeypatch):
    """On a local disk a header read is CPU (threads beside the checks only slow them down): the checks' thread
    reads it. On a network file system (here one said to be NFS) its open waits on the network: read ahead."""
    raw = config(workdir, local_scenes(workdir, 6))
    new_process()
    build_plan(raw)
    assert reading_threads == ["MainThread"] * 7
    reading_threads.clear()
    new_process()
    header_cache._file_system.cache_clear()
    monkeypatch.setattr(header_cache, "_mounts", lambda: (("/", "ext4"), (str(workdir.parent), "nfs4")))
    build_plan(raw)
    header_cache._file_system.cache_clear()
    assert len(reading_threads) == 7 and all(name.startswith("rasterscale-local-headers") for name in reading_threads)


# ---------------------------------------------------------------------------------------------------------
# (e) errors in scene order
# ---------------------------------------------------------------------------------------------------------


def test_an_error_is_the_first_broken_scenes_line_whatever_read_ends_first(workdir, server):
    scenes = remote_scenes(server, 30, "e")
    (server.directory / "e07.tif").unlink()  # scene 7: gone (HTTP 404), and slow to say so
    server.delays = {"e07.tif": 0.6}
    (server.directory / "e20.tif").write_bytes(b"not a raster")  # scene 20: broken, told at once
    (workdir / "broken.tif").write_bytes(b"not a raster either")  # a local one after it, told at once too
    scenes["z"] = "broken.tif"
    new_process()
    serial = {}  # the errors read in series, outside a plan
    for name in ("e07", "e20", "z"):
        with pytest.raises(InputError) as err:
            check_raster(scenes[name])
        serial[name] = str(err.value)
    assert "HTTP response code: 404" in serial["e07"]
    # an earlier scene's error found by its check (not its header) comes first
    new_process()
    with pytest.raises(InputError) as err:
        build_plan(config(workdir, scenes, e02={"bands": [1, 2, 5]}))
    assert (
        str(err.value) == f"{scenes['e02']}: raster has 3 band(s); scenes.e02.bands [1, 2, 5] asks for band(s) 5 "
        "(bands are 1..3)"
    )
    new_process()
    with pytest.raises(InputError) as err:
        build_plan(config(workdir, scenes))
    assert str(err.value) == serial["e07"]
    (server.directory / "e07.tif").write_bytes((server.directory / "e08.tif").read_bytes())
    new_process()
    with pytest.raises(InputError) as err:
        build_plan(config(workdir, scenes))
    assert str(err.value) == serial["e20"]
