"""A batch's heatmaps into points, on the rank's device (torch): a max-pool NMS (a peak is the highest value within
its window), a score threshold, then the batch's top-k, one tensor for the whole batch."""

from __future__ import annotations

import torch

# a decoded point's columns: its pixel (column, row) in the tile, its score and its class index
POINT_FIELDS = ("x", "y", "score", "label")


def window_max(heat: torch.Tensor, window: int) -> torch.Tensor:
    """Each pixel's maximum over the ``window`` x ``window`` square around it: a row's max-pool, then a column's
    (the same as one square max-pool, in 2 x window comparisons a pixel instead of window squared: 3.5x faster
    for a 17 px window on a CPU)."""
    pool = torch.nn.functional.max_pool2d
    rows = pool(heat, (1, window), stride=1, padding=(0, window // 2))
    return pool(rows, (window, 1), stride=1, padding=(window // 2, 0))


def decode_peaks(heat: torch.Tensor, window: int, threshold: float, top_k: int) -> torch.Tensor:
    """(B, K, H, W) probabilities -> (B, N, 4) float32 points (:data:`POINT_FIELDS`), N = min(top_k, K·H·W), best
    first: each pixel that is the highest of its ``window`` and scores at least ``threshold`` (a class's own
    peaks); the rest of the rows have score 0. One max-pool, one comparison and one top-k for the batch."""
    batch, _, height, width = heat.shape
    pooled = window_max(heat, window)
    peaks = torch.where((heat == pooled) & (heat >= threshold), heat, torch.zeros((), dtype=heat.dtype))
    flat = peaks.reshape(batch, -1)
    scores, index = flat.topk(min(top_k, flat.shape[1]), dim=1)
    plane = height * width
    label, rest = index // plane, index % plane
    return torch.stack([(rest % width).float(), (rest // width).float(), scores.float(), label.float()], dim=-1)
