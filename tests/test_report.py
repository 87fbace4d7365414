"""The report's renderings on real files, without the workflow (the workflow's report is tested in test_workflow.py
and test_segmentation_workflow.py): the project map's footprints and counts from real rasters, in one CRS or
several; what a scene's merged output holds, counted from real layers; the pages' tables."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import rasterio
from affine import Affine
from PIL import Image
from rasterio.warp import transform_bounds

from conftest import write_raster
from rasterscale.jobs.files import ProjectMapJob
from rasterscale.settings import job_settings
from rasterscale.tasks.detectors.merge import count_labels as count_detections
from rasterscale.tasks.segmentation import NODATA_CLASS
from rasterscale.tasks.segmentation.merge import count_classes
from rasterscale.tasks.segmentation.metrics import iou_scores
from rasterscale.tools.report import map_outlines, plot_project_map, profile_page, scores_page, table
from workflow import table_rows


def scene_entry(tmp_path, name, roles, total=None, **raster) -> dict:
    path = write_raster(tmp_path / f"{name}.tif", **raster)
    counts = ""
    if total is not None:
        counts = str(tmp_path / f"{name}.counts.json")
        (tmp_path / f"{name}.counts.json").write_text(json.dumps({"unit": "detections", "total": total}))
    return {"name": name, "raster": str(path), "roles": roles, "counts": counts}


def test_project_map_puts_scenes_of_two_crss_on_one_map_in_longitude_and_latitude(tmp_path):
    """Three scenes, two in UTM 17N, one in Web Mercator some 70 km away: their outlines come back in EPSG:4326 on
    each raster's bounds, with their roles and counts, and the map is drawn."""
    scenes = [
        scene_entry(tmp_path, "north", ["predict"], 1200, width=400, height=300),
        scene_entry(
            tmp_path,
            "east",
            ["train", "predict"],
            35,
            width=200,
            height=200,
            transform=Affine(0.5, 0, 404200.0, 0, -0.5, 3285000.0),
        ),
        scene_entry(
            tmp_path,
            "mercator",
            ["train"],
            width=100,
            height=100,
            crs="EPSG:3857",
            transform=Affine(2.0, 0, -9070000.0, 0, -2.0, 3380000.0),
        ),
    ]
    crs, footprints = map_outlines(ProjectMapJob(tuple(scenes), job_settings({"task": "detection"})))
    assert crs.to_epsg() == 4326
    assert [(f.name, f.roles, f.count) for f in footprints] == [
        ("north", ("predict",), 1200),
        ("east", ("train", "predict"), 35),
        ("mercator", ("train",), None),
    ]
    for scene, footprint in zip(scenes, footprints, strict=True):
        with rasterio.open(scene["raster"]) as src:
            west, south, east, north = transform_bounds(src.crs, "EPSG:4326", *src.bounds, densify_pts=21)
        (x0, y0), (x1, y1) = footprint.outline.min(axis=0), footprint.outline.max(axis=0)
        assert np.allclose([x0, y0, x1, y1], [west, south, east, north], atol=1e-7)
    png = tmp_path / "map.png"
    plot_project_map(crs, footprints, "detections", png)
    with Image.open(png) as image:
        image.load()
        assert image.size == (1000, 800)
        assert len(image.getcolors(1 << 20) or []) > 100  # a drawing, not a blank


def test_project_map_keeps_the_scenes_own_crs_when_they_share_one(tmp_path):
    scenes = [
        scene_entry(tmp_path, "a", ["predict"], 7, width=256, height=256),
        scene_entry(
            tmp_path, "b", ["predict"], 0, width=256, height=128, transform=Affine(0.1, 0, 404030, 0, -0.1, 3285000)
        ),
    ]
    crs, footprints = map_outlines(ProjectMapJob(tuple(scenes), job_settings({"task": "detection"})))
    assert crs.to_epsg() == 32617
    outline = footprints[1].outline
    assert np.allclose([*outline.min(axis=0), *outline.max(axis=0)], [404030, 3284987.2, 404055.6, 3285000])


def test_a_merged_layers_detections_are_counted_per_label_with_the_labels_it_has_none_of(tmp_path):
    path = tmp_path / "detections.parquet"
    pd.DataFrame({"label": ["tree", "tree", "snag", "tree", "shrub"], "score": np.linspace(0.1, 0.9, 5)}).to_parquet(
        path
    )
    assert count_detections(path, ["tree", "snag", "stump"]) == {"tree": 3, "snag": 1, "stump": 0, "shrub": 1}


@pytest.mark.parametrize(("labels", "counted"), [(["background", "tree"], ["tree"]), (["soil", "tree"], None)])
def test_a_class_maps_pixels_are_counted_per_class_without_background_and_no_data(tmp_path, labels, counted):
    classes = np.random.default_rng(3).integers(0, 3, size=(1, 700, 900), dtype=np.uint8)
    classes[0, :50] = NODATA_CLASS
    classes[classes == 2] = 1 if len(labels) == 2 else 2
    path = write_raster(tmp_path / "classes.tif", 900, 700, count=1, nodata=NODATA_CLASS, data=classes)
    expected = {label: int((classes == k).sum()) for k, label in enumerate(labels)}
    counts = count_classes(path, labels, block=256)  # 4 x 3 blocks, the last ones partial
    assert counts == ({label: expected[label] for label in counted} if counted else expected)


def test_scores_page_of_class_scores_shows_each_iou_and_the_confusion_matrix():
    confusion = np.array([[5000, 120], [80, 1800]])
    metrics = {**iou_scores(confusion, ["background", "tree"]), "confusion": confusion.tolist()}
    metrics["labels"] = ["background", "tree"]
    page = scores_page("site<1>", metrics, "miou=...", {"tree": 1920}, "pixels")
    rows = table_rows(page)
    assert ["miou", f"{metrics['miou']:.3f}"] in rows and ["pixels", "7,000"] in rows
    assert ["tree", f"{metrics['iou']['tree']:.3f}"] in rows
    assert ["", "predicted background", "predicted tree"] in rows
    assert ["true background", "5,000", "120"] in rows and ["true tree", "80", "1,800"] in rows
    assert ["class", "pixels"] in rows and ["all", "1,920"] in rows
    assert "site&lt;1&gt;" in page and "site<1>" not in page  # escaped


def test_a_scene_without_annotations_is_said_to_be_unscored():
    page = scores_page("bare", None, "", {"tree": 12}, "detections")
    assert "Not scored: the scene has no annotations" in page
    assert ["tree", "12"] in table_rows(page)


def test_profile_page_has_a_row_per_rank_and_the_totals():
    ranks = [
        {
            "rank": r,
            "shard": 0,
            "world_size": 2,
            "host": "node1",
            "device": "cuda:0",
            "strategy": "window",
            "precision": "bf16-mixed",
            "batch_size": 8,
            "workers": 4,
            "threads": 5,
            "tiles": 1000 + r,
            "batches": 126,
            "wall_s": 20.0 + r,
            "compute_s": 15.0,
            "output_s": 1.0,
            "wait_s": 4.0 + r,
            "output_fraction": 0.05,
            "wait_fraction": 0.2,
            "batches_per_s": 6.3,
            "tiles_per_s": 50.0 + r,
            "memory_kind": "cuda_allocated",
            "memory_peak_mb": 3100.0,
            "memory_mean_mb": 2900.0,
            "memory_total_mb": 81000.0,
            "utilization": 0.93,
            "utilization_source": "nvml",
            "host_rss_peak_mb": 4100.0,
            "workers_rss_peak_mb": 900.0,
        }
        for r in (0, 1)
    ]
    total = {"ranks": 2, "tiles": 2001, "batches": 252, "wall_s": 21.0, "tiles_per_s": 101.0, "batches_per_s": 12.6}
    total |= {"output_fraction": 0.05, "wait_fraction": 0.2, "memory_peak_mb": 3100.0, "host_rss_peak_mb": 4100.0}
    rows = table_rows(profile_page("site1", {"ranks": ranks, "total": total}))
    assert rows[1][:4] == ["0", "cuda:0", "window", "1000"] and rows[2][:4] == ["1", "cuda:0", "window", "1001"]
    assert "51.00" in rows[2] and "93.0%" in rows[2] and "3100" in rows[2]
    assert rows[3][:5] == ["all", "-", "-", "2001", "252"] and "101.00" in rows[3]


def test_table_escapes_its_cells_and_right_aligns_numbers():
    page = table(["name", "value"], [("<script>", 0.5), ("n", 12345)])
    assert "&lt;script&gt;" in page and "<script>" not in page
    assert "<td class=num>0.500</td>" in page and "<td class=num>12,345</td>" in page
