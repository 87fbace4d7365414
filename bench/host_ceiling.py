"""The host ceiling: how fast a prediction job can go when the model costs nothing.

A null model (a TorchScript 1x1 convolution with a card: 2 class logits for segmentation, 1 value for regression)
predicts a ``side`` x ``side`` RGB scene in 256 px tiles on one rank, for ``predict.workers`` 0, 1 and 2. Whatever
the job achieves here is the most any accelerator can get out of the host path (reading, the rank's loop, blending,
writing): its tiles/s per rank and per core, and its stage timeline (the rank profile's ``stages``, and the reading
workers' seconds) saying where the time goes. Beside it, the whole job's wall (process start to exit) and the
rank's prediction wall. ``make bench`` runs it on the CPU (workers 0, 1, 2), ``make bench-gpu`` on a GPU (the
rank's own worker count) beside the U-Net's job and pure forward (:func:`measure_unet_job`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # run alone: python bench/host_ceiling.py

from exported import measure_form, write_unet
from jobs import run_predict_job
from measures import read_tiles
from rasterscale.config.schema import validate_config
from rasterscale.grid.manifest import tiles_from_frame
from rasterscale.jobs.profile import STAGES
from rasterscale.tasks.exported.card import card_path
from synthetic import write_scene

PATCH, OVERLAP, BATCH = 256, 32, 32
TASKS = {"segmentation": (["background", "tree"], "logits"), "regression": (["height"], "values")}


class NullNet(torch.nn.Module):
    """A 1x1 convolution: the cheapest network that gives a dense output of the card's shape."""

    def __init__(self, outputs: int) -> None:
        super().__init__()
        self.head = torch.nn.Conv2d(3, outputs, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def write_null_model(path: Path, task: str) -> Path:
    """The null model of ``task`` as TorchScript, with its card beside it."""
    labels, output = TASKS[task]
    torch.manual_seed(0)
    net = NullNet(len(labels)).eval()
    with torch.no_grad():
        torch.jit.save(torch.jit.trace(net, torch.rand(2, 3, PATCH, PATCH)), str(path))
    card = {"task": task, "labels": labels, "bands": ["red", "green", "blue"], "tile_size": PATCH, "output": output}
    card_path(path).write_text(yaml.safe_dump(card))
    return path


def job_config(task: str, model: Path, workers: int | None, accelerator: str, batch: int = BATCH) -> dict[str, Any]:
    """A job of ``model``: one rank, batches of ``batch``, ``workers`` readers (None: the rank's own choice from its
    cores)."""
    predict = {"accelerator": accelerator, "devices": 1, "batch_size": batch}
    if workers is not None:
        predict["workers"] = workers
    config = validate_config(
        {
            "task": task,
            "model": {"file": str(model)},
            "tiling": {"patch_size": PATCH, "overlap": OVERLAP},
            "predict": predict,
        }
    )
    return {key: config[key] for key in ("task", "model", "tiling", "predict")}


def measure_host_ceiling(
    workdir: Path, side: int, workers: tuple[int | None, ...] = (0, 1, 2), accelerator: str = "cpu"
) -> dict[str, Any]:
    """Each task's null-model job per worker count: tiles/s of the rank, per core, the job's wall, and the stages."""
    workdir.mkdir(parents=True, exist_ok=True)
    raster, manifest, frame = write_scene(workdir, side, PATCH, OVERLAP)
    cores = len(os.sched_getaffinity(0))
    rows: dict[str, Any] = {}
    for task in TASKS:
        model = write_null_model(workdir / f"null-{task}.pt", task)
        for count in workers:
            config = job_config(task, model, count, accelerator)
            job = run_predict_job(workdir / f"{task}-w{count}", raster, manifest, model, {}, config=config)
            profile = job.profiles[0]
            rows[f"{task}/workers={'auto' if count is None else count}"] = {
                "tiles_per_s": round(profile["tiles_per_s"], 1),
                "tiles_per_s_per_core": round(profile["tiles_per_s"] / cores, 1),
                "rank_wall_s": round(profile["wall_s"], 2),
                "job_wall_s": round(job.wall_s, 2),
                "stages": {stage: profile["stages"][stage] for stage in STAGES},
                "read_s": profile["parallel"]["read"],
                "workers": profile["workers"],
            }
    return {
        "rows": rows,
        "tiles": len(frame),
        "cores": cores,
        "side": side,
        "model": f"null model (TorchScript 1x1 conv), {PATCH} px tiles, overlap {OVERLAP}, batch {BATCH}, 1 rank",
    }


def measure_unet_job(workdir: Path, side: int, batch: int, accelerator: str = "gpu") -> dict[str, Any]:
    """rasterscale's U-Net segmenter (ResNet-18, untrained, seeded) over a ``side`` x ``side`` scene of 256 px tiles:
    its prediction job on one rank (its own worker count, ``precision: auto``) against its pure forward over the
    same tiles preloaded on the device, in the job's batches (:func:`exported.measure_form`, the eager form)."""
    workdir.mkdir(parents=True, exist_ok=True)
    raster, manifest, frame = write_scene(workdir, side, PATCH, OVERLAP)
    model = write_unet(workdir / "unet.pt")
    images = read_tiles(raster, tiles_from_frame(frame))
    config = job_config("segmentation", model, None, accelerator, batch)
    run = measure_form("eager", model, workdir, raster, manifest, images, batch, accelerator, config)
    job = run.pop("job")
    return {
        **run,
        "forward_tiles_per_s": round(run["tiles"] / run["forward_s"], 1),
        # the rank's tiles/s over the pure forward's (run["efficiency"]: the forward over the whole job's wall)
        "job_over_forward": round(run["tiles_per_s"] * run["forward_s"] / run["tiles"], 4),
        "stages": {stage: job.profiles[0]["stages"][stage] for stage in STAGES},
        "read_s": job.profiles[0]["parallel"]["read"],
        "workers": job.profiles[0]["workers"],
        "batch": batch,
        "side": side,
    }


def main() -> None:
    """The measure alone (``make bench`` runs it within the whole bench): JSON to stdout."""
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=6144)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--gpu", action="store_true", help="one GPU rank instead of one CPU rank")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="host-ceiling-") as workdir:
        result = measure_host_ceiling(Path(workdir), args.side, tuple(args.workers), "gpu" if args.gpu else "cpu")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
