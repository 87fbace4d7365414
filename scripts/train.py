"""Entry: DDP training of the task, as its job file says. Run locally, this process forks the job's other ranks
once it has imported what they run (rasterscale.runtime.launch); under srun every rank runs it."""

import argparse

from rasterscale.jobs.files import TrainJob
from rasterscale.runtime.launch import start_local_ranks
from rasterscale.runtime.ranks import rank_layout
from rasterscale.train.engine import run_training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="the training job file (rasterscale.jobs.files.TrainJob)")
    parser.add_argument("--model", required=True, help="the trained model file (results/models/{name}.pt)")
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--plot", required=True)
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args()
    job = TrainJob.read(args.job)
    ranks = start_local_ranks(job.settings, "train")

    run_training(
        scenes=list(job.scenes),
        settings=job.settings,
        layout=rank_layout(job.settings, "train"),
        model_path=args.model,
        metrics_path=args.metrics,
        plot_path=args.plot,
        log_dir=args.log_dir,
    )
    ranks.finish()


if __name__ == "__main__":
    main()
