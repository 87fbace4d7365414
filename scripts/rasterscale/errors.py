"""The errors a user can fix, and the one-line exit: an entry script that fails on one of them prints one line
naming the file or key and the problem, not a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable


class InputError(ValueError):
    """A problem with an input file, worded as one line that names the file."""


class RasterReadError(InputError):
    """Pixels of a raster that will not decode where they are read (run time: its header was fine)."""


def one_line(error: BaseException) -> str:
    """An input error's one line, also when a dataloader worker raised it: PyTorch re-raises a worker's exception
    in the rank with the worker's traceback as its message, the original line last."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught "):
        return lines[-1].split("Error: ", 1)[-1]
    return lines[0] if lines else type(error).__name__


def run_entry(main: Callable[[], None]) -> None:
    """Run a one-process job's entry: an input error (the user's to fix: a damaged block of a raster, a bad class
    id) ends it with exit 1 and its one line, ``rasterscale: ...``, in the rule's log, not a traceback. (A rank
    logs it so too, with its traceback in the rank's own log: ``runtime``.)"""
    try:
        main()
    except InputError as err:
        sys.stderr.write(f"rasterscale: {one_line(err)}\n")
        sys.exit(1)


def innermost_cause(error: BaseException) -> str:
    """The first line of the deepest exception in ``error``'s cause chain (GDAL's own words)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error).splitlines()[0] if str(error) else type(error).__name__


class ConfigError(ValueError):
    """A configuration problem, worded as one line that names the key."""
