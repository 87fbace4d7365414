"""Entry: convert a striped (untiled) raster to the tiled COG the workflow reads it from."""

import argparse

from rasterscale.errors import run_entry
from rasterscale.raster.cog import convert_to_cog
from rasterscale.raster.headers import check_raster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--src", required=True)
    parser.add_argument("--dst", required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    convert_to_cog(args.src, args.dst, threads=args.threads)
    info = check_raster(args.dst)
    print(f"{args.src} -> {args.dst}: {info.width}x{info.height} px, blocks {info.block_shapes[0]}")


if __name__ == "__main__":
    run_entry(main)
