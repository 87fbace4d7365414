"""Entry: write the tile manifest (GeoParquet) and imagery spec (bands, mask, scale to uint8 or raw values) of each
scene of a tiles job file (a batch's scenes, or one training-only scene): one process for many scenes. A seam's
mosaic of its scenes' rasters is written first, and its manifest holds the tiles near its core. A scene whose header
the plan took from its STAC item has its real header compared with the item's (rasterscale.raster.item_header)."""

import argparse
from pathlib import Path

from rasterscale.atomic import write_json
from rasterscale.errors import InputError, run_entry
from rasterscale.grid.manifest import build_manifest, write_manifest
from rasterscale.grid.tile import TileGrid
from rasterscale.jobs.files import TilesJob
from rasterscale.raster.cog import striped_sources
from rasterscale.raster.headers import RasterInfo, check_raster
from rasterscale.raster.imagery import resolve_spec
from rasterscale.raster.item_header import ItemHeader, verify
from rasterscale.raster.mosaic import write_mosaic
from rasterscale.raster.remote import check_tiled, shown
from rasterscale.scene import Imagery, Scene


def write_scene_manifest(scene: Scene, job: TilesJob) -> None:
    raster, tiling = scene.raster, job.settings.tiling
    info = checked_raster(scene, job)
    imagery = scene.imagery or Imagery()
    spec = resolve_spec(raster, imagery.bands, imagery.scale, imagery.key, imagery.raw)
    print(f"{shown(raster)}: imagery {spec.describe()}")
    manifest = build_manifest(raster, tiling.patch_size, tiling.overlap, tiling.skip_nodata, spec, scene.core)
    write_manifest(manifest, spec, TileGrid(tiling.patch_size, tiling.overlap), scene.manifest)
    print(f"{shown(raster)}: {info.width}x{info.height} px -> {len(manifest)} tiles -> {scene.manifest}")


def checked_raster(scene: Scene, job: TilesJob) -> RasterInfo:
    """A scene's real header; for one whose STAC item the plan trusted, compared with what the item said (a
    difference, or a raster that will not read, is recorded for the next plan and stops the job with one line)."""
    if scene.name not in job.trusted:
        return check_raster(scene.raster)
    record = Path(job.records) / f"{scene.name}.json"
    try:
        info = verify(ItemHeader.from_dict(job.trusted[scene.name]), scene.raster, record)
    except InputError:
        print(f"{scene.name}: recorded in {record}: with scenes_on_error: skip the next run leaves the scene out")
        raise
    check_tiled(scene.raster, striped_sources(scene.raster))  # the plan took a trusted raster to be tiled
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="the tiles job file (rasterscale.jobs.files.TilesJob)")
    parser.add_argument("--record", help="the batch's record to write last (JSON: the files written)")
    args = parser.parse_args()
    job = TilesJob.read(args.job)
    written = []
    for scene in job.scenes:
        if scene.mosaic:  # a seam: its scenes' rasters as one
            write_mosaic(scene.raster, scene.mosaic)
            written.append(scene.raster)
        write_scene_manifest(scene, job)
        written.append(scene.manifest)
    if args.record:
        write_json({"job": args.job, "outputs": written}, args.record)  # last: the batch's manifests are done


if __name__ == "__main__":
    run_entry(main)
