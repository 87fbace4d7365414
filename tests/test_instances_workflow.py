"""Crown polygons (task instances) through the real workflow on the tiny config: synthesis, tiling, 2-rank DDP
training of a Mask R-CNN and prediction (CPU ranks over gloo), the merge by mask IoU, evaluation, the DeepForest
folder; then the same model predicted by 1 rank and by 2 shards of 3 ranks: the same crowns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
import rasterio
import torch
import yaml

from conftest import REPO, report
from prediction import predict_crowns_in_process
from rasterscale.tasks.instances.merge import CROWN_COLUMNS
from workflow import matched_polygons, rank_stems, rank_tile_ids, run_paths, run_workflow

pytestmark = pytest.mark.slow
TINY = REPO / "tests/configs/tiny_instances.yaml"
SCENE = "tiny_test"


def tiny_instances(**overrides: dict) -> dict:
    config = yaml.safe_load(TINY.read_text())
    for section, values in overrides.items():
        config[section] = {**config.get(section, {}), **values}
    return config


RUN = run_paths(tiny_instances()).root  # results/tiny_crowns: the run (model.name); a model.file's run keeps it


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tiny-instances")
    result = run_workflow(workdir, tiny_instances())
    return workdir, result


def crowns(workdir: Path) -> gpd.GeoDataFrame:
    return gpd.read_parquet(workdir / RUN / SCENE / "crowns.parquet")


def test_the_crown_layer_is_polygons_in_the_raster_crs_with_areas_and_perimeters(tiny_run):
    workdir, _ = tiny_run
    with rasterio.open(workdir / f"resources/demo/{SCENE}.tif") as src:
        crs, bounds, pixel = src.crs, src.bounds, src.res[0]
    parquet = crowns(workdir)
    gpkg = gpd.read_file(workdir / RUN / SCENE / "crowns.gpkg")
    assert len(parquet) > 20 and len(gpkg) == len(parquet)  # an untrained model at score 0.05: plenty to check
    for layer in (parquet, gpkg):
        assert layer.crs == crs and list(layer.columns) == CROWN_COLUMNS
    assert set(parquet.geometry.geom_type) == {"Polygon"} and parquet.geometry.is_valid.all()
    minx, miny, maxx, maxy = parquet.total_bounds
    assert bounds.left - pixel <= minx and maxx <= bounds.right + pixel
    assert bounds.bottom - pixel <= miny and maxy <= bounds.top + pixel
    np.testing.assert_allclose(parquet["area_m2"], parquet.geometry.area)  # metres: a UTM raster
    np.testing.assert_allclose(parquet["perimeter_m"], parquet.geometry.length)
    assert (np.diff(parquet["score"].to_numpy()) <= 0).all()


def test_every_tile_processed_exactly_once_by_the_two_ranks(tiny_run):
    workdir, _ = tiny_run
    manifest = gpd.read_parquet(workdir / RUN / SCENE / "tiles.parquet")
    assert [stem.name for stem in rank_stems(workdir / RUN, SCENE)] == ["rank-0", "rank-1"]
    processed = rank_tile_ids(workdir / RUN, SCENE)
    assert all(processed)
    assert sorted(np.concatenate(processed).tolist()) == sorted(manifest["tile_id"].tolist())


def test_training_is_ddp_with_the_batch_plan_and_writes_a_deepforest_maskrcnn_folder(tiny_run):
    workdir, _ = tiny_run
    log = (workdir / "logs/train/tiny_crowns.log").read_text()
    assert "world_size=2" in log and "per_device_batch=2" in log and "effective_batch=4" in log
    assert "Mask R-CNN resnet18" in log
    folder = workdir / "results/models/tiny_crowns"
    config = json.loads((folder / "config.json").read_text())
    assert config["label_dict"] == {"tree": 0} and config["num_classes"] == 1
    metrics = (workdir / "results/models/tiny_crowns.metrics.csv").read_text().splitlines()[0]
    assert "val_f1" in metrics and "train_loss_mask" in metrics


def test_the_deepforest_folder_holds_the_model_files_weights(tiny_run):
    """The folder is read back as the same model as the .pt file (its layout against DeepForest's class:
    tests/test_instances_model.py)."""
    from rasterscale.tasks.instances.model import load_instance_model

    workdir, _ = tiny_run
    model, cfg, _ = load_instance_model(workdir / "results/models/tiny_crowns")
    pt_model, pt_cfg, _ = load_instance_model(workdir / "results/models/tiny_crowns.pt")
    state, pt_state = model.state_dict(), pt_model.state_dict()
    assert state.keys() == pt_state.keys()
    weights = [key for key in state if not key.endswith("num_batches_tracked")]  # a step counter: not in the folder
    assert len(weights) > 100 and all(torch.equal(state[k], pt_state[k]) for k in weights)
    assert cfg == pt_cfg


def test_evaluation_scores_mask_iou_and_splits_tile_edges_from_the_rest(tiny_run):
    workdir, result = tiny_run
    metrics = json.loads((workdir / RUN / SCENE / "evaluation.json").read_text())
    assert {"precision", "recall", "f1", "map50", "edge", "interior"} <= set(metrics)
    assert (workdir / RUN / SCENE / "quicklook.png").stat().st_size > 0
    report(
        f"[instances tiny run, 3 training steps] F1 at mask IoU 0.5: crowns crossing an inner tile edge "
        f"{metrics['edge']['f1']:.3f}, the others {metrics['interior']['f1']:.3f}"
    )
    assert "mask_ap50=" in result.stdout + result.stderr


def test_one_rank_and_two_shards_of_three_ranks_give_the_crowns_of_two(tiny_run, tmp_path):
    """The same model over the same scene: one rank (in this process, merged as a merge job does), two shard jobs
    of three ranks each (the workflow: six rank files, merged across ranks and shards), and the tiny run's two ranks
    give the same crowns."""
    workdir, _ = tiny_run
    model = workdir / "results/models/tiny_crowns.pt"
    two = crowns(workdir)
    keys = {key: tiny_instances()["model"][key] for key in ("score_threshold", "detections_per_tile")}
    raster, manifest = workdir / f"resources/demo/{SCENE}.tif", workdir / RUN / SCENE / "tiles.parquet"
    one = gpd.read_parquet(predict_crowns_in_process(raster, manifest, model, tmp_path / "one", keys))
    shutil.copytree(workdir / "resources", tmp_path / "shards/resources")  # the tiny run's scenes, not made again
    predict = {"devices": 3, "shards": 2}
    config = tiny_instances(model={"file": str(model)}, train={"scenes": []}, predict=predict)
    layer = run_paths(config).scene_file(SCENE, "crowns.parquet")
    run_workflow(tmp_path / "shards", config, layer)  # the layer alone: no scores, quicklooks or report pages
    stems = rank_stems(tmp_path / "shards" / RUN, SCENE)
    assert [(stem.parent.parent.name, stem.name) for stem in stems] == [
        (f"shard-{r // 3}", f"rank-{r}") for r in range(6)
    ]
    shards = crowns(tmp_path / "shards")
    assert len(two) > 20
    for name, other in (("1 rank", one), ("2 shards x 3 ranks", shards)):
        assert len(other) == len(two), name
        assert matched_polygons(other, two, 0.99) == 1.0 and matched_polygons(two, other, 0.99) == 1.0, name
        np.testing.assert_allclose(np.sort(other["score"]), np.sort(two["score"]), rtol=1e-5)
