"""Model files of any task: which file a config starts from, reading a torch-saved payload (torch imported only
when there is a file to read: the one lazy import of torch of the workflow's plan), and writing a payload
atomically. Each task's ``modelfiles`` says what its payload holds."""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rasterscale.atomic import atomic_path
from rasterscale.errors import InputError


class NotATorchFile(InputError):
    """A file that torch cannot load as a whole torch-saved file of tensors and plain containers."""


def model_file(config: Mapping[str, Any]) -> tuple[str | None, bool]:
    """The model file the config starts from and whether it is a starting point for training:
    (``model.file``, False) to predict with, (``train.init``, True) to fine-tune, or (None, False)."""
    predicted_with = config.get("model", {}).get("file")
    if predicted_with:
        return predicted_with, False
    init = config.get("train", {}).get("init")
    return (init, True) if init else (None, False)


def torch_payload(path: Path) -> Any:
    """A torch-saved file, memory-mapped when it can be (zip format), never unpickling anything but tensors and
    plain containers; :class:`NotATorchFile` otherwise."""
    import torch  # lazy: a dry run reads a model file's header with torch only when there is a file

    for mmap in (True, False):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError as err:
            if mmap and "mmap" in str(err):  # the legacy (non-zip) serialization
                continue
            raise NotATorchFile(f"{path}: not a torch-saved file") from None
        except (pickle.UnpicklingError, EOFError, ValueError, OSError, IndexError, KeyError, TypeError):
            # what torch's unpickler raises on a file that is not (or no longer) a whole torch-saved file
            raise NotATorchFile(f"{path}: not a torch-saved file") from None
    raise AssertionError("unreachable")


def training_meta(path: str | Path) -> dict[str, Any] | None:
    """What a rasterscale model file records of its training (``meta``: steps, epochs, seconds, the precision it
    ran at, the batch plan, the last validation), or None for a file or folder that records none (a DeepForest
    model, a bare state dict)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        payload = torch_payload(path)
    except NotATorchFile:
        return None
    meta = payload.get("meta") if isinstance(payload, Mapping) else None
    return dict(meta) if isinstance(meta, Mapping) else None


def other_tasks_model(path: Path, payload: Any, task: str) -> str | None:
    """How to say that ``path`` holds another task's model (a payload that records its task, from
    :func:`save_payload`, or a DeepForest model folder), or None when it is no model of rasterscale's."""
    if path.is_dir():
        return f"a DeepForest model folder, but task is {task}" if (path / "config.json").exists() else None
    if not isinstance(payload, Mapping) or not payload.get("task") or payload["task"] == task:
        return None
    found = payload.get("model")
    model: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    details = " on ".join(str(model[key]) for key in ("architecture", "backbone") if model.get(key))
    return (
        f"a {payload['task']} model ({details or payload.get('format')}), but task is {task} "
        f"(set task: {payload['task']}, or give a {task} model)"
    )


def is_state_dict(value: Any) -> bool:
    """A non-empty mapping of tensors (torch is already imported where a payload was read)."""
    import torch

    return isinstance(value, Mapping) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


def save_payload(path: str | Path, file_format: str, model: Mapping[str, Any], module: Any, **extra: Any) -> None:
    """Write ``{"format", **extra, "model", "state_dict", "meta"}`` atomically: ``model`` the model's configuration,
    the weights of ``module`` (a DDP wrapper's ``.module``) on the CPU; ``extra``: the ``task`` that wrote it (which
    :func:`other_tasks_model` reads back) and ``meta``, training figures."""
    import torch  # lazy, as above: saving a model happens in a training job, which has torch

    module = getattr(module, "module", module)
    meta = extra.pop("meta", {})
    payload = {
        "format": file_format,
        **extra,
        "model": dict(model),
        "state_dict": {k: v.detach().cpu() for k, v in module.state_dict().items()},
        "meta": meta,
    }
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)
