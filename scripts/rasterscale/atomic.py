"""Atomic writes: a final path either holds a complete file or nothing."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (same suffix, so drivers pick the right format) and move it
    into place only when the block succeeds; on failure the temporary is removed."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.stem}.tmp-{os.getpid()}{final.suffix}")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


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
    """Write a GeoDataFrame as a one-layer GeoPackage, atomically."""
    with atomic_path(path) as tmp:
        frame.to_file(tmp, layer=layer, driver="GPKG")
