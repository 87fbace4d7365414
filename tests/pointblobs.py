"""A point model without training, and a scene whose points are known: bright round blobs on a dark ground, and a
user's exported heatmap network whose peaks are their centres (tests/test_exported_models.py's ONNX card,
tests/test_points_workflow.py's project across scene borders)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import rasterio
import torch

SPACING = 13  # px between blobs (before their jitter of 2 px): blobs 9 px apart or more, peaks of a 7 px window
PIXEL = 0.1  # m
ORIGIN = (404000.0, 3285000.0)  # UTM 17N


class HeatmapNet(torch.nn.Module):
    """A user's point model: a Gaussian blur of the bands' mean, then a sigmoid: a heatmap in [0, 1] whose peaks are
    the centres of bright round blobs (4 bands scaled to [0, 1] in)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(4, 1, 7, padding=3, bias=False))
        r = torch.arange(7, dtype=torch.float32) - 3
        kernel = torch.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / (2 * 1.5**2))
        with torch.no_grad():
            self.features[0].weight.copy_((kernel / kernel.sum() / 4).expand(1, 4, 7, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(12.0 * (self.features(x) - 0.4))


def blob_centres(width: int, height: int, start: int = 8, cut: tuple[int, int] | None = None) -> np.ndarray:
    """Blob centres (column, row; whole pixels) every :data:`SPACING` px from ``start`` with a jitter of up to 2 px;
    with ``cut`` (a column, a row), those of the grid's column and row on it alternate between the pixels either
    side of it (the last of one scene, the first of the next)."""
    rng = np.random.default_rng(5)
    centres = []
    for i, r in enumerate(range(start, height - 6, SPACING)):
        for j, c in enumerate(range(start, width - 6, SPACING)):
            x, y = c + int(rng.integers(-2, 3)), r + int(rng.integers(-2, 3))
            if cut is not None and c == cut[0]:
                x = c - i % 2
            if cut is not None and r == cut[1]:
                y = r - j % 2
            centres.append((x, y))
    return np.array(centres)


def blob_scene(path: Path, width: int, height: int, centres: np.ndarray) -> Path:
    """A 4-band GeoTIFF of blobs (sigma 2 px, 250 at their centre) at ``centres``, 0.1 m pixels in UTM 17N."""
    rows, cols = np.mgrid[0:height, 0:width]
    field = np.zeros((height, width))
    for c, r in centres:
        field = np.maximum(field, np.exp(-((cols - c) ** 2 + (rows - r) ** 2) / (2 * 2.0**2)))
    data = np.repeat((field * 250).astype(np.uint8)[None], 4, axis=0)
    profile = {"driver": "GTiff", "width": width, "height": height, "count": 4, "dtype": "uint8", "tiled": True}
    transform = rasterio.Affine(PIXEL, 0, ORIGIN[0], 0, -PIXEL, ORIGIN[1])
    profile.update(crs="EPSG:32617", transform=transform)
    with rasterio.open(path, "w", photometric="MINISBLACK", **profile) as dst:
        dst.write(data)
    return path


def export_onnx(net: torch.nn.Module, path: Path, patch: int) -> Path:
    """``net`` as an ONNX file of dynamic batch size (tiles of ``patch`` px)."""
    example = torch.rand(2, 4, patch, patch)
    dynamic = {"x": {0: torch.export.Dim("batch")}}
    with torch.no_grad():
        torch.onnx.export(net, (example,), str(path), input_names=["image"], output_names=["heatmap"], dynamo=True,
                          external_data=False, dynamic_shapes=dynamic)  # fmt: skip
    return path
