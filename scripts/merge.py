"""Entry: merge each scene of a batch (its job file lists them) from its rank files into one layer, checking every
tile was processed exactly once, and gather the ranks' prediction profiles into one file and one table."""

import argparse
import json
from pathlib import Path

from rasterscale.merge import merge_scene
from rasterscale.profiling import format_profile_table, write_scene_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="the batch's job file (JSON: scenes with their rank files)")
    parser.add_argument("--config", type=json.loads, required=True, help="JSON of the merge section")
    args = parser.parse_args()
    for scene in json.loads(Path(args.job).read_text())["scenes"]:
        ranks = scene["rank_files"]
        merged = merge_scene(ranks, scene["manifest"], scene["raster"], scene["gpkg"], scene["parquet"], args.config)
        print(f"{scene['name']}: merged {len(ranks)} rank files -> {len(merged)} detections -> {scene['gpkg']}")
        profile = write_scene_profile(ranks, scene["profile"])
        print(format_profile_table(profile, title=f"predict profile ({scene['profile']})"))


if __name__ == "__main__":
    main()
