"""The errors a user can fix, and the one-line exit: an entry script that fails on one of them prints one line
naming the file or key and the problem, not a traceback.

A message may name a raster by its URL, and a URL may carry secrets (``https://user:password@host/...``, a signed
URL's ``?X-Amz-Signature=...``, a SAS token): every user error redacts them (:func:`redact`), so no log and no
one-line error shows them."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

URL = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s/@'\"]+@)?(?P<rest>[^\s?#'\"]*)(?P<query>\?[^\s#'\"]*)?"
)
HIDDEN = "***"
TRAILING = ".,;:)]"


def _hide_query(query: str) -> str:
    """``?a=1&sig=x`` as ``?a=***&sig=***``: the parameters' names stay, their values go."""
    parts = [part for part in query[1:].split("&") if part]
    return "?" + "&".join(f"{part.split('=', 1)[0]}={HIDDEN}" if "=" in part else HIDDEN for part in parts)


def redact(text: str) -> str:
    """``text`` with the secrets of every URL in it hidden: the user info (``user:password@``) and the values of
    its query parameters (signatures, tokens). Idempotent; text without URLs is returned as it is."""
    if "://" not in text:
        return text

    def hide(match: re.Match[str]) -> str:
        user = f"{HIDDEN}@" if match["user"] else ""
        query, after = match["query"] or "", ""
        while query and query[-1] in TRAILING:  # the sentence's punctuation, not the URL's
            query, after = query[:-1], query[-1] + after
        return f"{match['scheme']}{user}{match['rest']}{_hide_query(query) if query else ''}{after}"

    return URL.sub(hide, text)


class InputError(ValueError):
    """A problem with an input file, worded as one line that names the file (URLs redacted)."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(redact(str(message)), *args)


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
    """A configuration problem, worded as one line that names the key (URLs redacted)."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(redact(str(message)), *args)
