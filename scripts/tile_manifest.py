"""Entry: write a scene's tile manifest (GeoParquet) and its imagery spec (bands, mask, scale to uint8)."""

import argparse
import json

from rasterscale.imagery import resolve_spec
from rasterscale.inputs import check_raster
from rasterscale.tiling import build_manifest, write_manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--raster", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--patch-size", type=int, required=True)
    parser.add_argument("--overlap", type=int, required=True)
    parser.add_argument("--skip-nodata", action="store_true")
    parser.add_argument(
        "--imagery", type=json.loads, default={}, help="JSON: the scene's bands and scale, and its config key"
    )
    args = parser.parse_args()
    info = check_raster(args.raster)
    imagery = args.imagery
    spec = resolve_spec(args.raster, imagery.get("bands"), imagery.get("scale"), imagery.get("key", "scene"))
    print(f"{args.raster}: imagery {spec.describe()}")
    manifest = build_manifest(args.raster, args.patch_size, args.overlap, args.skip_nodata, spec)
    write_manifest(manifest, spec, args.out)
    print(f"{args.raster}: {info.width}x{info.height} px -> {len(manifest)} tiles -> {args.out}")


if __name__ == "__main__":
    main()
