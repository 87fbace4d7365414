"""Projects on small real rasters (rasterscale.grid.project, raster.mosaic, workflow.batches, the seam's tile
manifest, detection's project layer, the plan's project checks): which scenes get a seam and its core, who owns
each place of the project, the VRT mosaic a seam is read from, batches that stay put, and each object once in
the project's layer."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import geopandas as gpd
import numpy as np
import pytest
import rasterio
import shapely
import shapely.affinity
from affine import Affine
from rasterio.enums import ColorInterp
from shapely.geometry import box

from conftest import UTM17N, project_sources, write_raster, write_rgba
from rasterscale.errors import ConfigError, InputError
from rasterscale.grid import project as grid_project
from rasterscale.grid.manifest import build_manifest
from rasterscale.grid.partitions import adjacency, neighbourhoods
from rasterscale.grid.project import (
    Footprint,
    Ownership,
    Seam,
    find_seams,
    is_seam,
    mosaicable,
    seam_line,
    seam_name,
    seam_scenes,
    source_area,
)
from rasterscale.jobs import paths
from rasterscale.jobs.files import ProjectJob, TilesJob
from rasterscale.raster.headers import check_raster
from rasterscale.raster.mosaic import write_mosaic
from rasterscale.scene import Scene
from rasterscale.settings import job_settings
from rasterscale.tasks.detection.merge import DETECTION_COLUMNS
from rasterscale.tasks.detection.project import PROJECT_COLUMNS, merge_project
from rasterscale.workflow import partitions as workflow_partitions
from rasterscale.workflow.batches import (
    allowed_rules,
    batch_rule,
    form_batches,
    read_written_batches,
    recorded_targets,
    requested_files,
    rule_batches,
)
from rasterscale.workflow.checks import build_plan, footprint_of
from rasterscale.workflow.jobfiles import write_job_files
from rasterscale.workflow.steps import Steps

X0, Y0 = 404000.0, 3285000.0  # the project's lower left corner (EPSG:32617)
PX = 0.1  # pixel size, m
SIDE = 200  # a scene's side, px (20 m)
MARGIN = 16  # a seam core's half-width, px (1.6 m)
UTM18N = "EPSG:32618"


def scene(path: Path, left: float, bottom: float, width: int = SIDE, height: int = SIDE, pixel: float = PX, **kwargs):
    """A real raster whose lower left corner is (X0 + left, Y0 + bottom) m."""
    transform = Affine(pixel, 0, X0 + left, 0, -pixel, Y0 + bottom + height * pixel)
    return write_raster(path, width, height, transform=transform, **kwargs)


def footprints(rasters: dict[str, Path]) -> dict[str, Footprint]:
    """The footprints the plan reads from the scenes' headers."""
    return {name: footprint_of(check_raster(path)) for name, path in rasters.items()}


def rect(xmin: float, ymin: float, xmax: float, ymax: float) -> shapely.Geometry:
    """A rectangle in metres from the project's corner."""
    return box(X0 + xmin, Y0 + ymin, X0 + xmax, Y0 + ymax)


def in_project(geometry: shapely.Geometry, x: float, y: float) -> bool:
    return bool(shapely.contains_xy(geometry, X0 + x, Y0 + y))


@pytest.fixture
def grid(tmp_path) -> dict[str, Footprint]:
    """Four abutting 20 m scenes, 2 x 2: a b on top, c d below."""
    cells = {"a": (0, 20), "b": (20, 20), "c": (0, 0), "d": (20, 0)}
    return footprints({name: scene(tmp_path / f"{name}.tif", *cell) for name, cell in cells.items()})


@pytest.fixture
def flights(tmp_path) -> dict[str, Footprint]:
    """Two flights over one stand, b offset by half a scene east of a: they overlap between 10 and 20 m."""
    return footprints({"a": scene(tmp_path / "a.tif", 0, 0), "b": scene(tmp_path / "b.tif", 10, 0)})


# ---------------------------------------------------------------------------------------------------------
# Seams
# ---------------------------------------------------------------------------------------------------------


def test_seam_names_join_the_sorted_scene_names_with_a_plus():
    assert seam_name("b", "a") == seam_name("a", "b") == "a+b" == Seam("a", "b", "").name
    assert is_seam("a+b") and not is_seam("a") and seam_scenes("a+b") == ("a", "b")


def test_a_2x2_grid_has_its_four_edge_seams_and_none_between_scenes_touching_at_a_corner(grid):
    seams = find_seams(grid, MARGIN)
    assert [(seam.a, seam.b) for seam in seams] == [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")]


def test_an_edge_seams_core_is_margin_pixels_either_side_of_the_shared_edge_within_its_two_scenes(grid):
    m = MARGIN * PX
    expected = {  # the shared edge widened by margin x pixel on both sides, as long as the edge
        "a+b": rect(20 - m, 20, 20 + m, 40),
        "c+d": rect(20 - m, 0, 20 + m, 20),
        "a+c": rect(0, 20 - m, 20, 20 + m),
        "b+d": rect(20, 20 - m, 40, 20 + m),
    }
    for seam in find_seams(grid, MARGIN):
        core = shapely.from_wkt(seam.core)
        both = shapely.union(grid[seam.a].polygon, grid[seam.b].polygon)
        assert core.symmetric_difference(expected[seam.name]).area < 1e-3, seam.name  # 1 px off: 2 m2
        assert both.buffer(PX / 2, join_style="mitre").contains(core), seam.name
        assert core.area == pytest.approx(2 * m * 20, abs=1e-3)


def test_overlapping_flights_get_one_seam_along_each_edge_that_runs_inside_the_other(flights):
    (seam,) = find_seams(flights, MARGIN)
    assert (seam.a, seam.b) == ("a", "b")
    core = shapely.from_wkt(seam.core)
    m = MARGIN * PX
    # b's west edge (x = 10 m) runs inside a, a's east edge (x = 20 m) inside b: both widened by the margin
    assert core.contains(rect(10 - m, 0.01, 10 + m, 19.99)) and core.contains(rect(20 - m, 0.01, 20 + m, 19.99))
    assert not in_project(core, 10 - m - 0.05, 10) and not in_project(core, 20 + m + 0.05, 10)
    assert not in_project(core, 15, 10)  # the middle of the overlap, away from both edges
    assert not in_project(core, 5, 10) and not in_project(core, 25, 10)  # each flight alone
    union = shapely.union(flights["a"].polygon, flights["b"].polygon)
    assert union.buffer(PX / 2, join_style="mitre").contains(core)


@pytest.mark.parametrize(
    ("left", "second"),
    [
        (1020, {}),  # 1 km apart
        (20, {"crs": UTM18N}),
        (20, {"pixel": 0.2, "width": SIDE // 2, "height": SIDE // 2}),  # abutting, at another pixel size
        (20, {"count": 4}),
    ],
    ids=["1km-apart", "other-crs", "other-pixel-size", "other-band-count"],
)
def test_scenes_apart_or_not_mosaicable_get_no_seam(tmp_path, left, second):
    rasters = {"a": scene(tmp_path / "a.tif", 0, 0), "b": scene(tmp_path / "b.tif", left, 0, **second)}
    prints = footprints(rasters)
    assert find_seams(prints, MARGIN) == []
    if left == 20 and "crs" not in second:  # abutting: the same scene at the same pixel size has one
        same = {"a": prints["a"], "b": footprint_of(check_raster(scene(tmp_path / "c.tif", 20, 0)))}
        assert [s.name for s in find_seams(same, MARGIN)] == ["a+b"]


# ---------------------------------------------------------------------------------------------------------
# Seams and neighbourhoods at scale: the same as the plain computation, to the byte
# ---------------------------------------------------------------------------------------------------------


def plain_seams(footprints: dict[str, Footprint], margin_px: int) -> list[Seam]:
    """find_seams as it was before groups of translates: every pair's geometry computed (the oracle)."""
    names = sorted(footprints)
    polygons = np.array([footprints[n].polygon for n in names], dtype=object)
    tolerance = max(max(footprints[n].pixel) for n in names) / 100
    near = shapely.STRtree(polygons).query(polygons, predicate="dwithin", distance=tolerance)
    pairs = [
        (i, j)
        for i, j in zip(*near.tolist(), strict=True)
        if i < j and mosaicable(footprints[names[i]], footprints[names[j]])
    ]
    i, j = (np.array(side, dtype=np.intp) for side in zip(*pairs, strict=True))
    pixel = np.array([max(*footprints[names[a]].pixel, *footprints[names[b]].pixel) for a, b in pairs])
    line = seam_line(polygons[i], polygons[j], pixel / 100)
    border = shapely.length(line) >= 2 * pixel
    i, j, pixel, line = i[border], j[border], pixel[border], line[border]
    both = shapely.buffer(shapely.union(polygons[i], polygons[j]), pixel / 2, join_style="mitre")
    cores = shapely.intersection(shapely.buffer(line, margin_px * pixel, cap_style="flat", join_style="mitre"), both)
    wkts = shapely.to_wkt(cores, rounding_precision=-1)
    return sorted((Seam(names[a], names[b], w) for a, b, w in zip(i, j, wkts, strict=True)), key=lambda s: s.name)


def plain_adjacency(areas: dict, tolerance: float) -> dict[str, set[str]]:
    """adjacency as it was: an STRtree's dwithin query of every area (the oracle)."""
    names = sorted(areas)
    geometries = np.array([areas[name] for name in names], dtype=object)
    near: dict[str, set[str]] = {name: set() for name in names}
    found = shapely.STRtree(geometries).query(geometries, predicate="dwithin", distance=tolerance)
    for i, j in zip(*found.tolist(), strict=True):
        if i != j:
            near[names[i]].add(names[j])
    return near


def survey(columns: int, rows: int, pixel: float, origin: tuple[float, float], side: int = 64, crs: str = "EPSG:32617"):
    """Scenes of a survey's grid as their headers give them: each transform on its own (the grid's corner moved by
    whole scenes), each right and bottom edge its left and top plus its size: some a float's unit off the next
    scene's edge, as real tiles are."""
    grid = Affine(pixel, 0, origin[0], 0, -pixel, origin[1])
    prints = {}
    for row in range(rows):
        for column in range(columns):
            t = Affine.translation(column * side * grid.a, row * side * grid.e) @ grid
            bounds = (t.c, t.f + t.e * side, t.c + t.a * side, t.f)
            prints[f"{crs[-2:]}_{pixel}_{row:02d}_{column:02d}"] = Footprint(crs, bounds, (pixel, pixel), 3, "uint8")
    return prints


def mixed_project(seed: int) -> dict[str, Footprint]:
    """A survey's grid, a second one in another CRS, a grid at a coarser pixel size abutting it, scenes of other
    extents offset along a border, flights that overlap, near misses at the tolerance, a grid at degrees'
    magnitude and scenes at coordinates about 0 (which no offset moves exactly)."""
    rng = np.random.default_rng(seed)
    prints = survey(7, 6, 0.1, (404000.0, 3285000.0)) | survey(4, 4, 0.25, (10.5, -33.75), crs="EPSG:32618")
    prints |= survey(3, 5, 0.2, (404000.0 - 3 * 64 * 0.2, 3285000.0))  # west of the first survey, other pixel size
    east = 404000.0 + 7 * 6.4
    for k in range(6):  # other extents, offset by whole and by fractions of pixels along the east border
        bottom = 3285000.0 - 38.4 + k * 6.0 + rng.choice([0.0, 0.05, 3.2])
        prints[f"east_{k}"] = Footprint("EPSG:32617", (east, bottom, east + 4.8, bottom + 6.0), (0.1, 0.1), 3, "uint8")
    for k in range(6):  # flights over the first survey
        x, y = 404000.0 + rng.uniform(0, 40), 3285000.0 - rng.uniform(5, 38)
        prints[f"flight_{k}"] = Footprint("EPSG:32617", (x, y, x + 12.8, y + 6.4), (0.1, 0.1), 3, "uint8")
    for k, gap in enumerate([0.0005, 0.001, 0.0011]):  # within a hundredth of a pixel of the south edge, or not
        top = 3285000.0 - 38.4 - gap
        prints[f"near_{k}"] = Footprint(
            "EPSG:32617", (404000.0 + 6.4 * k, top - 6.4, 404006.4 + 6.4 * k, top), (0.1,) * 2, 3, "uint8"
        )
    prints |= survey(3, 3, 1e-5, (12.0006, -33.9))  # degrees' magnitude, a pixel of a metre or so
    return prints | survey(4, 3, 0.5, (-16.0, 8.0), side=16)  # across x = 0


@pytest.mark.parametrize("margin_px", [1, 16, 80, 200])  # 200: GEOS's buffer drops a stub's end (1e-4 margin)
def test_seams_at_scale_are_the_plain_computations_to_the_byte(margin_px):
    prints = mixed_project(margin_px)
    seams = find_seams(prints, margin_px)
    assert seams == plain_seams(prints, margin_px) and len(seams) > 100


def test_a_grids_seams_where_its_edges_are_a_units_apart_are_the_plain_computations(monkeypatch):
    """Where two scenes' bounds are a float's unit apart, GEOS's buffer of the seam line has near parallel edges
    whose crossings move with the coordinates' magnitude: moving one seam's core onto another would differ here."""
    prints = survey(8, 8, 0.6, (250000.0, 5500000.0))
    assert find_seams(prints, 8) == plain_seams(prints, 8)
    monkeypatch.setattr(grid_project, "_moving", lambda found, shared, *rest: np.full(len(shared), 2))
    assert find_seams(prints, 8) != plain_seams(prints, 8)  # the check that catches it, taken away


def test_a_grids_seams_are_computed_from_a_few_of_its_pairs(monkeypatch):
    computed = []

    def borders(a, b, pixel):
        computed.append(len(a))
        return seam_borders(a, b, pixel)

    seam_borders = grid_project._borders
    monkeypatch.setattr(grid_project, "_borders", borders)
    side = 64 * 0.125  # 8 m: every scene's bounds exact, each pair of neighbours the same shape
    prints = {
        f"s{r:02d}{c:02d}": Footprint("EPSG:32617", (x, y, x + side, y + side), (0.125, 0.125), 3, "uint8")
        for r, y in enumerate(3285000.0 + side * np.arange(20))
        for c, x in enumerate(404000.0 + side * np.arange(20))
    }
    seams = find_seams(prints, 16)
    assert len(seams) == 2 * 20 * 19 and sum(computed) <= 4 * grid_project.SAMPLES, computed
    assert seams == plain_seams(prints, 16)


@pytest.mark.parametrize("tolerance", [0.0, 0.001])
def test_adjacency_of_scenes_and_seam_cores_is_the_plain_queries(tolerance):
    prints = survey(8, 8, 0.1, (404000.0, 3285000.0)) | {"apart": Footprint("EPSG:32617", (0, 0, 1, 1), (1, 1), 3, "")}
    areas = {name: footprint.polygon for name, footprint in prints.items()}
    areas |= {seam.name: shapely.from_wkt(seam.core) for seam in find_seams(prints, 80)}
    areas |= {"empty": shapely.Polygon(), "touching": box(404051.2, 3284948.8, 404060.0, 3284949.0)}
    near = adjacency(areas, tolerance)
    assert near == plain_adjacency(areas, tolerance)
    assert near["apart"] == near["empty"] == set() and near["touching"]
    assert adjacency({}, tolerance) == {} and adjacency({"a": box(0, 0, 1, 1)}, tolerance) == {"a": set()}


def test_a_plans_partition_neighbourhoods_are_those_of_each_sources_area(monkeypatch):
    """The plan's sources' areas at once: seams' cores and scenes' boxes in the project's CRS, one by one the
    others (a seam in another CRS, reprojected) and none for a scene whose header the plan did not read."""
    prints = survey(6, 5, 0.1, (404000.0, 3285000.0)) | survey(2, 2, 0.1, (404000.0 + 38.4, 3285000.0), crs=UTM18N)
    seams = find_seams(prints, 80)
    by_name = {seam.name: seam for seam in seams}
    sources = [*sorted([*prints, "unread"]), *by_name]
    plan = SimpleNamespace(
        footprints=prints,
        members=dict(enumerate(tuple(sources[k : k + 7]) for k in range(0, len(sources), 7))),
        project_crs=lambda: "EPSG:32617",
        project_sources=lambda: sources,
        seam=by_name.__getitem__,
        scene_outputs=lambda name: {},
    )
    monkeypatch.setattr(
        workflow_partitions, "partition_groups", lambda plan: {k: list(v) for k, v in plan.members.items()}
    )
    areas = {}
    for name in sources:
        area = source_area(workflow_partitions.source_entry(plan, name, outputs=False), "EPSG:32617")
        if area is not None:
            areas[name] = area
    expected = neighbourhoods(workflow_partitions.partition_groups(plan), plain_adjacency(areas, 0.001))
    assert workflow_partitions.partition_neighbourhoods(plan) == expected
    assert any(seam.a.startswith("18") for seam in seams)


# ---------------------------------------------------------------------------------------------------------
# Ownership
# ---------------------------------------------------------------------------------------------------------


def ownership(prints: dict[str, Footprint]) -> Ownership:
    cores = {seam.name: shapely.from_wkt(seam.core) for seam in find_seams(prints, MARGIN)}
    return Ownership({name: footprint.polygon for name, footprint in prints.items()}, cores)


def sample(width: float, height: float, step: float = 0.25) -> tuple[np.ndarray, np.ndarray]:
    """A dense grid of points over the project, none on a scene's edge or a core's (offset 0.0371 m)."""
    xs, ys = np.meshgrid(np.arange(0.0371, width, step), np.arange(0.0371, height, step))
    return X0 + xs.ravel(), Y0 + ys.ravel()


def owners(own: Ownership, x: np.ndarray, y: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Which sources own each point: (names, bool matrix source x point). A source's objects lie in its area
    (a scene's footprint, a seam's core): it owns a point there that it keeps."""
    names = [*own.footprints, *own.cores]
    areas = {**own.footprints, **own.cores}
    owned = np.stack([shapely.contains_xy(areas[name], x, y) & own.keeps(name, x, y) for name in names])
    return names, owned


def test_every_point_of_a_2x2_grid_is_owned_by_exactly_one_source(grid):
    own = ownership(grid)
    x, y = sample(40, 40)
    names, owned = owners(own, x, y)
    assert sorted(names) == ["a", "a+b", "a+c", "b", "b+d", "c", "c+d", "d"]
    assert (owned.sum(axis=0) == 1).all()
    assert owned.any(axis=1).all()  # every scene and seam owns some of it
    owner = np.asarray(names, dtype=object)[owned.argmax(axis=0)]
    # within the margin of an inner edge a seam owns the point: where cores cross (around the grid's centre), the
    # one whose two scenes hold it deepest (their mosaic holds most of an object there); elsewhere the scene it
    # lies in. A seam's two scenes: a+b the top half, c+d the bottom one, a+c the left half, b+d the right one.
    near = (np.abs(x - X0 - 20) < MARGIN * PX) | (np.abs(y - Y0 - 20) < MARGIN * PX)
    u, v = x - X0, y - Y0
    halves = {"a+b": (0, 40, 20, 40), "c+d": (0, 40, 0, 20), "a+c": (0, 20, 0, 40), "b+d": (20, 40, 0, 40)}
    depth = {seam: np.minimum.reduce([u - x0, x1 - u, v - y0, y1 - v]) for seam, (x0, x1, y0, y1) in halves.items()}
    deepest = np.full(len(x), "", dtype=object)
    best = np.full(len(x), -np.inf)
    for name in sorted(own.cores):  # strictly deeper replaces: a tie stays with the first by name
        deeper = shapely.contains_xy(own.cores[name], x, y) & (depth[name] > best)
        deepest[deeper], best[deeper] = name, depth[name][deeper]
    assert ((deepest != "") == near).all()
    assert (owner[near] == deepest[near]).all()
    # around the centre: just above the horizontal border, 1 m east of the vertical one, b+d (the right half)
    # holds an object there whole and owns it; just east of the vertical border, 1 m above the other, a+b
    centre_x, centre_y = X0 + np.array([21.0, 20.3, 19.0, 19.7]), Y0 + np.array([20.3, 21.0, 19.7, 19.0])
    names, owned = owners(own, centre_x, centre_y)
    assert np.asarray(names, dtype=object)[owned.argmax(axis=0)].tolist() == ["b+d", "a+b", "a+c", "c+d"]
    quadrant = np.where(y - Y0 > 20, np.where(x - X0 < 20, "a", "b"), np.where(x - X0 < 20, "c", "d"))
    assert (owner[~near] == quadrant[~near]).all()


def test_overlapping_flights_the_first_by_name_owns_the_overlap_outside_the_core(flights):
    own = ownership(flights)
    x, y = sample(30, 20)
    names, owned = owners(own, x, y)
    assert (owned.sum(axis=0) == 1).all()
    owner = np.asarray(names, dtype=object)[owned.argmax(axis=0)]
    in_core = shapely.contains_xy(own.cores["a+b"], x, y)
    overlap = (x - X0 > 10) & (x - X0 < 20)
    assert (owner[in_core] == "a+b").all()
    assert (owner[overlap & ~in_core] == "a").all() and (overlap & ~in_core).sum() > 100
    assert (owner[(x - X0 > 20) & ~in_core] == "b").all()
    assert not own.keeps("b", x[overlap & ~in_core], y[overlap & ~in_core]).any()


def test_scene_of_a_seam_is_the_first_of_its_scenes_holding_the_point(flights):
    own = ownership(flights)
    x, y = X0 + np.array([9.0, 15.0, 21.0]), Y0 + np.array([10.0, 10.0, 10.0])  # a only, both, b only
    assert own.scene_of("a+b", x, y).tolist() == ["a", "a", "b"]
    assert own.scene_of("b", x, y).tolist() == ["b", "b", "b"]


# ---------------------------------------------------------------------------------------------------------
# The VRT mosaic a seam is read from
# ---------------------------------------------------------------------------------------------------------

TRANSFORM = Affine(PX, 0, X0, 0, -PX, Y0 + 16)


def cut(folder: Path, data: np.ndarray, col: int = 120, row: int = 70, **kwargs) -> list[Path]:
    """Four abutting tiles cut from ``data`` (bands, rows, cols) at (col, row), each with its own transform."""
    folder.mkdir(parents=True, exist_ok=True)
    tiles = []
    height, width = data.shape[1:]
    for r0, r1 in ((0, row), (row, height)):
        for c0, c1 in ((0, col), (col, width)):
            part = np.ascontiguousarray(data[:, r0:r1, c0:c1])
            transform = TRANSFORM @ Affine.translation(c0, r0)
            path = folder / f"tile-{r0}-{c0}.tif"
            if data.shape[0] == 4:  # RGB and alpha
                write_rgba(path, part, transform=transform, **kwargs)
            else:
                write_raster(path, c1 - c0, r1 - r0, count=data.shape[0], data=part, transform=transform, **kwargs)
            tiles.append(path)
    return tiles[::-1]  # in no particular order


def test_a_mosaic_of_four_abutting_tiles_reads_back_the_raster_they_were_cut_from_its_alpha_as_alpha(tmp_path):
    data = np.random.default_rng(1).integers(1, 255, size=(4, 160, 200), dtype=np.uint8)
    data[3] = 255
    data[3, 100:, :50] = 0  # no data there, across two tiles
    vrt = write_mosaic(tmp_path / "results/r/seams/a+b/mosaic.vrt", [str(p) for p in cut(tmp_path / "in", data)])
    with rasterio.open(vrt) as src:
        assert (src.width, src.height, src.count) == (200, 160, 4)
        assert src.transform.almost_equals(TRANSFORM) and src.crs.to_string() == UTM17N
        assert src.colorinterp == (ColorInterp.red, ColorInterp.green, ColorInterp.blue, ColorInterp.alpha)
        mosaic = src.read()
    valid = data[3] > 0
    np.testing.assert_array_equal(mosaic[:, valid], data[:, valid])
    assert not mosaic[:, ~valid].any()  # where alpha is 0 no tile is drawn: 0 in every band, as gdalbuildvrt's


def test_a_mosaic_carries_nodata_and_reads_from_its_folder_moved_elsewhere(tmp_path):
    data = np.random.default_rng(2).normal(size=(3, 160, 200)).astype(np.float32)
    data[:, 20:90, 100:150] = -9999.0  # no data there, across the tiles' borders
    project = tmp_path / "project"
    write_mosaic(project / "results/r/seams/a+b/mosaic.vrt", [str(p) for p in cut(project, data, nodata=-9999.0)])
    moved = tmp_path / "moved"
    shutil.move(project, moved)
    with rasterio.open(moved / "results/r/seams/a+b/mosaic.vrt") as src:
        assert src.nodatavals == (-9999.0,) * 3 and src.dtypes == ("float32",) * 3
        np.testing.assert_array_equal(src.read(), data)
        assert not src.read(1, masked=True).mask[:20].any() and src.read(1, masked=True).mask[20:90, 100:150].all()


@pytest.mark.parametrize(
    ("first_nodata", "later_marks"),
    [(0, "nodata"), (None, "nodata"), (None, "alpha"), (None, "mask")],
    ids=["nodata", "nodata-of-the-later-only", "alpha", "internal-mask"],
)
def test_where_a_later_raster_of_a_mosaic_has_no_data_the_earlier_one_shows(tmp_path, first_nodata, later_marks):
    """Two overlapping flights: the later one's no-data margin (its nodata value, alpha 0 as OpenDroneMap writes
    it, or its internal mask) over the first one's pixels leaves them showing, as gdalbuildvrt's mosaic does."""
    alpha = later_marks == "alpha"
    count = 4 if alpha else 3
    data = np.random.default_rng(3).integers(1, 255, size=(count, 50, 200), dtype=np.uint8)
    if alpha:
        data[3] = 255
    later = data[:, :, 100:].copy()
    later[:, :, :20] = 0  # over first's last 20 columns: no data (alpha 0 too)
    options = {"count": count, "alpha": alpha}
    first = data[:, :, :120].copy()
    first = write_raster(tmp_path / "1.tif", 120, 50, data=first, transform=TRANSFORM, nodata=first_nodata, **options)
    shifted = TRANSFORM @ Affine.translation(100, 0)
    nodata = 0 if later_marks == "nodata" else None
    second = write_raster(tmp_path / "2.tif", 100, 50, data=later, transform=shifted, nodata=nodata, **options)
    if later_marks == "mask":
        with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True), rasterio.open(second, "r+") as dst:
            dst.write_mask(later[0] > 0)
    with rasterio.open(write_mosaic(tmp_path / "mosaic.vrt", [str(first), str(second)])) as src:
        np.testing.assert_array_equal(src.read(), data)


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ({"crs": UTM18N}, "CRS differs from {first}'s; a mosaic needs one CRS"),
        (
            {"pixel": 0.2, "width": SIDE // 2, "height": SIDE // 2},
            "pixel size differs from {first}'s; a mosaic needs one",
        ),
        ({"count": 4}, "bands or data type differ from {first}'s"),
    ],
    ids=["crs", "pixel-size", "band-count"],
)
def test_a_mosaic_of_rasters_that_differ_is_one_line_naming_the_raster_that_differs(tmp_path, second, message):
    first = scene(tmp_path / "a.tif", 0, 0)
    other = scene(tmp_path / "b.tif", 20, 0, **second)
    with pytest.raises(InputError) as err:
        write_mosaic(tmp_path / "mosaic.vrt", [str(first), str(other)])
    assert str(err.value) == f"{other}: " + message.format(first=first)
    assert not (tmp_path / "mosaic.vrt").exists()


# ---------------------------------------------------------------------------------------------------------
# Batches that stay put
# ---------------------------------------------------------------------------------------------------------


RUN = paths.RunPaths("r")  # the batches' run: their job files under results/r/batches/


def entries(rasters: dict[str, str]) -> Callable[[str, int], Scene]:
    """What the plan writes for a member in a batch: its raster (from ``rasters``), and files named by batch."""

    def entry(name: str, batch: int) -> Scene:
        return Scene(
            name=name,
            raster=rasters[name],
            manifest=RUN.scene_manifest(name),
            rank_files=tuple(RUN.rank_files(name, batch, 1, 1)),
            outputs={"parquet": RUN.scene_file(name, "detections.parquet")},
        )

    return entry


def record(workdir: Path, batches: dict[int, tuple[Scene, ...]], mtimes: dict[int, int] | None = None) -> None:
    """Write the batches' tiles job files as the workflow does (times of writing: ``mtimes``, ns)."""
    for number, scenes in batches.items():
        path = workdir / RUN.job_file("tiles", number)
        TilesJob(scenes, TILING).write(path)
        if mtimes:
            os.utime(path, ns=(mtimes[number], mtimes[number]))


TILING = job_settings({"tiling": {"patch_size": 64, "overlap": 0, "skip_nodata": True}})


def names(batches: dict[int, tuple[Scene, ...]]) -> dict[int, list[str]]:
    return {number: [s.name for s in scenes] for number, scenes in batches.items()}


@pytest.fixture
def rasters(tmp_path) -> dict[str, str]:
    """Scenes a to h, their rasters on disk."""
    for name in "abcdefgh":
        (tmp_path / f"{name}.tif").write_bytes(b"raster")
    return {name: f"{name}.tif" for name in "abcdefgh"}


def form(workdir: Path, members: str, entry: Callable[[str, int], Scene]) -> dict[int, tuple[Scene, ...]]:
    """The batches formed, with their members' entries: the recorded one of a member no longer asked for, else
    ``entry``'s (what the plan builds)."""
    recorded = read_written_batches(RUN.jobs_dir("tiles"), workdir)
    batches, kept = form_batches(list(members), entry, 2, recorded, lambda r: (workdir / r).exists())
    assert set(kept) <= {name for names in batches.values() for name in names} - set(members)
    return {n: tuple(kept[m] if m in kept else entry(m, n) for m in names) for n, names in batches.items()}


def test_fresh_batches_chunk_the_members_in_order_numbered_from_zero(tmp_path, rasters):
    entry = entries(rasters)
    batches = form(tmp_path, "cabde", entry)
    assert names(batches) == {0: ["c", "a"], 1: ["b", "d"], 2: ["e"]}
    assert batches[1] == (entry("b", 1), entry("d", 1))


def test_recorded_batches_whose_entries_match_are_kept_whatever_the_members_order(tmp_path, rasters):
    entry = entries(rasters)
    fresh = form(tmp_path, "abcde", entry)
    record(tmp_path, fresh)
    assert [r.batch for r in sorted(read_written_batches(RUN.jobs_dir("tiles"), tmp_path), key=lambda r: r.batch)] == [
        0,
        1,
        2,
    ]
    assert (
        read_written_batches(paths.RunPaths("other").jobs_dir("tiles"), tmp_path) == []
    )  # another run's batches are its own
    assert form(tmp_path, "edcba", entry) == fresh


def test_a_changed_entry_dissolves_only_its_batch_and_its_members_form_a_new_one(tmp_path, rasters):
    record(tmp_path, form(tmp_path, "abcde", entries(rasters)))  # 0: a b, 1: c d, 2: e
    entry = entries({**rasters, "c": "c-v2.tif"})  # c is read from another raster now
    batches = form(tmp_path, "edcba", entry)
    assert names(batches) == {0: ["a", "b"], 1: ["d", "c"], 2: ["e"]}  # not re-chunked in the new order
    assert batches[1] == (entry("d", 1), entry("c", 1)) and batches[1][1].raster == "c-v2.tif"


def test_an_added_member_forms_a_new_batch_with_the_smallest_free_number(tmp_path, rasters):
    entry = entries(rasters)
    record(tmp_path, {0: (entry("a", 0), entry("b", 0)), 2: (entry("e", 2),)})  # batch 1's file is gone
    assert names(form(tmp_path, "abef", entry)) == {0: ["a", "b"], 1: ["f"], 2: ["e"]}
    batches = form(tmp_path, "fabegh", entry)
    assert names(batches) == {0: ["a", "b"], 1: ["f", "g"], 2: ["e"], 3: ["h"]}
    assert batches[3] == (entry("h", 3),)


def test_a_removed_member_stays_in_its_kept_batch_while_its_raster_exists(tmp_path, rasters):
    entry = entries(rasters)
    fresh = form(tmp_path, "abcde", entry)
    record(tmp_path, fresh)  # 0: a b, 1: c d, 2: e
    assert form(tmp_path, "abde", entry) == fresh  # c is no longer asked for; its batch holds
    assert names(form(tmp_path, "abe", entry)) == {0: ["a", "b"], 2: ["e"]}  # nothing of batch 1 asked for
    (tmp_path / "c.tif").unlink()
    batches = form(tmp_path, "abde", entry)
    assert names(batches) == {0: ["a", "b"], 1: ["d"], 2: ["e"]} and batches[1] == (entry("d", 1),)


def test_when_two_recorded_files_claim_a_member_the_newer_wins(tmp_path, rasters):
    entry = entries(rasters)
    claims = {0: (entry("a", 0), entry("b", 0)), 1: (entry("b", 1), entry("c", 1))}
    record(tmp_path, claims, mtimes={0: 10**18, 1: 2 * 10**18})  # batch 1 was formed again later
    assert names(form(tmp_path, "abc", entry)) == {0: ["a"], 1: ["b", "c"]}
    record(tmp_path, claims, mtimes={0: 3 * 10**18, 1: 2 * 10**18})  # now batch 0 is the newer
    batches = form(tmp_path, "abc", entry)
    assert names(batches) == {0: ["a", "b"], 1: ["c"]} and batches[1] == (entry("c", 1),)


def test_batch_files_that_cannot_be_read_are_left_out(tmp_path, rasters):
    entry = entries(rasters)
    record(tmp_path, {3: (entry("a", 3),)})
    folder = tmp_path / RUN.jobs_dir("tiles")
    (folder / "batch-4.json").write_text('{"scenes": [')
    (folder / "batch-5.json").write_text('{"batch": 5}')
    (folder / "batch-x.json").write_text('{"scenes": []}')
    TilesJob((entry("b", 0),), TILING).write(folder / "scene-b.json")  # a training-only scene's: no batch
    assert [
        (r.batch, [s["name"] for s in r.scenes]) for r in read_written_batches(RUN.jobs_dir("tiles"), tmp_path)
    ] == [(3, ["a"])]
    assert read_written_batches(RUN.jobs_dir("tiles"), tmp_path / "nowhere") == []


# the command Snakemake 9 gives a job it spawns (RealExecutor's job args): --target-jobs, then --allowed-rules
JOB_ARGV = ["snakemake", "--target-jobs", "merge_batch_3:", "--allowed-rules", "merge_batch_3", "--cores", "all"]


def test_recorded_targets_name_each_record_and_the_files_gone_of_a_record_that_exists(tmp_path):
    (tmp_path / "results").mkdir()
    for name in ("done.json", "a", "c"):
        (tmp_path / "results" / name).touch()
    files = {"results/done.json": ["results/a", "results/b", "results/c"], "results/todo.json": ["results/d"]}
    # a recorded job whose file b is gone runs again because b is asked for; a job without its record runs anyway
    assert recorded_targets(files, tmp_path) == ["results/done.json", "results/b", "results/todo.json"]


@pytest.mark.parametrize(
    ("argv", "defined"),
    [
        (JOB_ARGV, [3]),
        (["snakemake", "--allowed-rules=score_batch_0 tiles_batch_12", "--nolock"], [0, 12]),
        (["snakemake", "--allowed-rules", "predict", "--force"], []),  # a prediction job needs no batch rule
        (["snakemake", "--allowed-rules", "merge_batch_99"], []),  # no such batch
        (["snakemake", "--target-jobs", "predict:batch=1,shard=0"], [0, 1, 3, 12]),  # no --allowed-rules: all
    ],
)
def test_a_jobs_reparse_defines_only_the_batch_rules_it_is_allowed_to_run(argv, defined):
    assert rule_batches([0, 1, 3, 12], main_process=False, argv=argv) == defined


def test_the_main_process_defines_every_batchs_rules_whatever_its_command_line():
    assert rule_batches([0, 1, 3, 12], main_process=True, argv=JOB_ARGV) == [0, 1, 3, 12]
    assert batch_rule("merge", 3) in JOB_ARGV and allowed_rules(["snakemake", "-n"]) is None
    with pytest.raises(ValueError, match="no per-batch rule 'predict'"):
        batch_rule("predict", 3)


# ---------------------------------------------------------------------------------------------------------
# A seam's tile manifest
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side_by_side", [True, False], ids=["east-west", "north-south"])
def test_a_seams_manifest_holds_exactly_the_tiles_meeting_its_core_widened_by_the_overlap(tmp_path, side_by_side):
    patch, overlap, border = 64, MARGIN, 230  # tiles every 48 px
    if side_by_side:  # a 230 x 200 px, b east of it: the border at column 230 of the mosaic
        rasters = {"a": scene(tmp_path / "a.tif", 0, 0, 230, 200), "b": scene(tmp_path / "b.tif", 23, 0, 300, 200)}
    else:  # a 200 x 230 px, b south of it: the border at row 230
        rasters = {"a": scene(tmp_path / "a.tif", 0, 30, 200, 230), "b": scene(tmp_path / "b.tif", 0, 0, 200, 300)}
    (seam,) = find_seams(footprints(rasters), overlap)
    vrt = write_mosaic(tmp_path / "mosaic.vrt", [str(rasters["a"]), str(rasters["b"])])
    full = build_manifest(vrt, patch, overlap)
    manifest = build_manifest(vrt, patch, overlap, core=seam.core)
    assert manifest["tile_id"].tolist() == list(range(len(manifest)))
    # the core: 16 px either side of the border; widened by 16 px more, px 198 to 262 across it
    along = full["col_off"] if side_by_side else full["row_off"]
    meets = (along < border + 2 * overlap) & (along + patch > border - 2 * overlap)
    assert 0 < meets.sum() < len(full)
    offsets = ["col_off", "row_off", "width", "height"]
    expected = full[meets][offsets].to_numpy().tolist()
    assert manifest[offsets].to_numpy().tolist() == expected
    assert set(along[meets]) == {144, 192, 240}  # the tile at 144 (to 208) meets the widened core only
    lookup = full.set_index(["col_off", "row_off"]).geometry
    for tile in manifest.itertuples():
        assert tile.geometry.equals(lookup[(tile.col_off, tile.row_off)])


# ---------------------------------------------------------------------------------------------------------
# Detection's project layer
# ---------------------------------------------------------------------------------------------------------


def write_detections(path: Path, boxes: list[tuple[float, float, float, float, float]], crs: str, origin=(X0, Y0)):
    """A source's merged detections: (score, xmin, ymin, xmax, ymax) in metres from ``origin``."""
    ox, oy = origin
    geometry = [box(ox + x0, oy + y0, ox + x1, oy + y1) for _, x0, y0, x1, y1 in boxes]
    frame = gpd.GeoDataFrame(
        {
            "tile_id": np.zeros(len(boxes), dtype=np.int64),
            "label": ["tree"] * len(boxes),
            "score": np.array([b[0] for b in boxes], dtype=np.float32),
            "px_xmin": [b[1] / PX for b in boxes],
            "px_ymin": [b[2] / PX for b in boxes],
            "px_xmax": [b[3] / PX for b in boxes],
            "px_ymax": [b[4] / PX for b in boxes],
        },
        geometry=geometry,
        crs=crs,
    )[DETECTION_COLUMNS]
    frame.to_parquet(path, index=False)
    return str(path)


C18 = (200000.0, 3285000.0)  # scene c's lower left corner in EPSG:32618, far east of a and b


def centre_in_utm17n(left: float, bottom: float) -> tuple[float, float]:
    """Where the centre of a 20 m scene with this lower left corner in EPSG:32618 lies in EPSG:32617."""
    point = gpd.GeoSeries([shapely.Point(left + 10, bottom + 10)], crs=UTM18N).to_crs(UTM17N).iloc[0]
    return point.x, point.y


@pytest.fixture
def project_job(tmp_path) -> Callable[[float], dict]:
    """Scenes a and b abutting at x = 20 m (the seam a+b's core: 18.4 to 21.6 m); far from them scene c in
    EPSG:32618, and d in EPSG:32617 whose west half overlaps c's east half (no seam across CRSs); their
    detections. The job of the project's merge at a given project.iou_threshold."""
    c_transform = Affine(PX, 0, C18[0], 0, -PX, C18[1] + 20)
    cx, cy = centre_in_utm17n(*C18)
    rasters = {
        "a": scene(tmp_path / "a.tif", 0, 0),
        "b": scene(tmp_path / "b.tif", 20, 0),
        "c": write_raster(tmp_path / "c.tif", SIDE, SIDE, crs=UTM18N, transform=c_transform),
        "d": write_raster(tmp_path / "d.tif", SIDE, SIDE, transform=Affine(PX, 0, cx, 0, -PX, cy + 10)),
    }
    prints = footprints(rasters)
    (seam,) = find_seams(prints, MARGIN)
    detections = {
        "a": [
            (0.9, 19.0, 10, 20.0, 12),  # a crown across the border: its west half, in the core
            (0.6, 16.9, 2, 18.9, 4),  # centred outside the core; the seam's box of it (IoU 0.30) scores higher
            (0.7, 16.0, 6, 18.0, 8),  # centred outside the core; the seam's box beside it: IoU 0.05
            (0.9, 2.0, 2, 4.0, 4),  # two overlapping boxes of a alone (IoU 0.82): not the project's to judge
            (0.8, 2.1, 2.1, 4.1, 4.1),
        ],
        "b": [
            (0.85, 20.0, 10, 21.0, 12),  # the crown's east half, in the core
            (0.9, 20.92, 14, 22.92, 16),  # centred outside the core; the seam's box of it (IoU 0.37) scores lower
        ],
        "a+b": [
            (0.7, 18.9, 10, 21.0, 12),  # the crown, whole
            (0.8, 17.98, 2, 19.98, 4),
            (0.6, 17.8, 6, 19.8, 8),
            (0.5, 20.0, 14, 22.0, 16),
        ],
    }
    sources = []
    for name in ["a", "b", "a+b"]:
        parquet = write_detections(tmp_path / f"{name}.parquet", detections[name], UTM17N)
        area = {"core": seam.core} if is_seam(name) else {"bounds": list(prints[name].bounds)}
        sources.append({"name": name, "crs": UTM17N, **area, "parquet": parquet})
    c_parquet = write_detections(tmp_path / "c.parquet", [(0.9, 5.0, 5.0, 7.0, 7.0)], UTM18N, origin=C18)
    sources.append({"name": "c", "crs": UTM18N, "bounds": list(prints["c"].bounds), "parquet": c_parquet})
    # d's boxes centred 3 m east of c's centre (in c: c owns that) and 15 m east (beyond c's east edge)
    d_boxes = [(0.9, 2.0, -1.0, 4.0, 1.0), (0.9, 14.0, -1.0, 16.0, 1.0)]
    d_parquet = write_detections(tmp_path / "d.parquet", d_boxes, UTM17N, origin=(cx, cy))
    sources.append({"name": "d", "crs": UTM17N, "bounds": list(prints["d"].bounds), "parquet": d_parquet})

    def job(iou_threshold: float) -> ProjectJob:
        merge = {"iou_threshold": 0.9, "edge_tolerance": 2, "containment_threshold": 0.6}
        settings = job_settings({"task": "detection", "merge": merge, "project": {"iou_threshold": iou_threshold}})
        outputs = {"parquet": str(tmp_path / "project.parquet"), "gpkg": str(tmp_path / "project.gpkg")}
        return ProjectJob(UTM17N, ("tree",), project_sources(sources), outputs, settings)

    return job


def boxes_of(frame: gpd.GeoDataFrame, origin=(X0, Y0)) -> list[tuple[str, str, tuple[float, ...]]]:
    """(source, scene, box in metres from the project's corner), sorted."""
    ox, oy = origin
    rows = []
    bounds = frame.geometry.bounds.to_numpy()
    for source, name, (x0, y0, x1, y1) in zip(frame["source"], frame["scene"], bounds, strict=True):
        rows.append((source, name, tuple(round(float(v), 3) for v in (x0 - ox, y0 - oy, x1 - ox, y1 - oy))))
    return sorted(rows)


def test_the_project_keeps_each_crown_once_from_its_owner_and_the_better_of_cross_source_duplicates(project_job):
    job = project_job(0.2)
    line = merge_project(job)
    merged = gpd.read_parquet(job.outputs["parquet"])
    assert list(merged.columns) == PROJECT_COLUMNS and merged.crs == UTM17N
    assert merged["score"].is_monotonic_decreasing
    ours = merged[merged["source"].isin(["a", "b", "a+b"])]
    assert boxes_of(ours) == [
        ("a", "a", (2.0, 2.0, 4.0, 4.0)),  # same source: untouched
        ("a", "a", (2.1, 2.1, 4.1, 4.1)),
        ("a", "a", (16.0, 6.0, 18.0, 8.0)),  # IoU 0.05 with the seam's: both kept
        ("a+b", "a", (17.8, 6.0, 19.8, 8.0)),
        ("a+b", "a", (17.98, 2.0, 19.98, 4.0)),  # a's box of it (0.6) gives way
        ("a+b", "a", (18.9, 10.0, 21.0, 12.0)),  # the crown across the border: the seam's whole box, not halves
        ("b", "b", (20.92, 14.0, 22.92, 16.0)),  # the seam's box of it (0.5) gives way
    ]
    counts = "9 detections from 4 scenes and 1 seams (11 owned, 2 duplicates across sources)"
    assert line == f"{counts} -> {job.outputs['parquet']}"
    assert len(gpd.read_file(job.outputs["gpkg"], layer="detections")) == 9


def test_a_scene_in_another_crs_has_its_detections_and_footprint_reprojected_into_the_projects_crs(project_job):
    job = project_job(0.2)
    merge_project(job)
    merged = gpd.read_parquet(job.outputs["parquet"])
    (c,) = merged[merged["source"] == "c"].itertuples()
    assert c.scene == "c"
    ox, oy = C18
    expected = gpd.GeoSeries([box(ox + 5, oy + 5, ox + 7, oy + 7)], crs=UTM18N).to_crs(UTM17N).iloc[0]
    assert c.geometry.equals_exact(expected, tolerance=1e-6)
    assert c.geometry.bounds[0] > X0 + 1e5  # in EPSG:32617 metres, not EPSG:32618's
    assert c.geometry.area == pytest.approx(4, rel=0.01)
    # c's footprint, reprojected, holds d's first box: c (first by name) owns it there; d keeps its other one
    cx, cy = centre_in_utm17n(*C18)
    assert boxes_of(merged[merged["source"] == "d"], origin=(cx, cy)) == [("d", "d", (14.0, -1.0, 16.0, 1.0))]


def test_cross_source_duplicates_are_judged_at_the_projects_iou_threshold(project_job):
    job = project_job(0.5)  # above both pairs' IoU (0.30, 0.37); their overlap is below merge.containment_threshold
    merge_project(job)
    merged = gpd.read_parquet(job.outputs["parquet"])
    kept = {box for source, _, box in boxes_of(merged) if source in ("a", "b", "a+b")}
    assert {
        (16.9, 2.0, 18.9, 4.0),
        (17.98, 2.0, 19.98, 4.0),
        (20.0, 14.0, 22.0, 16.0),
        (20.92, 14.0, 22.92, 16.0),
    } <= kept
    assert len(merged) == 11


# ---------------------------------------------------------------------------------------------------------
# The plan: the project's CRS, its seams, its batches
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def two_scene_config(workdir: Path, b_crs: str = UTM17N, b_left: float = 60, **config) -> dict:
    """a (60 x 60 m, trained on) and b (30 x 30 m) at b_left m east of a's west edge, both predicted."""
    write_raster(workdir / "a.tif", 600, 600, transform=Affine(PX, 0, X0, 0, -PX, Y0 + 60))
    write_raster(workdir / "b.tif", 300, 300, crs=b_crs, transform=Affine(PX, 0, X0 + b_left, 0, -PX, Y0 + 60))
    (workdir / "a.csv").write_text("image_path,xmin,ymin,xmax,ymax,label\na.tif,10,10,50,50,tree\n")
    return {
        "scenes": {"a": {"path": "a.tif", "annotations": "a.csv"}, "b": {"path": "b.tif"}},
        "tiling": {"patch_size": 128, "overlap": MARGIN},
        "train": {"scenes": ["a"], "validation_fraction": 0.5},
        "predict": {"scenes": "all", "scenes_per_job": 2},
        **config,
    }


def test_predicted_scenes_in_two_crss_without_project_crs_are_one_line_naming_project_crs(workdir):
    with pytest.raises(ConfigError) as err:
        build_plan(two_scene_config(workdir, b_crs=UTM18N))
    assert str(err.value) == (
        "predict.scenes: the scenes are in 2 CRSs (EPSG:32617: a; EPSG:32618: b); set project.crs to the CRS of "
        "the project's layers (e.g. project: {crs: EPSG:32618})"
    )


def test_with_project_crs_scenes_in_two_crss_plan_and_the_project_is_in_it(workdir):
    plan = build_plan(two_scene_config(workdir, b_crs=UTM18N, project={"crs": "EPSG:32617"}))
    assert plan.project_crs() == "EPSG:32617" == Steps(plan).project.job().crs
    assert plan.footprints["b"].crs == UTM18N and plan.seams == ()  # no mosaic across CRSs


def test_a_project_crs_that_is_no_crs_is_one_line_naming_project_crs(workdir):
    with pytest.raises(ConfigError) as err:
        build_plan(two_scene_config(workdir, project={"crs": "nonsense"}))
    assert str(err.value).startswith("project.crs: 'nonsense' is not a CRS (") and "\n" not in str(err.value)


def test_the_plan_of_two_abutting_scenes_predicts_their_seam_and_the_project_job_lists_every_source(workdir):
    plan = build_plan(two_scene_config(workdir))
    assert plan.project_crs() == UTM17N
    (seam,) = plan.seams
    assert seam.name == "a+b" and find_seams(plan.footprints, MARGIN) == [seam]
    assert [[s.name for s in batch.scenes] for batch in plan.batches] == [["a", "b", "a+b"]]  # a seam, its scenes'
    entry = plan.prediction_batch(0).scenes[2]
    mosaic = "results/detector/seams/a+b/mosaic.vrt"  # the run: detector (no model.name, no model.file)
    assert (entry.raster, entry.mosaic, entry.core) == (mosaic, ("a.tif", "b.tif"), seam.core)
    assert entry.manifest == "results/detector/seams/a+b/tiles.parquet"
    sources = {source.name: source.to_dict() for source in Steps(plan).project.job().sources}  # as the file says
    assert list(sources) == ["a", "b", "a+b"]
    assert sources["a"]["bounds"] == [X0, Y0, X0 + 60, Y0 + 60] and sources["a"]["crs"] == UTM17N
    assert (
        sources["a+b"]["core"] == seam.core
        and sources["a+b"]["parquet"] == "results/detector/seams/a+b/detections.parquet"
    )


def test_a_plan_keeps_its_recorded_batches_and_puts_a_new_scene_and_seam_in_a_new_one(workdir):
    config = two_scene_config(workdir)
    plan = build_plan(config)
    write_job_files(plan)  # the batches' tiles job files record their members
    write_raster(workdir / "c.tif", 300, 300, transform=Affine(PX, 0, X0 + 90, 0, -PX, Y0 + 60))  # east of b
    config["scenes"] = {"c": {"path": "c.tif"}, **config["scenes"]}  # first in the config
    again = build_plan(config)
    assert [s.name for s in again.seams] == ["a+b", "b+c"]
    assert [(batch.batch, [s.name for s in batch.scenes]) for batch in again.batches] == [
        (0, ["a", "b", "a+b"]),
        (1, ["c", "b+c"]),  # the new scene with the seam it brings
    ]
    assert again.prediction_batch(0) == plan.prediction_batch(0)


def class_raster(path: Path, data: np.ndarray, left: float) -> Path:
    """A class-id COG-like GeoTIFF (uint8, nodata 255) of ``data`` at x = ``left`` (0.1 m pixels)."""
    transform = Affine(0.1, 0, left, 0, -0.1, 3285000.0)
    with rasterio.open(
        path, "w", driver="GTiff", width=data.shape[1], height=data.shape[0], count=1, dtype="uint8",
        crs=UTM17N, transform=transform, nodata=255, tiled=True, blockxsize=16, blockysize=16,
    ) as dst:  # fmt: skip
        dst.write(data, 1)
    return path


def test_segmentation_project_draws_a_seams_classes_over_its_scenes_where_it_predicted_and_polygonizes_them(tmp_path):
    from rasterscale.tasks.segmentation.spec import merge_project as merge_classes

    a = class_raster(tmp_path / "a.tif", np.zeros((32, 32), np.uint8), 404000.0)  # background, left
    b = class_raster(tmp_path / "b.tif", np.zeros((32, 32), np.uint8), 404003.2)  # background, right
    seam = np.full((32, 64), 255, np.uint8)
    seam[8:24, 24:40] = 1  # a crown across the border, only the seam saw whole
    seam_path = class_raster(tmp_path / "seam.tif", seam, 404000.0)
    sources = [
        {"name": "a", "crs": "EPSG:32617", "classes": str(a)},
        {"name": "a+b", "crs": "EPSG:32617", "classes": str(seam_path)},
        {"name": "b", "crs": "EPSG:32617", "classes": str(b)},
    ]
    outputs = {"classes": str(tmp_path / "project/classes.vrt"), "gpkg": str(tmp_path / "project/classes.gpkg")}
    settings = job_settings({"task": "segmentation"})
    job = ProjectJob("EPSG:32617", ("background", "tree"), project_sources(sources), outputs, settings)
    merge_classes(job)
    with rasterio.open(tmp_path / "project/classes.vrt") as src:
        classes = src.read(1)
    expected = np.zeros((32, 64), np.uint8)
    expected[8:24, 24:40] = 1
    assert np.array_equal(classes, expected)  # the seam's nodata leaves the scenes' classes showing
    polygons = gpd.read_file(tmp_path / "project/classes.gpkg")
    assert list(polygons["label"]) == ["tree"] and polygons.area.iloc[0] == pytest.approx(16 * 16 * 0.01)


def write_crowns(path: Path, crowns: list[tuple[float, shapely.Geometry]]) -> str:
    """A scene's (or seam's) merged crown layer: (score, polygon in metres from the project's corner) each."""
    geometry = [shapely.affinity.translate(polygon, X0, Y0) for _, polygon in crowns]
    frame = gpd.GeoDataFrame(
        {
            "label": ["tree"] * len(crowns),
            "score": np.array([score for score, _ in crowns], dtype=np.float32),
            "area_m2": shapely.area(geometry),
            "perimeter_m": shapely.length(geometry),
        },
        geometry=geometry,
        crs=UTM17N,
    )
    frame.to_parquet(path, index=False)
    return str(path)


def ell(x: float, y: float, flip: bool) -> shapely.Geometry:
    """An L-shaped crown in the 2 m square at (x, y): its lower and left arms, or (flip) its upper and right ones.
    Two such crowns, flipped and not, share their box but hardly overlap."""
    shape = shapely.Polygon([(0, 0), (2, 0), (2, 0.5), (0.5, 0.5), (0.5, 2), (0, 2)])
    if flip:
        shape = shapely.affinity.rotate(shape, 180, origin=(1, 1))
    return shapely.affinity.translate(shape, x, y)


def test_the_project_of_crowns_keeps_each_crown_once_by_polygon_iou_across_sources(tmp_path):
    """Instances' project layer: a crown across the border between a and b comes whole from their seam; a crown
    found by a scene and by the seam (polygon IoU 0.3) is kept once, the better; two crowns from the two sides whose
    boxes coincide but whose polygons hardly overlap (interleaved L shapes) both stay, which box IoU would not let."""
    from rasterscale.tasks.instances.project import PROJECT_CROWN_COLUMNS
    from rasterscale.tasks.instances.project import merge_project as merge_crowns

    prints = footprints({"a": scene(tmp_path / "a.tif", 0, 0), "b": scene(tmp_path / "b.tif", 20, 0)})
    (seam,) = find_seams(prints, MARGIN)
    disc = shapely.Point(20.0, 10.0).buffer(1.0)  # across the border x = 20 m
    crowns = {  # (score, polygon in metres from the project's corner)
        "a": [(0.9, shapely.intersection(disc, box(0, 0, 20, 20))), (0.6, box(16.9, 2, 18.9, 4))],
        "b": [(0.85, shapely.intersection(disc, box(20, 0, 40, 20))), (0.8, ell(20.3, 15, flip=True))],
        "a+b": [(0.7, disc), (0.8, box(17.98, 2, 19.98, 4)), (0.6, ell(20.3, 15, flip=False))],
    }
    sources = []
    for name, rows in crowns.items():
        area = {"core": seam.core} if is_seam(name) else {"bounds": list(prints[name].bounds)}
        parquet = write_crowns(tmp_path / f"{name}.parquet", rows)
        sources.append({"name": name, "crs": UTM17N, **area, "parquet": parquet})
    merge = {"iou_threshold": 0.4, "edge_tolerance": 2, "containment_threshold": 0.6}
    settings = job_settings({"task": "instances", "merge": merge, "project": {"iou_threshold": 0.2}})
    outputs = {"parquet": str(tmp_path / "project.parquet"), "gpkg": str(tmp_path / "project.gpkg")}
    job = ProjectJob(UTM17N, ("tree",), project_sources(sources), outputs, settings)
    line = merge_crowns(job)
    merged = gpd.read_parquet(job.outputs["parquet"])
    assert list(merged.columns) == PROJECT_CROWN_COLUMNS and merged.crs == UTM17N
    assert boxes_of(merged) == [
        ("a+b", "a", (17.98, 2.0, 19.98, 4.0)),  # a's square of it (IoU 0.30, 0.6) gives way to the seam's (0.8)
        ("a+b", "a", (19.0, 9.0, 21.0, 11.0)),  # the crown across the border: the seam's whole disc, not halves
        ("a+b", "b", (20.3, 15.0, 22.3, 17.0)),  # two L shapes of one box, from either side: both kept
        ("b", "b", (20.3, 15.0, 22.3, 17.0)),
    ]
    np.testing.assert_allclose(merged["area_m2"], merged.geometry.area)
    counts = "4 crowns from 2 scenes and 1 seams (5 owned, 1 duplicates across sources)"
    assert line == f"{counts} -> {job.outputs['parquet']}"


def test_recorded_targets_look_only_in_folders_changed_since_the_record(tmp_path):
    folder = tmp_path / "results" / "s1"
    folder.mkdir(parents=True)
    (folder / "a").touch()
    record = tmp_path / "results" / "done.json"
    record.touch()
    later = folder.stat().st_mtime_ns + 10**9
    os.utime(record, ns=(later, later))  # written a second after the folder last changed
    files = {"results/done.json": ["results/s1/a", "results/s1/b"]}
    # b was never written, and its folder is older than the record: not looked for (no stat)
    assert recorded_targets(files, tmp_path) == ["results/done.json"]
    (folder / "a").unlink()  # a deletion sets the folder's mtime: both files looked for again
    os.utime(folder, ns=(later, later))  # even within the record's clock tick
    assert recorded_targets(files, tmp_path) == ["results/done.json", "results/s1/a", "results/s1/b"]


def test_requested_files_are_the_command_lines_words_as_paths_of_the_working_directory(tmp_path):
    argv = ["snakemake", "--cores", "2", "results/m/a/detections.gpkg", str(tmp_path / "results/m/b/x.tif"), "all"]
    assert requested_files(argv, tmp_path) == {"2", "results/m/a/detections.gpkg", "results/m/b/x.tif", "all"}
