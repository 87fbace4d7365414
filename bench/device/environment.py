"""What ``bench/device/bench-gpu.sh`` runs on: Python, the versions it imports, the GPUs, and that the bench's own
modules import (a missing wheel fails here, in seconds, not in the middle of the bench's device time)."""

from __future__ import annotations

import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = ["torch", "torchvision", "lightning", "numpy", "rasterio", "geopandas", "shapely", "pyproj"]
DISTRIBUTIONS += ["segmentation-models-pytorch", "timm", "onnxruntime"]


def installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def main() -> None:
    print(f"python {platform.python_version()} ({sys.executable})")
    print(" ".join(f"{name} {installed(name)}" for name in DISTRIBUTIONS))
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
        print(f"CUDA {torch.version.cuda}: {len(names)} GPU(s): {', '.join(names)}")
    else:
        print("CUDA: none visible (bench/gpu.py runs its short CPU run)")
    import rasterio

    print(f"GDAL {rasterio.__gdal_version__}")
    sys.path[:0] = [str(REPO / "bench"), str(REPO / "scripts")]
    try:
        import gpu  # noqa: F401  (the bench and every module it imports)
    except ImportError as err:
        fix = "add its distribution to bench/device/carry.txt"
        raise SystemExit(f"bench/gpu.py does not import here: {err}: {fix}") from None
    print("bench/gpu.py imports")


if __name__ == "__main__":
    main()
