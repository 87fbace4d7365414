"""Entry: write a scene's tile manifest (GeoParquet) from the raster's metadata."""

import argparse

from rasterscale.inputs import check_raster
from rasterscale.outputs import write_geoparquet
from rasterscale.tiling import build_manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--raster", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--patch-size", type=int, required=True)
    parser.add_argument("--overlap", type=int, required=True)
    parser.add_argument("--skip-nodata", action="store_true")
    args = parser.parse_args()
    info = check_raster(args.raster)
    manifest = build_manifest(args.raster, args.patch_size, args.overlap, args.skip_nodata)
    write_geoparquet(manifest, args.out)
    print(f"{args.raster}: {info.width}x{info.height} px -> {len(manifest)} tiles -> {args.out}")


if __name__ == "__main__":
    main()
