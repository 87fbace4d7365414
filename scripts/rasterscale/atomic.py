"""Atomic writes: a final path either holds a complete file or nothing; and a write that runs out of space ends with
one line naming the file (:class:`DiskFullError`), its temporaries removed.

Every writer here (and :func:`writing`, for files written outside them) turns a failure that comes of a full file
system into :class:`DiskFullError`, an input error (the user's to fix: :func:`rasterscale.errors.run_entry` and a
rank print its one line, ``rasterscale: {path}: no space left on device (...)``, no traceback). A failure comes of a
full file system (:func:`out_of_space`) when its error, or one it was raised from or while handling, says so
(errno ENOSPC or EDQUOT, or their words: pyarrow, safetensors, SQLite keep them), or when the file system is full
when the failure reaches the writer: the libraries that lose the errno (GDAL, whose libtiff says it on stderr
only; torch.save) leave what they wrote in the temporary until it is removed here, after that check. A writer
that may lose a failed write without raising at all (GDAL flushing a GeoTIFF when it closes it) passes
``silent_failures``: a file that leaves its file system full is then not moved into place.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rasterscale.errors import InputError

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# what errors say of them where the errno is lost: the C library's words (pyarrow, safetensors), SQLite's SQLITE_FULL
NO_SPACE_WORDS = tuple(text.lower() for text in (*map(os.strerror, NO_SPACE_ERRNOS), "database or disk is full"))
QUOTA = (frozenset({errno.EDQUOT}), (os.strerror(errno.EDQUOT).lower(),))  # what of them is a quota's
FULL_BELOW = 2**18  # bytes: a file system with less left is full (at ENOSPC it has none, or a block or two)
SQLITE_JOURNAL = "OGR_SQLITE_JOURNAL"  # GDAL's option: SQLite's journal mode for a GeoPackage it writes


class DiskFullError(InputError):
    """The file system of ``path`` ran out of space (or its quota) while the file was written: ``path`` holds no
    half-written file, and freeing space and running again writes it."""

    def __init__(self, path: str | Path, detail: str) -> None:
        self.path, self.detail = str(path), detail
        super().__init__(f"{path}: no space left on device ({detail}); free some space and run again")


def _existing_folder(path: str | Path) -> Path:
    """The folder of ``path``, or its nearest existing ancestor."""
    folder = Path(os.path.abspath(path)).parent
    while not folder.exists():
        folder = folder.parent
    return folder


def space_left(path: str | Path) -> int:
    """Bytes an unprivileged writer may still write beside ``path`` (on the file system of its nearest existing
    folder); 0 when the file system has no inode left."""
    stat = os.statvfs(_existing_folder(path))
    if stat.f_files and not stat.f_favail:
        return 0
    return stat.f_bavail * stat.f_frsize


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then the errors it was raised from or while handling."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _says(error: BaseException, errnos: frozenset[int], words: tuple[str, ...]) -> bool:
    """Whether an error is of one of ``errnos``, or (where a library kept only the words) says one of ``words``."""
    return (isinstance(error, OSError) and error.errno in errnos) or any(w in str(error).lower() for w in words)


def said_no_space(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from or while handling, is ENOSPC or EDQUOT."""
    return any(_says(e, NO_SPACE_ERRNOS, NO_SPACE_WORDS) for e in _chain(error))


def out_of_space(error: BaseException, path: str | Path, room: int = 0) -> bool:
    """Whether a write for ``path`` failed with ``error`` for lack of space: the error says so, or the file system
    has less than :data:`FULL_BELOW` left, plus ``room``: at most what the write needs of what a library removes
    again before it raises (an intermediate copy, an unfinished file it deletes)."""
    if said_no_space(error):
        return True
    try:
        return space_left(path) < FULL_BELOW + room
    except OSError:
        return False


def disk_full(path: str | Path, error: BaseException | None = None) -> DiskFullError:
    """The error of a write for ``path`` that ran out of space (``error``: what the writer raised, if it did)."""
    if error is not None and any(_says(e, *QUOTA) for e in _chain(error)):
        return DiskFullError(path, "disk quota exceeded")
    return DiskFullError(path, f"{_size(space_left(path))} left on {_mount_point(path)}")


def _size(count: int) -> str:
    units = ("bytes", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while power < len(units) - 1 and count >= 1024 ** (power + 1):
        power += 1
    return f"{count} bytes" if power == 0 else f"{count / 1024**power:.1f} {units[power]}"


def _mount_point(path: str | Path) -> Path:
    """The mount point of the file system ``path`` is (or would be) on."""
    folder = _existing_folder(path)
    while not os.path.ismount(folder):
        folder = folder.parent
    return folder


@contextlib.contextmanager
def writing(path: str | Path, room: int = 0, on_failure: Callable[[], None] | None = None) -> Iterator[None]:
    """Within the block, files are written for ``path`` (the file itself, or temporaries of it): an error that
    comes of their file system being full (:func:`out_of_space`, ``room`` as there) becomes a
    :class:`DiskFullError` naming ``path``, raised from it; an input error (already the user's one line, this one
    too) is left as it is. ``on_failure`` (a writer's abort: its temporaries removed) runs on any failure, after
    that check (while they still hold what they wrote); else whoever removes them does after the block."""
    try:
        yield
    except BaseException as err:
        full = isinstance(err, Exception) and not isinstance(err, InputError) and out_of_space(err, path, room)
        error = disk_full(path, err) if full else None
        if on_failure is not None:
            on_failure()
        if error is not None:
            raise error from err
        raise


def check_written(path: str | Path) -> None:
    """After a writer that may lose a failed write without raising (GDAL's GeoTIFF driver: libtiff says it on stderr
    only) closed a file of ``path``: a :class:`DiskFullError` naming ``path`` when the file system is full (the file
    may not be whole)."""
    if space_left(path) < FULL_BELOW:
        raise disk_full(path)


def temporary_sibling(path: str | Path) -> Path:
    """Where a file of ``path`` is written before it is moved into place: a hidden sibling of this process, with
    the same suffix (so drivers pick the right format)."""
    final = Path(path)
    return final.with_name(f".{final.stem}.tmp-{os.getpid()}{final.suffix}")


def move_into_place(tmp: Path, path: str | Path, silent_failures: bool = False) -> None:
    """Move a finished temporary to ``path`` (``silent_failures``: :func:`check_written` first)."""
    if silent_failures:
        check_written(path)
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_path(path: str | Path, room: int = 0, silent_failures: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (:func:`temporary_sibling`) and move it into place only when the block
    succeeds; on failure the temporary is removed. Running out of space on the way raises :class:`DiskFullError`
    naming ``path`` (``room``: as :func:`writing`'s; ``silent_failures``: the writer may lose a failed write
    without raising, :func:`check_written`)."""
    final = Path(path)
    tmp = temporary_sibling(final)
    try:
        with writing(final, room):
            final.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            move_into_place(tmp, final, silent_failures)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``path`` and move it into place when the block succeeds (a folder there is
    moved aside first, and removed after); on failure the temporary folder is removed. Running out of space on the
    way raises :class:`DiskFullError` naming ``path``."""
    final = Path(path)
    tmp: Path | None = None
    try:
        with writing(final):
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
            yield tmp
            _replace_folder(tmp, final)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _replace_folder(tmp: Path, target: Path) -> None:
    """Move a finished folder into place; an existing one is moved aside first and removed after."""
    aside = None
    if target.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, aside / target.name)
    os.replace(tmp, target)
    if aside is not None:
        shutil.rmtree(aside)


@contextlib.contextmanager
def atomic_gpkg(path: str | Path) -> Iterator[Path]:
    """:func:`atomic_path` of a GeoPackage that pyogrio (GeoPandas) writes, without SQLite's rollback journal: a
    temporary removed on failure needs none, and a write that fails keeps what it wrote until the file system is
    asked whether it ran full (with a journal, SQLite gives the space back first and says only that a commit
    failed). GDAL writes it: ``silent_failures``."""
    import pyogrio

    before = pyogrio.get_gdal_config_option(SQLITE_JOURNAL)
    pyogrio.set_gdal_config_options({SQLITE_JOURNAL: "OFF"})
    try:
        with atomic_path(path, silent_failures=True) as tmp:
            yield tmp
    finally:
        pyogrio.set_gdal_config_options({SQLITE_JOURNAL: before})


def write_json(data: Any, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_figure(figure: Any, path: str | Path, **savefig: Any) -> None:
    """Lay out a matplotlib figure, write it (PNG, ...) atomically, and close it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, **savefig)
    plt.close(figure)


def write_geoparquet(frame: Any, path: str | Path, **options: Any) -> None:
    """Write a GeoDataFrame as GeoParquet, atomically (``options``: GeoDataFrame.to_parquet's)."""
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False, **options)


def write_gpkg(frame: Any, path: str | Path, layer: str) -> None:
    """Write a GeoDataFrame as a one-layer GeoPackage, atomically (:func:`atomic_gpkg`)."""
    with atomic_gpkg(path) as tmp:
        frame.to_file(tmp, layer=layer, driver="GPKG")
