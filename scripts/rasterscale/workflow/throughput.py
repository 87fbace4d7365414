"""What the dry run's cost estimate (:mod:`rasterscale.workflow.estimate`) divides the plan's work by: the last bench
result of each kind of device, kept in ``results/throughput.json`` (:func:`rasterscale.jobs.paths.throughput_file`),
else the documented defaults (:data:`DEFAULTS`, also in docs/performance.md).

``make bench`` (bench/run.py) records this CPU's entry, key ``cpu``, and ``make bench-gpu`` (bench/gpu.py) its GPU's,
keyed by the GPU's name; each writes its own entry and keeps the others (:func:`write_throughput`). An entry holds
what the bench's prediction job measured (tiles/s of all its ranks, the GPUs or CPU cores it ran on, its tile size,
precision and model) and, where the bench trained, its training job's images/s; the rates per device are derived here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from rasterscale.atomic import write_json

CPU = "cpu"  # an entry's kind, and the key of the CPU's entry
GPU = "gpu"


@dataclass(frozen=True)
class Throughput:
    """One device kind's rates as a bench measured them (or as documented: :data:`DEFAULTS`)."""

    kind: str  # CPU or GPU
    device: str  # the CPU's model or the GPU's name
    tiles_per_s: float  # the bench's prediction job, all its ranks together
    devices: int  # what that job ran on: its GPUs (a rank each), or its CPU cores (its ranks' threads)
    ranks: int
    patch_size: int  # px, of the bench's tiles
    overlap: int
    precision: str  # what its ranks ran at
    model: str
    date: str  # ISO 8601
    machine: str  # the host it ran on (and what it is)
    source: str  # the command that measured it: "make bench", "make bench-gpu"
    train_images_per_s: float | None = None  # the bench's training job, all its ranks together (none: not measured)
    train_devices: int = 0
    default: bool = False  # a documented figure (DEFAULTS), not a bench result of this machine or cluster

    @property
    def per_device(self) -> float:
        """Tiles/s of one GPU, or of one CPU core."""
        return self.tiles_per_s / self.devices

    @property
    def train_per_device(self) -> float | None:
        """Training images/s of one GPU or CPU core; None where the bench did not train."""
        if self.train_images_per_s is None or self.train_devices < 1:
            return None
        return self.train_images_per_s / self.train_devices

    @property
    def unit(self) -> str:
        """What one device is, in the estimate's words: a GPU's name, or a core of a CPU."""
        return self.device if self.kind == GPU else f"core of {self.device}"

    def provenance(self) -> str:
        """Where the figures come from: ``from make bench-gpu on node12, 2026-11-26`` or ``documented default: ...``."""
        where = f"{self.source} on {self.machine}, {self.date[:10]}"
        return f"documented default: {where}" if self.default else f"from {where}"

    def key(self) -> str:
        """Its key in the file: ``cpu``, or the GPU's name."""
        return CPU if self.kind == CPU else self.device

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["default"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Throughput:
        """An entry of the file; a ValueError naming what is wrong with it."""
        names = {f.name for f in fields(cls)} - {"default"}
        try:
            entry = cls(**{name: data[name] for name in names if name in data})
        except TypeError as err:
            raise ValueError(f"an entry lacks a field ({err})") from err
        if entry.kind not in (CPU, GPU) or not entry.tiles_per_s > 0 or entry.devices < 1:
            raise ValueError(f"entry {entry.key()!r}: kind, tiles_per_s or devices out of range")
        return entry


# The documented defaults (docs/performance.md, "Cost estimate"), used where no bench of this machine or cluster has
# recorded an entry of the kind: the latest make bench and make bench-gpu in docs/performance.md, both over
# DeepForest's model (RetinaNet-ResNet50, 400 px tiles).
DEFAULTS: dict[str, Throughput] = {
    # make bench's efficiency job (1024 tiles, one rank of 2 threads, auto: bf16-mixed): forward 182.2 s at in-loop
    # efficiency 0.941, so 193.6 s in the loop: 5.29 tiles/s on 2 cores
    CPU: Throughput(
        kind=CPU,
        device="AMD EPYC",
        tiles_per_s=5.29,
        devices=2,
        ranks=1,
        patch_size=400,
        overlap=80,
        precision="bf16-mixed",
        model="RetinaNet-resnet50, 400 px tiles",
        date="2026-11-24",
        machine="2 cores of an AMD EPYC with AVX512-BF16 (docs/performance.md)",
        source="make bench",
        default=True,
    ),
    # make bench-gpu's first run on a GPU (auto: bf16-mixed, batch 16): prediction 141.1 tiles/s, training 94.7
    # images/s (16 tiles a step), one rank each
    GPU: Throughput(
        kind=GPU,
        device="NVIDIA H200",
        tiles_per_s=141.1,
        devices=1,
        ranks=1,
        patch_size=400,
        overlap=80,
        precision="bf16-mixed",
        model="RetinaNet-resnet50, 400 px tiles seen at 800 px",
        date="2026-11-26",
        machine="one NVIDIA H200 (docs/performance.md)",
        source="make bench-gpu",
        train_images_per_s=94.7,
        train_devices=1,
        default=True,
    ),
}


def read_throughputs(path: str | Path) -> dict[str, Throughput]:
    """The entries of a throughput file by key (none when it does not exist); a ValueError when it is unreadable."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise ValueError(f"{path}: unreadable ({err})") from err
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return {key: Throughput.from_dict(entry) for key, entry in data.items()}
    except (ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a throughput file ({err})") from err


def first_throughputs(paths: Iterable[str | Path]) -> tuple[dict[str, Throughput], str]:
    """The entries of the first of ``paths`` that exists, and a note when one is unreadable (its entries are then
    left out, the next file or the defaults used)."""
    for path in paths:
        try:
            entries = read_throughputs(path)
        except ValueError as err:
            return {}, f"{err}: documented defaults used"
        if entries:
            return entries, ""
    return {}, ""


def write_throughput(entry: Throughput, path: str | Path) -> Path:
    """Write ``entry`` into the throughput file at ``path`` under its key, keeping the other entries (an unreadable
    file is replaced), atomically."""
    path = Path(path)
    try:
        entries = read_throughputs(path)
    except ValueError:
        entries = {}
    entries[entry.key()] = entry
    write_json({key: e.to_dict() for key, e in entries.items()}, path)
    return path


def predicting(entries: Mapping[str, Throughput], kind: str) -> Throughput:
    """The entry a prediction estimate of ``kind`` uses: the CPU's, or the GPU measured last; else the default."""
    measured = sorted((e for e in entries.values() if e.kind == kind), key=lambda e: e.date)
    return measured[-1] if measured else DEFAULTS[kind]


def training(entries: Mapping[str, Throughput], kind: str) -> Throughput | None:
    """The entry a training estimate of ``kind`` uses: the prediction's where it has a training rate, else the
    default's where that has one; None where neither has (make bench measures no training)."""
    chosen = predicting(entries, kind)
    if chosen.train_per_device is not None:
        return chosen
    default = DEFAULTS[kind]
    return default if default.train_per_device is not None else None
