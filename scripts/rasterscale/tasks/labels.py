"""Class names as a task's ground truth gives them, mapped to the model's class indexes (one line naming the file for
a name the model does not know)."""

from __future__ import annotations

import numpy as np

from rasterscale.errors import InputError


def label_indexes(path: str, names: np.ndarray, labels: list[str]) -> np.ndarray:
    """Class names -> 0-based indexes into ``labels``; an unknown name fails with one line."""
    unknown = sorted(set(names) - set(labels))
    if unknown:
        raise InputError(f"{path}: label(s) {', '.join(unknown)} are not in model.labels ({', '.join(labels)})")
    index = {name: k for k, name in enumerate(labels)}
    return np.array([index[name] for name in names], dtype=np.int64)
