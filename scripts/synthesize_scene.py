"""Entry: synthesize a demo orthomosaic and its ground-truth crown boxes (and, with --crowns, crown polygons; with
--nir, a near-infrared 4th band; with --canopy-height, the true canopy height raster; with --tops, the true tree
tops)."""

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
    parser.add_argument("--nir", action="store_true", help="give the raster a 4th band: near infrared")
    # --height is the raster's height in pixels, hence --canopy-height for the height raster's path.
    parser.add_argument("--canopy-height", help="also write the true canopy height (float32 GeoTIFF, m) here")
    parser.add_argument("--tops", help="also write the true tree tops (points, GeoPackage) here")
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
        nir=args.nir,
        height_path=args.canopy_height,
        tops_path=args.tops,
    )
    bands = "RGB + NIR" if args.nir else "RGB"
    extras = "".join(
        f", {what} -> {path}"
        for what, path in (("outlines", args.crowns), ("canopy height", args.canopy_height), ("tops", args.tops))
        if path
    )
    print(f"{args.raster}: {args.width}x{args.height} px {bands}, {count} crowns -> {args.boxes}{extras}")


if __name__ == "__main__":
    main()
