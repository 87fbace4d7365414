"""Entry: DDP prediction of one shard of a batch of scenes, as its job file says. Run locally, this process forks
the job's other ranks once it has imported what they run (rasterscale.runtime.launch); under srun every rank runs it."""

import argparse

from rasterscale.jobs.files import PredictJob
from rasterscale.predict.engine import run_prediction
from rasterscale.runtime.launch import start_local_ranks
from rasterscale.runtime.ranks import rank_layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="the batch's prediction job file (rasterscale.jobs.files)")
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--out-dir", required=True, help="the shard's folder of rank files")
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--resume-dir", help="where ranks save finished tiles, and a rerun resumes from")
    args = parser.parse_args()
    job = PredictJob.read(args.job)
    ranks = start_local_ranks(job.settings, "predict")

    run_prediction(
        scenes=list(job.scenes),
        model_file=job.model_file,
        settings=job.settings,
        layout=rank_layout(job.settings, "predict"),
        out_dir=args.out_dir,
        log_dir=args.log_dir,
        shards=job.shards,
        shard=args.shard,
        resume_dir=args.resume_dir,
    )
    ranks.finish()


if __name__ == "__main__":
    main()
