"""Checks of ground-truth geometries, each failing with one line that names the file and the feature (an OGR
feature id, a GeoParquet row, a COCO annotation id): what the tasks that read vector ground truth share.

- :func:`read_features`: an OGR vector file or GeoParquet, with its features' names (a file of another kind, a
  CSV or VOC file of pixel boxes, a COCO file, a raster, named as such: :func:`file_kind`);
- :func:`check_polygonal`: every geometry is there and is a polygon (detection's boxes and instances' crowns are
  areas; a point or a line is a tree top or a transect, not an object's extent);
- :func:`check_points`: every geometry is there and is a point (a tree top is a location, not an area);
  every vector file a task reads of a scene has its geometries' types checked by one of these two, at the dry run
  (the task's ``check_annotations`` and ``check_scene_keys``) as when its job reads it: detection's boxes and
  instances' crowns (``scenes.X.annotations``), segmentation's polygons (the same key, empty geometries left out),
  regression's true tree tops (``scenes.X.tree_tops``);
- :func:`mend_polygons`: invalid polygons (a ring crossing itself) mended with ``shapely.make_valid`` where the
  result is one polygon, else an error;
- :func:`single_polygons`: one polygon each (a multipolygon of several parts is several objects);
- :func:`clip_to_frame`: polygons clipped to a raster's pixel frame, the ones wholly outside it told apart;
- :func:`count_rectangles`: how many polygons are axis-aligned rectangles (boxes given as outlines).

Torch-free: it runs at plan time (``snakemake -n``) and in the evaluation job.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import geopandas as gpd
import numpy as np
import shapely

from rasterscale.errors import InputError

POLYGON, MULTIPOLYGON = shapely.GeometryType.POLYGON, shapely.GeometryType.MULTIPOLYGON
POINT = shapely.GeometryType.POINT
RASTER_SUFFIXES = (".tif", ".tiff", ".vrt", ".img", ".jp2")
RECTANGLE_TOLERANCE = 1e-6  # a rectangle's area is its envelope's within this share
MENDED_SHARE = 0.99  # a mended polygon's largest part must hold this share of its area (slivers go)


def type_name(geometry: shapely.Geometry) -> str:
    """A geometry's type as OGR and shapely name it (``Point``, ``MultiLineString``, ...)."""
    return str(geometry.geom_type)


def check_present(path: str, geometries: np.ndarray, names: Sequence[str], needs: str) -> None:
    """The first missing or empty geometry fails with one line naming its feature and what the task ``needs``."""
    empty = shapely.is_missing(geometries) | shapely.is_empty(geometries)
    if empty.any():
        first = int(np.flatnonzero(empty)[0])
        raise InputError(
            f"{path}: {names[first]} has an empty geometry ({int(empty.sum())} such); {needs} (draw it, or delete "
            "the feature)"
        )


def check_of_kinds(
    path: str, geometries: np.ndarray, names: Sequence[str], kinds: set[int], plural: str, needs: str
) -> None:
    """The first geometry of another type than ``kinds`` (shapely's type ids; ``plural`` names them) fails with one
    line naming its feature, how many there are, and what the task ``needs``."""
    other = ~np.isin(shapely.get_type_id(geometries), sorted(kinds))
    if other.any():
        first = int(np.flatnonzero(other)[0])
        raise InputError(
            f"{path}: {names[first]} is a {type_name(geometries[first])} ({int(other.sum())} of {len(geometries)} "
            f"features are no {plural}); {needs}"
        )


def check_points(path: str, geometries: np.ndarray, names: Sequence[str], needs: str) -> None:
    """Every geometry there and a point: :func:`check_polygonal`'s rule for locations (tree tops), with what the
    task ``needs`` (e.g. ``tree tops need points``)."""
    geometries = np.asarray(geometries, dtype=object)
    check_present(path, geometries, names, needs)
    check_of_kinds(path, geometries, names, {POINT}, f"{POINT.name.lower()}s", needs)  # "points"


def check_polygonal(
    path: str, geometries: np.ndarray, names: Sequence[str], needs: str, empty_ok: bool = False
) -> np.ndarray:
    """The first missing or empty geometry, or one that is no (multi)polygon, fails with one line naming its
    feature (``names[i]``, e.g. ``feature 7``) and saying what the task ``needs`` (e.g. ``boxes need polygons``).
    ``empty_ok``: missing and empty geometries are left out instead (segmentation's: they cover no pixel), and a
    file of none but those fails. The mask of the geometries kept."""
    geometries = np.asarray(geometries, dtype=object)
    if not empty_ok:
        check_present(path, geometries, names, needs)
        check_of_kinds(path, geometries, names, {POLYGON, MULTIPOLYGON}, "polygons", needs)
        return np.ones(len(geometries), dtype=bool)
    kept = ~(shapely.is_missing(geometries) | shapely.is_empty(geometries))
    if not kept.any():
        raise InputError(f"{path}: holds no polygons ({len(geometries)} features, none with a geometry); {needs}")
    at = np.flatnonzero(kept)
    check_of_kinds(path, geometries[kept], [names[i] for i in at.tolist()], {POLYGON, MULTIPOLYGON}, "polygons", needs)
    return kept


def polygonal_part(geometry: shapely.Geometry) -> shapely.Geometry:
    """The polygons of a geometry (of a collection: its polygonal members, joined), empty when it has none."""
    kind = shapely.get_type_id(geometry)
    if kind in (POLYGON, MULTIPOLYGON):
        return geometry
    parts = [part for part in shapely.get_parts(geometry) if shapely.get_type_id(part) in (POLYGON, MULTIPOLYGON)]
    return shapely.union_all(parts) if parts else shapely.Polygon()


def mend_polygon(geometry: shapely.Geometry) -> shapely.Polygon | None:
    """An invalid (multi)polygon mended into one polygon, or None when it cannot be: ``shapely.make_valid`` keeps
    its area; the result is accepted when its largest polygon holds :data:`MENDED_SHARE` of that area (the slivers
    of a ring overshooting its start go; the two triangles of a bow-tie are two objects, not one)."""
    mended = polygonal_part(shapely.make_valid(geometry))
    parts = [part for part in shapely.get_parts(mended) if not part.is_empty]
    if not parts:
        return None
    areas = np.array([part.area for part in parts])
    largest = int(np.argmax(areas))
    if areas.sum() <= 0 or areas[largest] < MENDED_SHARE * areas.sum():
        return None
    polygon = parts[largest]
    return polygon if isinstance(polygon, shapely.Polygon) else None


def mend_polygons(path: str, geometries: np.ndarray, names: Sequence[str]) -> np.ndarray:
    """The (multi)polygons with every invalid one mended (:func:`mend_polygon`); the first that will not mend
    fails with one line naming its feature and why it is invalid."""
    geometries = np.array(geometries, dtype=object)
    for index in np.flatnonzero(~shapely.is_valid(geometries)).tolist():
        mended = mend_polygon(geometries[index])
        if mended is None:
            reason = shapely.is_valid_reason(geometries[index])
            raise InputError(
                f"{path}: {names[index]} is an invalid polygon ({reason}) that does not mend into one polygon "
                "(a bow-tie is two objects): redraw it, or split it into its parts"
            )
        geometries[index] = mended
    return geometries


def single_polygons(path: str, geometries: np.ndarray, names: Sequence[str], what: str) -> np.ndarray:
    """Each (multi)polygon as one Polygon: a multipolygon of one part is that part; one of several parts fails
    with one line naming its feature (it is several ``what``, or one to draw as one polygon)."""
    geometries = np.array(geometries, dtype=object)
    counts = shapely.get_num_geometries(geometries)
    multi = shapely.get_type_id(geometries) == MULTIPOLYGON
    several = multi & (counts > 1)
    if several.any():
        first = int(np.flatnonzero(several)[0])
        raise InputError(
            f"{path}: {names[first]} is a MultiPolygon of {int(counts[first])} parts ({int(several.sum())} such); "
            f"a {what} is one polygon: explode them if they are several {what}s, or draw each as one polygon"
        )
    if multi.any():
        geometries[multi] = shapely.get_geometry(geometries[multi], 0)
    return geometries


def clip_to_frame(geometries: np.ndarray, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """Polygons in pixel coordinates clipped to the frame ``0..width, 0..height`` (a polygon cut by the frame into
    pieces becomes a MultiPolygon), and a mask of those with no area inside it."""
    geometries = np.array(geometries, dtype=object)
    bounds = shapely.bounds(geometries).reshape(-1, 4)
    crossing = (bounds[:, 0] < 0) | (bounds[:, 1] < 0) | (bounds[:, 2] > width) | (bounds[:, 3] > height)
    if crossing.any():
        clipped = shapely.intersection(geometries[crossing], shapely.box(0, 0, width, height))
        geometries[crossing] = [polygonal_part(geometry) for geometry in clipped]
    return geometries, shapely.area(geometries) <= 0


def count_rectangles(geometries: np.ndarray, tolerance: float = RECTANGLE_TOLERANCE) -> int:
    """How many of the polygons are axis-aligned rectangles: one ring of 4 corners (5 coordinates, or 4 with the
    ring not closed by repeating its start) whose area is its envelope's, within ``tolerance`` (a share)."""
    geometries = np.asarray(geometries, dtype=object)
    if not len(geometries):
        return 0
    polygons = shapely.get_type_id(geometries) == POLYGON
    simple = polygons & (shapely.get_num_interior_rings(geometries) == 0)
    corners = np.zeros(len(geometries), dtype=bool)
    corners[simple] = shapely.get_num_coordinates(shapely.get_exterior_ring(geometries[simple])) == 5
    area, envelope = shapely.area(geometries), shapely.area(shapely.envelope(geometries))
    return int((corners & (envelope > 0) & (np.abs(envelope - area) <= tolerance * envelope)).sum())


def read_features(path: str, needs: str = "needs geometries") -> tuple[gpd.GeoDataFrame, list[str]]:
    """An OGR vector file or GeoParquet as a frame, and its features' names for messages: ``feature <fid>`` (the
    id QGIS shows) or, for GeoParquet, ``row <n>`` (from 0). One line naming the file when it cannot be read, or
    holds no geometries (a CSV of pixel boxes, a COCO file, a raster: :func:`file_kind`), with what the task
    ``needs``."""
    try:
        if path.endswith(".parquet"):
            frame = gpd.read_parquet(path)
            return frame, [f"row {n}" for n in range(len(frame))]
        with warnings.catch_warnings():  # a URL's query after its name: GDAL's warning would show it, secrets too
            warnings.filterwarnings("ignore", ".* non conformant file extension", RuntimeWarning)
            frame = gpd.read_file(path, fid_as_index=True)
    except Exception as err:  # pyogrio and pyarrow raise many types
        raise unreadable(path, err, needs) from err
    if not isinstance(frame, gpd.GeoDataFrame) or frame.geometry.name not in frame.columns:
        raise InputError(f"{path}: {file_kind(path) or 'a table without geometries'}; {needs}")
    return frame, [f"feature {fid}" for fid in frame.index]


def unreadable(path: str, error: BaseException, needs: str) -> InputError:
    """The one line of a file that OGR will not read as a vector file: what it is where its name says
    (:func:`file_kind`) and what the task needs, else OGR's reason."""
    kind = file_kind(path)
    if kind is not None:
        return InputError(f"{path}: {kind}; {needs}")
    return InputError(f"{path}: not a readable vector file ({str(error).splitlines()[0]})")


def file_kind(path: str) -> str | None:
    """What an annotation file that is no vector file of geometries in a CRS is, told by its name (a ``.json`` by
    its keys): a DeepForest CSV or Pascal VOC file of pixel boxes, a COCO instances file, a raster; None for
    anything else."""
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":
        return "a CSV of boxes in pixels (DeepForest's), no outlines and no CRS"
    if suffix == ".xml":
        return "a Pascal VOC XML file of boxes in pixels, no outlines and no CRS"
    if suffix in RASTER_SUFFIXES:
        return "a raster, not a vector file"
    if suffix == ".json":
        with contextlib.suppress(OSError, UnicodeDecodeError, json.JSONDecodeError):
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if isinstance(data, dict) and {"images", "annotations"} <= set(data):
                return "a COCO instances file (outlines in an image's pixels, no CRS)"
    return None
