"""A small real scene for in-process prediction tests: a rasterio raster, its manifest and an untrained
RetinaNet model file at a low score threshold (plenty of boxes to compare)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from conftest import write_raster
from rasterscale.config.schema import validate_config
from rasterscale.grid.manifest import build_manifest, read_grid, write_manifest
from rasterscale.grid.tile import TileGrid
from rasterscale.predict.engine import run_prediction
from rasterscale.raster.imagery import resolve_spec
from rasterscale.runtime.ranks import RankLayout, resolve_precision
from rasterscale.scene import Scene
from rasterscale.settings import job_settings, settings_of
from rasterscale.tasks.detection.model import DetectorConfig, build_detector, save_detector

PREDICT_SECTIONS = ("task", "model", "tiling", "predict")  # the settings a prediction job carries


@dataclass(frozen=True)
class PredictScene:
    raster: Path
    manifest: Path
    model_file: Path
    tiles: int
    patch_size: int = 128
    overlap: int = 32

    @classmethod
    def make(cls, directory: Path, width: int = 400, height: int = 300) -> PredictScene:
        directory.mkdir(parents=True, exist_ok=True)
        raster = write_raster(directory / "scene.tif", width, height)
        manifest = build_manifest(raster, cls.patch_size, cls.overlap)
        write_manifest(
            manifest, resolve_spec(raster), TileGrid(cls.patch_size, cls.overlap), directory / "tiles.parquet"
        )
        torch.manual_seed(0)
        detector = DetectorConfig(backbone="resnet18", patch_size=cls.patch_size, score_threshold=0.0)
        save_detector(build_detector(detector), detector, directory / "model.pt")
        return cls(raster, directory / "tiles.parquet", directory / "model.pt", len(manifest))


def predict_rank_file(
    scene: PredictScene,
    out_dir: Path,
    strategy: str = "window",
    precision: str = "auto",
    channels_last: bool = True,
    batch_size: int = 3,
    workers: int = 1,
    model: dict | None = None,
) -> Path:
    """Predict the whole scene with one CPU rank, in this process; returns its rank file (its record is beside
    it: ``path.with_suffix(".json")``). ``model``: config keys
    of the model section (over a score threshold of 0)."""
    config = validate_config(
        {
            "task": "detection",
            "model": {"score_threshold": 0.0, **(model or {})},
            "tiling": {"patch_size": scene.patch_size, "overlap": scene.overlap},
            "predict": {
                "batch_size": batch_size,
                "workers": workers,
                "strategy": strategy,
                "channels_last": channels_last,
                "precision": precision,
            },
        }
    )
    resolution = resolve_precision("predict", precision, "cpu")
    run_prediction(
        [Scene("scene", str(scene.raster), str(scene.manifest))],
        scene.model_file,
        settings=job_settings({key: config[key] for key in PREDICT_SECTIONS}),  # what a prediction job carries
        layout=RankLayout("cpu", 1, 1, resolution.value, "predict", resolution),
        out_dir=out_dir,
        log_dir=out_dir / "logs",
    )
    return out_dir / "scene/rank-0.parquet"


def predict_crowns_in_process(raster: Path, manifest: Path, model_file: Path, out_dir: Path, model: dict) -> Path:
    """An instances scene predicted with one CPU rank in this process and merged as a merge job does; returns
    its crowns.parquet. ``model``: the model section's keys set (over the model file's)."""
    from rasterscale.tasks.instances.merge import merge_scene

    grid = read_grid(manifest)  # the tiling the manifest was cut with, as the prediction job's file carries it
    tiling = {"patch_size": grid.patch_size, "overlap": grid.overlap}
    config = validate_config({"task": "instances", "model": model, "tiling": tiling, "predict": {"workers": 0}})
    settings = settings_of(config)
    resolution = resolve_precision("predict", settings.predict.precision, "cpu")
    run_prediction(
        [Scene("scene", str(raster), str(manifest))],
        model_file,
        settings=job_settings({key: config[key] for key in PREDICT_SECTIONS}),
        layout=RankLayout("cpu", 1, 1, resolution.value, "predict", resolution),
        out_dir=out_dir,
        log_dir=out_dir / "logs",
    )
    parquet = out_dir / "crowns.parquet"
    merge_scene([out_dir / "scene/rank-0.parquet"], manifest, raster, out_dir / "crowns.gpkg", parquet, settings.merge)
    return parquet
