"""A large project's outputs on small real files (rasterscale.grid.partitions, raster.summary, the tasks' project
merge): the partitioned GeoParquet layer reads as the single-file layer does, each object once; which partitions a
new scene touches; the summary raster's values on known objects, classes and values."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import geopandas as gpd
import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import rasterio
from affine import Affine
from shapely.geometry import box

from conftest import UTM17N, write_raster
from rasterscale.atomic import write_geoparquet
from rasterscale.grid.partitions import area_neighbourhoods, remove_stale
from rasterscale.grid.project import source_area
from rasterscale.jobs.files import ProjectJob
from rasterscale.raster.summary import HECTARE, NODATA, CellGrid, summarize_layer
from rasterscale.settings import job_settings
from rasterscale.tasks.detection.project import merge_project
from rasterscale.tasks.detectors.project import COVERING
from test_project import boxes_of, project_job  # noqa: F401 (a fixture)

# ---------------------------------------------------------------------------------------------------------
# The partitioned layer
# ---------------------------------------------------------------------------------------------------------


def partition_jobs(job: ProjectJob, groups: dict[int, list[str]], folder: Path) -> list[ProjectJob]:
    """The partitions' jobs of a project's job: each group's sources, their neighbours', the outer areas."""
    sources = {source.name: source for source in job.sources}
    areas = {name: source_area(source, job.crs) for name, source in sources.items()}
    found = area_neighbourhoods(groups, areas, 0.001)
    jobs = []
    for group, near in found.items():
        read = tuple(sources[name] for name in [*near.owners, *near.neighbours])
        outer = tuple(dataclasses.replace(sources[name], outputs={}) for name in near.outer)
        outputs = {"partition": str(folder / f"batch-{group}.parquet")}
        jobs.append(ProjectJob(job.crs, job.labels, read, outputs, job.settings, near.owners, outer))
    return jobs


def test_a_partitioned_layer_reads_as_one_layer_holding_exactly_the_single_files_objects(project_job, tmp_path):  # noqa: F811
    whole = project_job(0.2)
    merge_project(whole)
    single = gpd.read_parquet(whole.outputs["parquet"])
    folder = tmp_path / "detections"
    groups = {0: ["a"], 1: ["a+b", "b"], 2: ["c"], 3: ["d"]}  # a's and b's partitions meet at the seam a+b
    lines = [merge_project(job) for job in partition_jobs(whole, groups, folder)]
    assert lines[0].startswith("3 detections from 1 scenes and 0 seams"), lines

    layer = gpd.read_parquet(folder)  # the folder, one layer
    assert len(layer) == len(single) == 9 and layer.crs == UTM17N
    assert boxes_of(layer) == boxes_of(single)  # each object once, the same ones
    counts = [pq.ParquetFile(path).metadata.num_rows for path in sorted(folder.glob("*.parquet"))]
    assert sum(counts) == len(layer) and len(counts) == 4
    for path in [whole.outputs["parquet"], *folder.glob("*.parquet")]:  # GeoParquet 1.1 bbox covering
        geo = json.loads(pq.read_schema(path).metadata[b"geo"])
        assert geo["version"] == "1.1.0"
        assert geo["columns"]["geometry"]["covering"]["bbox"]["xmin"] == ["bbox", "xmin"]
    dataset = ds.dataset(folder, format="parquet")  # pyarrow's view of it: one dataset, filtered on the covering
    east = dataset.to_table(filter=ds.field("bbox", "xmin") > 404020.0).num_rows
    assert east == sum(1 for b in layer.geometry.bounds.minx if b > 404020.0)


def test_a_new_scene_touches_only_the_partitions_beside_it():
    """A row of 6 abutting 10 m scenes, 2 a batch, each pair's seam in the batch of its first scene; a 7th scene
    (a new batch) abutting the last: the last batch's neighbourhood changes, not the first's or second's."""

    def areas_of(count: int) -> dict:
        areas = {f"s{i}": box(10 * i, 0, 10 * i + 10, 10) for i in range(count)}
        areas |= {f"s{i}+s{i + 1}": box(10 * i + 9, 0, 10 * i + 11, 10) for i in range(count - 1)}
        return areas

    def groups_of(count: int) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for i in range(count):
            groups.setdefault(i // 2, []).append(f"s{i}")
            if i + 1 < count:
                groups[i // 2].append(f"s{i}+s{i + 1}")
        return groups

    before = area_neighbourhoods(groups_of(6), areas_of(6))
    after = area_neighbourhoods({**groups_of(6), 3: ["s6", "s5+s6"]}, areas_of(7))  # new: a batch of their own
    changed = sorted(group for group in before if before[group] != after[group])
    assert changed == [2], changed  # batch 1's ring 2 reaches s5 only: s5+s6 and s6 lie beyond it
    assert after[2].neighbours == ("s3", "s3+s4", "s5+s6", "s6") and after[3].neighbours == ("s5",)


def test_stale_partitions_are_removed_and_listed_ones_kept(tmp_path):
    for name in ("batch-0.parquet", "batch-1.parquet", "batch-7.parquet", "notes.txt"):
        (tmp_path / name).write_text("")
    removed = remove_stale([str(tmp_path / "batch-0.parquet"), str(tmp_path / "batch-1.parquet")])
    assert removed == [str(tmp_path / "batch-7.parquet")]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["batch-0.parquet", "batch-1.parquet", "notes.txt"]


# ---------------------------------------------------------------------------------------------------------
# The summary raster
# ---------------------------------------------------------------------------------------------------------

CELL = 100.0
WEST, SOUTH = 404000.0, 3285000.0  # multiples of CELL: the grid starts there


def boxes(centres: list[tuple[float, float]]) -> gpd.GeoDataFrame:
    return gpd.GeoDataFrame(
        {"score": np.ones(len(centres))}, geometry=[box(x - 1, y - 1, x + 1, y + 1) for x, y in centres], crs=UTM17N
    )


def read_summary(path: Path) -> tuple[np.ndarray, rasterio.Affine, list[str]]:
    with rasterio.open(path) as src:
        assert src.profile["blockxsize"] == 512 or src.width < 512  # a COG's layout
        assert src.crs == UTM17N and src.nodata == NODATA
        return src.read(), src.transform, list(src.descriptions)


def test_objects_per_hectare_count_centres_in_a_cell_over_its_area(tmp_path):
    first = boxes([(WEST + 10 + i, SOUTH + 20 + i) for i in range(10)])  # 10 in the south-west cell
    second = boxes([(WEST + 150, SOUTH + 150), (WEST + 250, SOUTH + 50)])  # one in each of two other cells
    write_geoparquet(first, tmp_path / "batch-0.parquet", **COVERING)
    second.to_parquet(tmp_path / "batch-1.parquet", index=False)  # no bbox covering: the geometries' bounds
    out = tmp_path / "summary.tif"
    layers = [str(tmp_path / "batch-0.parquet"), str(tmp_path / "batch-1.parquet")]
    line = summarize_layer("objects", layers, CELL, UTM17N, ["tree"], str(out))
    data, transform, names = read_summary(out)
    per_ha = HECTARE / CELL**2  # one object a cell, per hectare
    assert data.shape == (1, 2, 3) and names == ["objects per ha"]
    assert (transform.c, transform.f) == (WEST, SOUTH + 200)
    np.testing.assert_allclose(data[0], [[0, per_ha, 0], [10 * per_ha, 0, per_ha]])
    assert line.endswith("3 x 2 cells of 100 m from 2 file(s)")


def test_in_a_geographic_crs_cells_are_the_metres_in_degrees_and_densities_use_each_rows_area(tmp_path):
    """At 60 degrees north a 100 m cell is 0.000899 degrees; 10 objects in one cell are 10 over its area on the
    sphere (about half a hectare there: the cell is 100 m high and 50 m wide)."""
    from rasterscale.raster.summary import EARTH_RADIUS_M

    degrees = 100 / math.radians(EARTH_RADIUS_M)
    west, south = 80 * degrees, 60.0 + 3 * degrees  # a cell's corner (cells lie on multiples of the cell)
    centres = [(west + degrees * (0.1 + 0.05 * i), south + degrees * 0.5) for i in range(10)]
    frame = gpd.GeoDataFrame(
        {"label": ["tree"] * 10, "score": [0.9] * 10},
        geometry=[box(x - 1e-6, y - 1e-6, x + 1e-6, y + 1e-6) for x, y in centres],
    )
    write_geoparquet(frame.set_crs("EPSG:4326"), tmp_path / "l.parquet", **COVERING)
    line = summarize_layer(
        "objects", [str(tmp_path / "l.parquet")], 100, "EPSG:4326", ["tree"], str(tmp_path / "s.tif")
    )
    with rasterio.open(tmp_path / "s.tif") as src:
        data, res = src.read(1), src.res
    area_ha = (
        EARTH_RADIUS_M**2
        * math.radians(degrees)
        * (math.sin(math.radians(south + degrees)) - math.sin(math.radians(south)))
        / HECTARE
    )
    assert res == pytest.approx((degrees, degrees)) and data.shape == (1, 1)
    assert area_ha == pytest.approx(0.5, rel=0.01) and data[0, 0] == pytest.approx(10 / area_ha, rel=1e-5)
    assert "cells of 100 m (0.000899" in line


def test_a_grid_of_cells_covers_bounds_on_multiples_of_the_cell():
    grid = CellGrid.covering((WEST + 5, SOUTH + 5, WEST + 205, SOUTH + 95), CELL)
    assert (grid.west, grid.north, grid.width, grid.height) == (WEST, SOUTH + 100, 3, 1)
    cells = grid.cells_of(np.array([WEST + 1, WEST + 299, WEST + 301]), np.array([SOUTH + 50] * 3))
    assert cells.tolist() == [0, 2, -1]


@pytest.mark.parametrize("kind", ["classes", "values"])
def test_a_raster_summary_is_each_cells_class_cover_or_mean_value_nodata_left_out(tmp_path, kind):
    """A 40 × 20 m raster of 1 m pixels over 2 cells of 20 m: the west cell a quarter class 1 and three quarters
    class 0 (values: 1 and 3, mean 2.5), the east one all nodata but a 10 × 10 m quarter of class 2 (value 7)."""
    data = np.full((1, 20, 40), 255, dtype=np.uint8)
    data[0, :, :20] = 0
    data[0, :10, :10] = 1
    data[0, :10, 20:30] = 2
    if kind == "values":
        data = np.where(data == 255, -9, np.choose(np.minimum(data, 2), [3, 1, 7])).astype(np.float32)
    nodata = 255 if kind == "classes" else -9
    raster = write_raster(
        tmp_path / "layer.tif",
        40,
        20,
        count=1,
        data=data,
        nodata=nodata,
        transform=Affine(1, 0, WEST, 0, -1, SOUTH + 20),
    )
    out = tmp_path / "summary.tif"
    summarize_layer(kind, [str(raster)], 20.0, UTM17N, ["none", "tree", "shrub"], str(out))
    summary, _, names = read_summary(out)
    if kind == "classes":
        assert names == ["none cover", "tree cover", "shrub cover"]
        np.testing.assert_allclose(summary[:, 0], [[0.75, 0.0], [0.25, 0.0], [0.0, 1.0]])
    else:
        assert names == ["mean none"]
        np.testing.assert_allclose(summary[:, 0], [[2.5, 7.0]])


def test_the_report_draws_the_summary_raster_with_the_scenes_outlined(tmp_path):
    from PIL import Image

    from rasterscale.jobs.files import ProjectMapJob
    from rasterscale.tools.report import render_project_map

    transform = Affine(0.1, 0, WEST, 0, -0.1, SOUTH + 30)
    scene = write_raster(tmp_path / "a.tif", 300, 300, count=1, transform=transform)
    write_geoparquet(boxes([(WEST + 10 + i, SOUTH + 5 + i) for i in range(20)]), tmp_path / "l.parquet", **COVERING)
    summarize_layer("objects", [str(tmp_path / "l.parquet")], 5.0, UTM17N, ["tree"], str(tmp_path / "summary.tif"))
    scenes = ({"name": "a", "raster": str(scene), "roles": ["predict"], "counts": ""},)
    job = ProjectMapJob(scenes, job_settings({"task": "detection"}), str(tmp_path / "summary.tif"))
    render_project_map(job, "detections", tmp_path / "map.png")
    with Image.open(tmp_path / "map.png") as image:
        image.load()
        assert image.size[0] >= 800 and len(image.getcolors(1 << 20) or []) > 50  # a drawing, not a blank
