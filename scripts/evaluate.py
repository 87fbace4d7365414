"""Entry: score a scene's merged output against its annotations; write evaluation.json and a quicklook."""

import argparse
import json

from rasterscale.errors import run_entry
from rasterscale.tasks.registry import task_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scene", type=json.loads, required=True, help="JSON: the scene's raster, outputs, truth")
    parser.add_argument("--config", type=json.loads, required=True, help="JSON: task and evaluate")
    parser.add_argument("--labels", type=json.loads, required=True, help="JSON list of the resolved class names")
    parser.add_argument("--out", required=True)
    parser.add_argument("--quicklook", required=True)
    args = parser.parse_args()
    spec = task_spec(args.config["task"])
    metrics = spec.evaluate(args.scene, args.config, args.labels, args.out, args.quicklook)
    print(f"{args.scene['raster']}: {spec.summarize(metrics)}")


if __name__ == "__main__":
    run_entry(main)
