"""What a lent GPU machine needs for ``make bench-gpu`` beside its image (``make device-kit``): one xz tarball of
installed packages, ``.gpu-kit/site-cp312.tar.xz``.

That machine's image has its own Python 3.12, torch, torchvision, Lightning, NumPy, pandas, SciPy, matplotlib,
PyArrow and the rest that ``carry.txt`` does not name, and reaches no registry: what rasterscale needs beyond them
travels in the working tree (the device tool's ``carry``: 64 MiB in all, the tree included). As wheels they take 77
MiB (rasterio and pyogrio each bundle a GDAL); installed and packed with xz they take about 51. Each distribution
``carry.txt`` names is fetched at the version this environment holds (``envs/requirements.txt``'s pins and what
they resolved to) as a CPython 3.12 x86-64 manylinux wheel, without its dependencies (``carry.txt`` names every one
the image lacks), installed for that interpreter into one folder, and packed. ``bench/device/bench-gpu.sh`` unpacks
it there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CARRY = HERE / "carry.txt"
KIT = REPO / ".gpu-kit" / "site-cp312.tar.xz"
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none"]
# pip matches a manylinux tag exactly: the glibc versions these distributions' wheels are built for
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34)] + ["manylinux2014_x86_64", "any"]
TARGET += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
BUDGET_MB = 58.0  # of the 64 MiB that travel; the working tree takes the rest


def carried() -> list[str]:
    """``carry.txt``'s distribution names (one a line; ``#`` starts a comment)."""
    names = [line.split("#", 1)[0].strip() for line in CARRY.read_text().splitlines()]
    return [name for name in names if name]


def pinned(name: str) -> str:
    """``name==version`` at the version this environment holds."""
    try:
        return f"{name}=={version(name)}"
    except PackageNotFoundError:
        raise SystemExit(f"{CARRY}: {name!r} is not installed in {sys.prefix}: run make first") from None


def pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check", "--no-deps"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"pip {args[0]} for CPython 3.12 on x86-64 manylinux failed:\n{result.stderr[-3000:]}")


def pack(site: Path, kit: Path) -> None:
    """``site``'s files as ``kit`` (xz at its strongest preset: the libraries bundled twice share its window),
    written atomically."""
    kit.parent.mkdir(parents=True, exist_ok=True)
    partial = kit.with_name(kit.name + ".partial")
    with partial.open("wb") as out:
        tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "."], stdout=subprocess.PIPE)
        xz = subprocess.run(["xz", "-9", f"-T{os.cpu_count() or 1}"], stdin=tar.stdout, stdout=out)
        if tar.wait() != 0 or xz.returncode != 0:
            raise SystemExit(f"{kit}: tar or xz failed")
    partial.replace(kit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", default=str(KIT))
    kit = Path(parser.parse_args().kit)
    requirements = [pinned(name) for name in carried()]
    with tempfile.TemporaryDirectory(prefix="rasterscale-gpu-kit-") as scratch:
        wheels, site = Path(scratch) / "wheels", Path(scratch) / "site"
        pip("download", "--only-binary=:all:", *TARGET, "--dest", str(wheels), *requirements)
        files = sorted(str(wheel) for wheel in wheels.glob("*.whl"))
        pip("install", "--no-index", "--no-compile", "--only-binary=:all:", *TARGET, "--target", str(site), *files)
        pack(site, kit)
    size = kit.stat().st_size / 2**20
    print(f"{kit}: {size:.1f} MiB, {len(files)} distributions: {' '.join(requirements)}")
    if size > BUDGET_MB:
        raise SystemExit(f"{kit}: {size:.1f} MiB, over the {BUDGET_MB:.0f} MiB the working tree leaves it")


if __name__ == "__main__":
    main()
