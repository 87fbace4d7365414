"""One segmentation U-Net in each form a user brings it: rasterscale's own file (eager), TorchScript, a
torch.export program and ONNX (ONNX Runtime), each exported by ``scripts/export_model.py`` from the same file.

For each form, the real prediction job (one rank, its reading worker, ``precision: auto``) over the same scene,
and the form's pure forward over the job's tiles (preloaded, in the job's batches, at what ``auto`` gives here:
autocast for eager and TorchScript; a torch.export program and ONNX Runtime run in fp32 whatever the precision, as
the job runs them). The figures: the job's tiles/s (its rank's, from its profile), and the pipeline efficiency,
pure forward / job wall. ONNX Runtime's fp16 is measured where a GPU runs it (CUDA provider); on a CPU its fp16 and
bf16 kernels are too sparse to be worth a row.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # run alone: python bench/exported.py

from jobs import run_predict_job
from measures import autocast, read_tiles
from rasterscale.config.schema import validate_config
from rasterscale.grid.manifest import tiles_from_frame
from rasterscale.runtime.precision import choose, probe
from rasterscale.settings import job_settings, settings_of
from rasterscale.tasks.exported.card import FORMS
from rasterscale.tasks.registry import task_spec
from rasterscale.tools.export import export_model
from synthetic import write_scene

PATCH, OVERLAP = 256, 32
SUFFIXES = {"torchscript": "torchscript.pt", "torch.export": "pt2", "onnx": "onnx"}
TASK = "segmentation"


def write_unet(path: Path) -> Path:
    """rasterscale's U-Net segmenter (ResNet-18 encoder, RGB), untrained and seeded: speed does not depend on
    weights."""
    spec = task_spec(TASK).load()
    settings = settings_of(validate_config({"task": TASK, "tiling": {"patch_size": PATCH}}))
    torch.manual_seed(0)
    model_cfg = spec.model_config(settings)
    spec.save_model(spec.build_model(model_cfg), model_cfg, path)
    return path


def job_config(model_file: Path, batch: int, accelerator: str) -> dict[str, Any]:
    workers = 1 if accelerator == "cpu" else 4
    config = validate_config(
        {
            "task": TASK,
            "model": {"file": str(model_file)},
            "tiling": {"patch_size": PATCH, "overlap": OVERLAP},
            "predict": {"accelerator": accelerator, "devices": 1, "workers": workers, "batch_size": batch},
        }
    )
    return {key: config[key] for key in ("task", "model", "tiling", "predict")}


def forward_seconds(
    model: torch.nn.Module, images: list[torch.Tensor], batch: int, precision: str, device: torch.device
) -> float:
    """Seconds of the model's forward over every tile in the job's batches (already on ``device``), after one
    untimed batch."""
    batches = [torch.stack(images[start : start + batch]).to(device) for start in range(0, len(images), batch)]
    with torch.inference_mode(), autocast(precision, device.type):
        model(batches[0])
        synchronize(device)
        started = time.perf_counter()
        for tiles in batches:
            model(tiles)
        synchronize(device)
        return time.perf_counter() - started


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_form(
    form: str,
    path: Path,
    workdir: Path,
    raster: Path,
    manifest: Path,
    images: list[torch.Tensor],
    batch: int,
    accelerator: str,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One form's prediction job and pure forward (``config``: the job's, else :func:`job_config`'s); the result
    holds the job itself under ``job``."""
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    config = config or job_config(path, batch, accelerator)
    job = run_predict_job(workdir / f"job-{form.replace('.', '_')}", raster, manifest, path, {}, config=config)
    profile = job.profiles[0]
    precision = profile["precision"]
    if device.type == "cpu":
        torch.set_num_threads(profile["threads"])
    task = task_spec(TASK).load()
    settings = job_settings(config)
    model = task.prepare_for_inference(task.load_model(path, settings)[0], settings.predict).to(device)
    forward = forward_seconds(model, images, batch, precision, device)
    return {
        "tiles_per_s": round(profile["tiles_per_s"], 2),
        "job_wall_s": round(job.wall_s, 2),
        "forward_s": round(forward, 2),
        "efficiency": round(forward / job.wall_s, 4),
        "precision": precision if form in ("eager", "torchscript") else "32-true (its own dtype)",
        "tiles": job.tiles,
        "job": job,
    }


def measure_exported(workdir: Path, side: int, batch: int = 4, accelerator: str = "cpu") -> dict[str, Any]:
    """Each form's job and pure forward over one ``side`` x ``side`` scene (tiles of :data:`PATCH`), on one CPU
    rank or one GPU (``accelerator: gpu``)."""
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    workdir.mkdir(parents=True, exist_ok=True)
    raster, manifest, frame = write_scene(workdir, side, PATCH, OVERLAP)
    native = write_unet(workdir / "unet.pt")
    files = {"eager": native}
    for form in FORMS:
        files[form] = workdir / f"unet.{SUFFIXES[form]}"
        export_model(native, files[form], form)
    images = read_tiles(raster, tiles_from_frame(frame))
    forms: dict[str, Any] = {}
    for form, path in files.items():
        try:
            forms[form] = measure_form(form, path, workdir, raster, manifest, images, batch, accelerator)
            del forms[form]["job"]
        except Exception as err:  # a form that fails is its row's error; the others are still measured
            forms[form] = {"error": f"{type(err).__name__}: {str(err)[-600:]}"}
    fastest = max((form for form in forms if "error" not in forms[form]), key=lambda f: forms[f]["tiles_per_s"])
    return {
        "forms": forms,
        "fastest": fastest,
        "auto": choose(probe(accelerator)),
        "model": f"U-Net on resnet18 ({TASK}), {PATCH} px tiles, batch {batch}, 1 rank ({device.type})",
        "side": side,
    }


def main() -> None:
    """The measure alone (``make bench`` runs it within the whole bench): JSON to stdout."""
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--gpu", action="store_true", help="one GPU rank instead of one CPU rank")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exported-") as workdir:
        result = measure_exported(Path(workdir), args.side, args.batch, "gpu" if args.gpu else "cpu")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
