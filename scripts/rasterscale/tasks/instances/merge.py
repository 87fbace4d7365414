"""Instances' merge: a scene's rank files of crown polygons (:mod:`.polygons`) into one layer of crowns, each
crown once, whatever the tile overlaps.

Which tiles each rank processed is in its record (:mod:`rasterscale.predict.rankfiles`), checked before. Then,
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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import geopandas as gpd
import numpy as np
import pandas as pd
import pyproj
import shapely

from rasterscale.atomic import write_geoparquet, write_gpkg
from rasterscale.raster.geo import intersection_areas
from rasterscale.tasks.instances.polygons import (
    BOX_COLUMNS,
    empty_instances,
    ious_of,
    overlap_areas,
    polygon_pairs,
)
from rasterscale.tasks.objects import count_labels, cut_by_inner_edge, greedy_nms, merge_rank_files

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


def merge_instances(
    instances: gpd.GeoDataFrame,
    manifest: pd.DataFrame,
    raster_width: int,
    raster_height: int,
    iou_threshold: float,
    edge_tolerance: float,
    containment_threshold: float,
) -> gpd.GeoDataFrame:
    """The rank files' rows (:data:`~.polygons.INSTANCE_COLUMNS`) without the duplicates that tile overlaps
    create (see the module docstring), sorted by score."""
    if len(instances) == 0:
        return instances.reset_index(drop=True)
    windows = manifest.set_index("tile_id").loc[instances["tile_id"], ["col_off", "row_off", "width", "height"]]
    boxes = instances[BOX_COLUMNS].to_numpy(dtype=np.float64)
    cut = instances["cut"].to_numpy(dtype=bool)
    cut = cut | cut_by_inner_edge(boxes, windows.to_numpy(), raster_width, raster_height, edge_tolerance)
    geometries = np.asarray(instances.geometry.array, dtype=object)
    areas = shapely.area(geometries)
    labels = pd.factorize(instances["label"])[0]
    pairs = candidate_pairs(geometries, areas, labels)
    keep = drop_covered_cut(geometries, areas, cut, pairs, iou_threshold, containment_threshold)
    keep = mask_nms(geometries, areas, instances["score"].to_numpy(), keep, pairs, iou_threshold)
    merged = instances.iloc[np.flatnonzero(keep)].sort_values("score", ascending=False, kind="stable")
    return merged.reset_index(drop=True)


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


def merge_scene(
    rank_files: Sequence[str | Path],
    manifest_path: str | Path,
    raster_path: str | Path,
    gpkg_path: str | Path,
    parquet_path: str | Path,
    merge_cfg: Mapping[str, float],
    layer: str = LAYER,
) -> gpd.GeoDataFrame:
    """Merge a scene's rank files (their records already checked: :mod:`rasterscale.predict.rankfiles`) across tile
    overlaps; write the crowns as GeoParquet and GeoPackage (atomically); the crowns."""
    merged, raster = merge_rank_files(
        rank_files, manifest_path, raster_path, merge_cfg, empty_instances, merge_instances
    )
    crowns = crown_layer(merged, raster.crs)
    write_geoparquet(crowns, parquet_path)
    write_gpkg(crowns, gpkg_path, layer=layer)
    return crowns


def count_instances(path: str | Path, labels: Sequence[str]) -> dict[str, int]:
    """A layer of crowns' instances per label: each of ``labels`` (0 when it has none), then any other label the
    layer holds. Only its label column is read."""
    return count_labels(path, labels)
