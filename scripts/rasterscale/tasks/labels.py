"""Class names as a task's ground truth gives them, mapped to the model's class indexes (one line naming the file for
a name the model does not know).

Names match ``model.labels`` whatever their case, as fine-tuning a model file matches its classes: DeepForest's
CSVs say ``Tree`` where the default labels say ``tree``. The model's spelling is what the outputs keep; each mapping
that changes a name's case is logged once per process. (Labels that differ only in case are refused with the config:
``model.labels`` cannot hold both ``Tree`` and ``tree``.)"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from rasterscale.errors import InputError

LOGGER = logging.getLogger(__name__)
_logged: set[tuple[tuple[str, str], ...]] = set()  # the case mappings already logged by this process


def label_indexes(path: str, names: np.ndarray, labels: list[str]) -> np.ndarray:
    """Class names -> 0-based indexes into ``labels``, matched exactly or else without regard to case; an unknown
    name fails with one line."""
    exact = {name: k for k, name in enumerate(labels)}
    folded: dict[str, int] = {}
    for k, name in enumerate(labels):
        folded.setdefault(name.casefold(), k)
    index = {}
    for name in set(names.tolist()):
        found = exact.get(name, folded.get(str(name).casefold()))
        if found is not None:
            index[name] = found
    unknown = sorted(set(names.tolist()) - set(index))
    if unknown:
        raise InputError(f"{path}: label(s) {', '.join(unknown)} are not in model.labels ({', '.join(labels)})")
    log_case_mapping(path, [(name, labels[k]) for name, k in index.items() if name != labels[k]])
    return np.array([index[name] for name in names.tolist()], dtype=np.int64)


def log_case_mapping(path: str, pairs: Sequence[tuple[str, str]]) -> None:
    """One line for the names of a file that match a label of another case (once per process and mapping)."""
    mapping = tuple(sorted(pairs))
    if not mapping or mapping in _logged:
        return
    _logged.add(mapping)
    shown = ", ".join(f"{name} -> {label}" for name, label in mapping)
    LOGGER.info("%s: label(s) matched to model.labels regardless of case: %s (outputs name them so)", path, shown)
