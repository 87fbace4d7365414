"""Entry: synthesize a demo orthomosaic and its ground-truth crown boxes (and, with --crowns, crown polygons; with
--canopy-height, the true canopy height raster; with --tops, the true tree tops), as its job file says (size, seed,
near-infrared band, CRS and pixel size)."""

import argparse

from rasterscale.jobs.files import SynthesisJob
from rasterscale.tools.synth import synthesize_scene


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="the scene's synthesis job file (rasterscale.jobs.files)")
    parser.add_argument("--raster", required=True)
    parser.add_argument("--boxes", required=True)
    parser.add_argument("--crowns", help="also write the crowns' visible outlines (polygons) to this GeoPackage")
    parser.add_argument("--canopy-height", help="also write the true canopy height (float32 GeoTIFF, m) here")
    parser.add_argument("--tops", help="also write the true tree tops (points, GeoPackage) here")
    args = parser.parse_args()
    job = SynthesisJob.read(args.job)
    demo = job.settings.demo
    scene = demo.scenes[job.name]
    count = synthesize_scene(
        args.raster,
        args.boxes,
        width=scene.width,
        height=scene.height,
        seed=scene.seed,
        crs=demo.crs,
        pixel_size=demo.pixel_size,
        crowns_path=args.crowns,
        nir=scene.nir,
        height_path=args.canopy_height,
        tops_path=args.tops,
    )
    bands = "RGB + NIR" if scene.nir else "RGB"
    extras = "".join(
        f", {what} -> {path}"
        for what, path in (("outlines", args.crowns), ("canopy height", args.canopy_height), ("tops", args.tops))
        if path
    )
    print(f"{args.raster}: {scene.width}x{scene.height} px {bands}, {count} crowns -> {args.boxes}{extras}")


if __name__ == "__main__":
    main()
