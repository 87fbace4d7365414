"""Entry: write a scene's tile manifest (GeoParquet) from the raster's metadata, or each scene's of a batch (its
job file lists their rasters and manifests): one process for many small scenes."""

import argparse
import json
from pathlib import Path

from rasterscale.inputs import check_raster
from rasterscale.outputs import write_geoparquet
from rasterscale.tiling import build_manifest


def write_scene_manifest(raster: str, out: str, args: argparse.Namespace) -> None:
    info = check_raster(raster)
    manifest = build_manifest(raster, args.patch_size, args.overlap, args.skip_nodata)
    write_geoparquet(manifest, out)
    print(f"{raster}: {info.width}x{info.height} px -> {len(manifest)} tiles -> {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    scenes = parser.add_mutually_exclusive_group(required=True)
    scenes.add_argument("--raster", help="one scene's raster (with --out)")
    scenes.add_argument("--job", help="a batch's job file (JSON: scenes with raster and manifest)")
    parser.add_argument("--out")
    parser.add_argument("--patch-size", type=int, required=True)
    parser.add_argument("--overlap", type=int, required=True)
    parser.add_argument("--skip-nodata", action="store_true")
    args = parser.parse_args()
    if args.job:
        for scene in json.loads(Path(args.job).read_text())["scenes"]:
            write_scene_manifest(scene["raster"], scene["manifest"], args)
    else:
        if not args.out:
            parser.error("--raster needs --out")
        write_scene_manifest(args.raster, args.out, args)


if __name__ == "__main__":
    main()
