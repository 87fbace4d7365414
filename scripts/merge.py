"""Entry: merge a scene's rank files into one layer, checking every tile was processed exactly once, and gather
the ranks' prediction profiles into one file and one table."""

import argparse
import json

from rasterscale.merge import merge_scene
from rasterscale.profiling import format_profile_table, write_scene_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--raster", required=True)
    parser.add_argument("--gpkg", required=True)
    parser.add_argument("--parquet", required=True)
    parser.add_argument("--profile", required=True, help="predict_profile.json to write")
    parser.add_argument("--config", type=json.loads, required=True, help="JSON of the merge section")
    parser.add_argument("rank_files", nargs="+")
    args = parser.parse_args()
    merged = merge_scene(args.rank_files, args.manifest, args.raster, args.gpkg, args.parquet, args.config)
    print(f"merged {len(args.rank_files)} rank files -> {len(merged)} detections -> {args.gpkg}, {args.parquet}")
    profile = write_scene_profile(args.rank_files, args.profile)
    print(format_profile_table(profile, title=f"predict profile ({args.profile})"))


if __name__ == "__main__":
    main()
