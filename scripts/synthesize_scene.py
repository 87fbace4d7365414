"""Entry: synthesize a demo orthomosaic and its ground-truth crown boxes (and, with --crowns, crown polygons)."""

import argparse

from rasterscale.tools.synth import synthesize_scene


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--raster", required=True)
    parser.add_argument("--boxes", required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--height", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--crs", required=True)
    parser.add_argument("--pixel-size", type=float, required=True)
    parser.add_argument("--crowns", help="also write the crowns' visible outlines (polygons) to this GeoPackage")
    args = parser.parse_args()
    count = synthesize_scene(
        args.raster,
        args.boxes,
        width=args.width,
        height=args.height,
        seed=args.seed,
        crs=args.crs,
        pixel_size=args.pixel_size,
        crowns_path=args.crowns,
    )
    crowns = f", outlines -> {args.crowns}" if args.crowns else ""
    print(f"{args.raster}: {args.width}x{args.height} px, {count} crowns -> {args.boxes}{crowns}")


if __name__ == "__main__":
    main()
