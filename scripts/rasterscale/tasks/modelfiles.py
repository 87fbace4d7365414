"""Model files of any task, rasterscale's own payloads: which file a config starts from, reading a torch-saved
payload (torch imported only when there is a file to read: the one lazy import of torch of the workflow's plan) or
only its header (no torch), telling another task's model apart, and writing a payload atomically. Each task's
``modelfiles`` says what its payload holds.

What the detectors' files share beyond this (their configuration and header, DeepForest's model folders) is
:mod:`rasterscale.tasks.detectors.modelfiles`'."""

from __future__ import annotations

import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from rasterscale.atomic import atomic_path
from rasterscale.errors import InputError
from rasterscale.raster.bands import InputBands
from rasterscale.settings import Settings

C = TypeVar("C")


class NotATorchFile(InputError):
    """A file that torch cannot load as a whole torch-saved file of tensors and plain containers."""


def starting_model_file(settings: Settings) -> tuple[str | None, bool]:
    """The model file the config starts from and whether it is a starting point for training:
    (``model.file``, False) to predict with, (``train.init``, True) to fine-tune, or (None, False)."""
    predicted_with = settings.model.file
    if predicted_with:
        return predicted_with, False
    init = settings.train.init
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
    model, a bare state dict). A rasterscale file's payload is read from its header, without torch (a report job
    need not import it); another file is loaded with torch."""
    path = Path(path)
    if not path.is_file():
        return None
    payload = payload_header(path)
    if payload is None:
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
    details = " on ".join(str(model[key]) for key in ("architecture", "encoder", "backbone") if model.get(key))
    return (
        f"{_a(payload['task'])} model ({details or payload.get('format')}), but task is {task} "
        f"(set task: {payload['task']}, or give {_a(task)} model)"
    )


def _a(word: str) -> str:
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def task_payload(path: str | Path, task: str, file_format: str, not_ours: str) -> dict[str, Any]:
    """The payload of a ``task``'s own model file of ``file_format`` (tensors memory-mapped), with its model and
    state_dict; one-line InputError naming the file otherwise: missing, a folder or file of another task's (named),
    or ``not_ours`` (what the file is not)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: {task} model file not found")
    if path.is_dir():
        raise InputError(f"{path}: {other_tasks_model(path, None, task) or 'a folder, ' + not_ours}")
    try:
        payload = torch_payload(path)
    except InputError:
        raise InputError(f"{path}: {not_ours}") from None
    if isinstance(payload, Mapping) and payload.get("format") == file_format:
        if not isinstance(payload.get("model"), Mapping) or not isinstance(payload.get("state_dict"), Mapping):
            raise InputError(f"{path}: a {file_format} file without its model or state_dict")
        return dict(payload)
    raise InputError(f"{path}: {other_tasks_model(path, payload, task) or not_ours}")


def payload_config(path: str | Path, payload: Mapping[str, Any], from_dict: Callable[[Any], C], what: str) -> C:
    """The model configuration a payload records (``from_dict`` of its ``model``); a one-line InputError naming the
    file and ``what`` it is (``segmenter``, ``regressor``) otherwise."""
    try:
        return from_dict(payload["model"])
    except (KeyError, TypeError, ValueError) as err:
        raise InputError(f"{path}: bad {what} configuration ({err})") from None


def smp_config_dict(config: Any) -> dict[str, Any]:
    """A dense task's network configuration (a dataclass with ``labels``, ``decoder_channels`` and ``input``) as
    its model file records it: JSON lists and the input bands' dict."""
    data = asdict(config)
    data["labels"] = list(config.labels)
    data["decoder_channels"] = list(config.decoder_channels) if config.decoder_channels else None
    data["input"] = config.input.to_dict()
    return data


def smp_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """A dense task's recorded network configuration as its dataclass's fields: tuples, the input bands, and the
    encoder of files of before model.encoder (recorded as ``backbone``)."""
    fields = dict(data)
    if "backbone" in fields and "encoder" not in fields:
        fields["encoder"] = fields.pop("backbone")
    fields["labels"] = tuple(fields["labels"])
    if fields.get("decoder_channels") is not None:
        fields["decoder_channels"] = tuple(fields["decoder_channels"])
    fields["input"] = InputBands.from_dict(fields.get("input"))
    return fields


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


# --- a torch-saved payload's header, without torch ------------------------------------------------------------


@dataclass(frozen=True)
class TensorHeader:
    """A tensor of a torch-saved file, as its header describes it (the data is not read)."""

    shape: tuple[int, ...]
    dtype: str  # torch's storage type: FloatStorage, LongStorage, ...


class _HeaderUnpickler(pickle.Unpickler):
    """torch's zip format's ``data.pkl`` with each tensor rebuilt as a :class:`TensorHeader`: nothing but plain
    containers and torch's tensor rebuilders is looked up, and no storage is read."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _tensor_header
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, *_: data
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain payload")

    def persistent_load(self, pid: Any) -> Any:
        return pid  # ("storage", storage type, key, location, numel): the storage is never read


def _tensor_header(storage: Any, offset: int, size: Any, *_: Any) -> TensorHeader:
    dtype = storage[1] if isinstance(storage, tuple) and len(storage) > 1 else "?"
    return TensorHeader(tuple(int(n) for n in size), str(dtype))


def payload_header(path: Path) -> Any:
    """A torch-saved file's payload with its tensors as :class:`TensorHeader` (shape and storage type), read without
    torch from the zip format's pickle; None where that cannot be (torch's legacy format, objects other than plain
    containers and tensors: :func:`torch_payload` says what the file is)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [name for name in archive.namelist() if name.endswith("/data.pkl") and name.count("/") == 1]
            if len(names) != 1:
                return None
            with archive.open(names[0]) as pickled:
                return _HeaderUnpickler(pickled).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, OSError, IndexError):
        return None


def shapes_of(state_dict: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of a state dict (tensors, or :class:`TensorHeader`)."""
    return {k: tuple(v.shape) for k, v in state_dict.items()}


def model_file_error(path: str | Path, problem: str) -> InputError:
    """One line naming a model file and its problem."""
    return InputError(f"{path}: {problem}")
