"""Entry: DDP training of the config's task. Run locally, this process starts the job's other ranks first
(rasterscale.runtime.launch); under srun every rank runs it."""

import argparse
import json

from rasterscale.jobs.files import TrainingScenes
from rasterscale.runtime.launch import start_local_ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenes", type=TrainingScenes.from_json, required=True, help="JSON list of training scenes")
    parser.add_argument("--config", type=json.loads, required=True, help="JSON of the validated config")
    parser.add_argument("--model", required=True, help="the trained model file (results/models/{name}.pt)")
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--plot", required=True)
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args()
    ranks = start_local_ranks(args.config, "train")
    # imported once the other ranks are started, so that every rank imports torch at the same time
    from rasterscale.runtime.ranks import run_spec
    from rasterscale.train.engine import run_training

    run_training(
        scenes=list(args.scenes.scenes),
        config=args.config,
        spec=run_spec(args.config, "train"),
        model_path=args.model,
        metrics_path=args.metrics,
        plot_path=args.plot,
        log_dir=args.log_dir,
    )
    ranks.finish()


if __name__ == "__main__":
    main()
