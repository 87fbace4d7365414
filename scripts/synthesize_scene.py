"""Entry: synthesize a demo orthomosaic and its ground-truth crown boxes."""

import argparse

from rasterscale.synth import synthesize_scene


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--raster", required=True)
    parser.add_argument("--boxes", required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--height", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--crs", required=True)
    parser.add_argument("--pixel-size", type=float, required=True)
    args = parser.parse_args()
    count = synthesize_scene(
        args.raster,
        args.boxes,
        width=args.width,
        height=args.height,
        seed=args.seed,
        crs=args.crs,
        pixel_size=args.pixel_size,
    )
    print(f"{args.raster}: {args.width}x{args.height} px, {count} crowns -> {args.boxes}")


if __name__ == "__main__":
    main()
