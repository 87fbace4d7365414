"""Entry: merge a scene's rank files into one layer, checking every tile was processed exactly once."""

import argparse
import json

from rasterscale.merge import merge_scene


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--raster", required=True)
    parser.add_argument("--gpkg", required=True)
    parser.add_argument("--parquet", required=True)
    parser.add_argument("--config", type=json.loads, required=True, help="JSON of the merge section")
    parser.add_argument("rank_files", nargs="+")
    args = parser.parse_args()
    merged = merge_scene(args.rank_files, args.manifest, args.raster, args.gpkg, args.parquet, args.config)
    print(f"merged {len(args.rank_files)} rank files -> {len(merged)} detections -> {args.gpkg}, {args.parquet}")


if __name__ == "__main__":
    main()
