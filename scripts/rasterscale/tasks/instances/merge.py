"""Instances' merge: a scene's rank files of crown polygons (:mod:`.polygons`) into one layer of crowns, each
crown once, whatever the tile overlaps.

Which tiles each rank processed is in its record (:mod:`rasterscale.jobs.rankfiles`), checked before. Then,
as detection's merge does with boxes, but by mask (polygon) overlap:

1. an instance *cut* by an inner tile edge (its mask reaches an edge of its tile that is not the raster's, or its
   box comes within ``merge.edge_tolerance`` px of one) is dropped when a whole (uncut) instance of the same label
   overlaps it: ``merge.containment_threshold`` of it lies inside the whole one, or their IoU passes
   ``merge.iou_threshold``. A crown is kept from the tile that holds it whole, whichever scores higher;
2. greedy NMS by polygon IoU above ``merge.iou_threshold``, highest score first, same label only.

Both steps look only at the pairs found once with an STRtree over the polygons' envelopes, and intersect only
the pairs that could pass a threshold: a pair's intersection is at most the smallest of its envelopes'
intersection and its two areas, which bounds its IoU and containment. Neighbouring crowns, whose envelopes
meet at their corners, are left out by that bound. Step 1 stops at the first whole instance that covers a cut
one (tried best bound first); step 2 intersects only the instances step 1 kept. The intersections are vectorised
GEOS calls, in chunks over the cores the process may use (a million crowns: docs/performance.md).

The layer (``crowns.parquet``, ``crowns.gpkg``): ``label``, ``score``, ``area_m2``, ``perimeter_m`` and the polygon,
in the raster's CRS, sorted by score. Areas and perimeters are in metres whatever the CRS's linear unit (feet
too); a geographic CRS's polygons are measured in the UTM zone of the layer's centre (the layer stays in degrees).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import geopandas as gpd
import numpy as np
import pandas as pd
import pyproj
import shapely

from rasterscale.raster.geo import intersection_areas
from rasterscale.tasks.detectors.merge import SceneLayer, greedy_nms, merge_across_tiles
from rasterscale.tasks.detectors.merge import merge_scene as merge_objects
from rasterscale.tasks.instances.polygons import (
    empty_instances,
    ious_of,
    overlap_areas,
    polygon_pairs,
)

CROWN_COLUMNS = ["label", "score", "area_m2", "perimeter_m", "geometry"]
LAYER = "crowns"


@dataclass(frozen=True)
class Pairs:
    """Same-label pairs (i, j), i < j, of instances whose envelopes overlap, and the most their polygons'
    intersection can be: the smallest of their envelopes' intersection and their two areas."""

    i: np.ndarray
    j: np.ndarray
    most: np.ndarray


def candidate_pairs(geometries: np.ndarray, areas: np.ndarray, labels: np.ndarray) -> Pairs:
    """The pairs that could overlap at all (STRtree over the envelopes), with their bound."""
    i, j = polygon_pairs(geometries)
    same = labels[i] == labels[j]
    i, j = i[same], j[same]
    bounds = shapely.bounds(geometries)
    most = np.minimum(intersection_areas(bounds[i], bounds[j]), np.minimum(areas[i], areas[j]))
    return Pairs(i, j, most)


def covers(
    inter: np.ndarray, part_area: np.ndarray, whole_area: np.ndarray, iou: float, containment: float
) -> np.ndarray:
    """Whether a whole instance covers a cut one, given (a bound of) their intersection: ``containment`` of the
    cut one inside it, or their IoU above ``iou``."""
    inside = np.divide(inter, part_area, out=np.zeros_like(inter), where=part_area > 0)
    return (inside >= containment) | (ious_of(inter, part_area, whole_area) > iou)


def drop_covered_cut(
    geometries: np.ndarray,
    areas: np.ndarray,
    cut: np.ndarray,
    pairs: Pairs,
    iou_threshold: float,
    containment_threshold: float,
) -> np.ndarray:
    """Keep-mask dropping the cut instances that a whole one of the same label covers (step 1).

    One whole instance covering a cut one is enough: each cut one's candidates (those whose bound could cover
    it) are tried in rounds, the most promising first, and the cut ones covered leave the next rounds. A cut
    crown is usually covered by its first candidate, its whole view."""
    keep = np.ones(len(areas), dtype=bool)
    one_cut = cut[pairs.i] != cut[pairs.j]
    part, whole = np.where(cut[pairs.i], pairs.i, pairs.j), np.where(cut[pairs.i], pairs.j, pairs.i)
    maybe = one_cut & covers(pairs.most, areas[part], areas[whole], iou_threshold, containment_threshold)
    part, whole, most = part[maybe], whole[maybe], pairs.most[maybe]
    order = np.lexsort((-most / np.maximum(areas[part], 1e-12), part))  # by cut instance, best bound first
    part, whole = part[order], whole[order]
    first = np.r_[True, part[1:] != part[:-1]] if len(part) else np.zeros(0, dtype=bool)
    turn = np.arange(len(part)) - np.maximum.accumulate(np.where(first, np.arange(len(part)), 0))
    for rank in range(int(turn.max(initial=-1)) + 1):
        rows = np.flatnonzero((turn == rank) & keep[part])
        inter = overlap_areas(geometries[part[rows]], geometries[whole[rows]])
        covered = covers(inter, areas[part[rows]], areas[whole[rows]], iou_threshold, containment_threshold)
        keep[part[rows[covered]]] = False
    return keep


def mask_nms(
    geometries: np.ndarray,
    areas: np.ndarray,
    scores: np.ndarray,
    keep: np.ndarray,
    pairs: Pairs,
    iou_threshold: float,
) -> np.ndarray:
    """Keep-mask of greedy NMS by polygon IoU among the instances ``keep`` holds (step 2): only the pairs of
    kept instances whose bound passes the threshold are intersected."""
    i, j = pairs.i, pairs.j
    maybe = keep[i] & keep[j] & (ious_of(pairs.most, areas[i], areas[j]) > iou_threshold)
    i, j = i[maybe], j[maybe]
    suppressing = ious_of(overlap_areas(geometries[i], geometries[j]), areas[i], areas[j]) > iou_threshold
    return keep & greedy_nms(np.asarray(scores, dtype=np.float64), i[suppressing], j[suppressing])


def keep_instances(
    instances: gpd.GeoDataFrame, boxes: np.ndarray, cut: np.ndarray, iou_threshold: float, containment_threshold: float
) -> np.ndarray:
    """The indexes of the instances kept across tile overlaps (see the module docstring): those whose box nears an
    inner tile edge (``cut``) or whose mask reaches one (the rank files' ``cut``) are cut."""
    cut = cut | instances["cut"].to_numpy(dtype=bool)
    geometries = np.asarray(instances.geometry.array, dtype=object)
    areas = shapely.area(geometries)
    labels = pd.factorize(instances["label"])[0]
    pairs = candidate_pairs(geometries, areas, labels)
    keep = drop_covered_cut(geometries, areas, cut, pairs, iou_threshold, containment_threshold)
    keep = mask_nms(geometries, areas, instances["score"].to_numpy(), keep, pairs, iou_threshold)
    return np.flatnonzero(keep)


# (instances: the rank files' rows, INSTANCE_COLUMNS of .polygons; manifest, raster width, raster height,
# iou_threshold, edge_tolerance, containment_threshold) -> the rows without the duplicates that tile overlaps create
# (see the module docstring), sorted by score
merge_instances = partial(merge_across_tiles, keep_instances)


def metric_measures(geometries: np.ndarray, crs: object) -> tuple[np.ndarray, np.ndarray]:
    """Areas (m²) and perimeters (m) of polygons in ``crs``: a projected CRS's units converted to metres, a
    geographic CRS's polygons measured in the UTM zone of their centre."""
    crs = pyproj.CRS.from_user_input(crs)
    if crs.is_geographic and len(geometries):
        series = gpd.GeoSeries(geometries, crs=crs)
        geometries, factor = np.asarray(series.to_crs(series.estimate_utm_crs()).array, dtype=object), 1.0
    else:
        factor = crs.axis_info[0].unit_conversion_factor if crs.axis_info else 1.0
    return shapely.area(geometries) * factor**2, shapely.length(geometries) * factor


def crown_layer(merged: gpd.GeoDataFrame, crs: object) -> gpd.GeoDataFrame:
    """The scene's layer of crowns (:data:`CROWN_COLUMNS`) from merged rank rows, in ``crs``."""
    geometries = np.asarray(merged.geometry.array, dtype=object)
    area, perimeter = metric_measures(geometries, crs)
    frame = pd.DataFrame(
        {
            "label": merged["label"].astype(str).to_numpy(),
            "score": merged["score"].to_numpy(dtype=np.float32),
            "area_m2": area,
            "perimeter_m": perimeter,
        }
    )
    return gpd.GeoDataFrame(frame, geometry=gpd.GeoSeries(geometries, crs=crs), crs=crs)


CROWNS = SceneLayer(empty_instances, merge_instances, crown_layer, LAYER)

# (rank files, tile manifest, raster, GeoPackage, GeoParquet, the merge section) -> the scene's crowns, written
# (their records already checked: rasterscale.jobs.rankfiles)
merge_scene = partial(merge_objects, CROWNS)
