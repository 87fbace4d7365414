"""Entry: DDP training of the detector (Lightning re-runs this command once per extra local rank)."""

import argparse
import json

from rasterscale.modelfiles import detector_of_config
from rasterscale.runtime import run_spec
from rasterscale.train import TrainScene, run_training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenes", type=json.loads, required=True, help="JSON list of training scenes")
    parser.add_argument("--config", type=json.loads, required=True, help="JSON of the validated config")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--deepforest-folder", required=True, help="the model also as a DeepForest model folder")
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--plot", required=True)
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args()
    run_training(
        scenes=[TrainScene(**scene) for scene in args.scenes],
        detector=detector_of_config(args.config)[0],
        train_cfg=args.config["train"],
        spec=run_spec(args.config, "train"),
        checkpoint_path=args.checkpoint,
        metrics_path=args.metrics,
        plot_path=args.plot,
        log_dir=args.log_dir,
        deepforest_folder=args.deepforest_folder,
        backbone_weights=args.config["model"]["backbone_weights"],
    )


if __name__ == "__main__":
    main()
