"""Entry: write a scene's tile manifest (GeoParquet) and its imagery spec (bands, mask, scale to uint8 or raw
values), or each scene's of a batch (its job file lists their rasters, manifests and imagery keys): one process for
many scenes. A seam's mosaic of its scenes' rasters is written first, and its manifest holds the tiles near its
core."""

import argparse
import json

from rasterscale.atomic import write_json
from rasterscale.errors import run_entry
from rasterscale.grid.manifest import build_manifest, write_manifest
from rasterscale.grid.tile import TileGrid
from rasterscale.jobs.files import PredictionBatch
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import resolve_spec
from rasterscale.raster.mosaic import write_mosaic
from rasterscale.raster.remote import shown
from rasterscale.scene import Imagery


def write_scene_manifest(
    raster: str, out: str, imagery: Imagery | None, args: argparse.Namespace, core: str = ""
) -> None:
    info = check_raster(raster)
    imagery = imagery or Imagery()
    spec = resolve_spec(raster, imagery.bands, imagery.scale, imagery.key, imagery.raw)
    print(f"{shown(raster)}: imagery {spec.describe()}")
    manifest = build_manifest(raster, args.patch_size, args.overlap, args.skip_nodata, spec, core)
    write_manifest(manifest, spec, TileGrid(args.patch_size, args.overlap), out)
    print(f"{shown(raster)}: {info.width}x{info.height} px -> {len(manifest)} tiles -> {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    scenes = parser.add_mutually_exclusive_group(required=True)
    scenes.add_argument("--raster", help="one scene's raster (with --out)")
    scenes.add_argument("--job", help="a batch's job file (JSON: scenes with raster, manifest and imagery)")
    parser.add_argument("--out")
    parser.add_argument("--record", help="with --job: the batch's record to write last (JSON: the files written)")
    parser.add_argument("--patch-size", type=int, required=True)
    parser.add_argument("--overlap", type=int, required=True)
    parser.add_argument("--skip-nodata", action="store_true")
    parser.add_argument(
        "--imagery",
        type=lambda text: Imagery.from_dict(json.loads(text)),
        default=None,
        help="JSON: the scene's bands and scale, and its config key",
    )
    args = parser.parse_args()
    if args.job:
        written = []
        for scene in PredictionBatch.read(args.job).scenes:
            if scene.mosaic:  # a seam: its scenes' rasters as one
                write_mosaic(scene.raster, scene.mosaic)
                written.append(scene.raster)
            write_scene_manifest(scene.raster, scene.manifest, scene.imagery, args, scene.core)
            written.append(scene.manifest)
        if args.record:
            write_json({"job": args.job, "outputs": written}, args.record)  # last: the batch's manifests are done
    else:
        if not args.out:
            parser.error("--raster needs --out")
        write_scene_manifest(args.raster, args.out, args.imagery, args)


if __name__ == "__main__":
    run_entry(main)
