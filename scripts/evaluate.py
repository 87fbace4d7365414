"""Entry: score a scene's merged detections against its annotations; write evaluation.json and a quicklook."""

import argparse
import json

from rasterscale.evaluate import evaluate_scene


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--detections", required=True)
    parser.add_argument("--raster", required=True)
    parser.add_argument("--annotations", required=True)
    parser.add_argument("--label-column", default=None)
    parser.add_argument("--image-path", default=None, help="the scene's image name in CSV/VOC annotations")
    parser.add_argument("--config", type=json.loads, required=True, help="JSON of the validated config")
    parser.add_argument("--labels", type=json.loads, required=True, help="JSON list of the resolved class names")
    parser.add_argument("--out", required=True)
    parser.add_argument("--quicklook", required=True)
    args = parser.parse_args()
    metrics = evaluate_scene(
        args.detections,
        args.raster,
        args.annotations,
        args.labels,
        args.label_column or None,
        args.config["evaluate"],
        args.out,
        args.quicklook,
        args.image_path,
    )
    print(
        f"{args.raster}: precision={metrics['precision']:.3f} recall={metrics['recall']:.3f} "
        f"f1={metrics['f1']:.3f} map50={metrics['map50']:.3f} "
        f"({metrics['true_positives']}/{metrics['predictions']} predictions, {metrics['ground_truth']} true)"
    )


if __name__ == "__main__":
    main()
