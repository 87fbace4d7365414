"""Entry: DDP prediction of one shard of a batch of scenes, listed in the batch's job file. Run locally, this
process starts the job's other ranks first (rasterscale.runtime.launch); under srun every rank runs it."""

import argparse
import json

from rasterscale.runtime.launch import start_local_ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="the batch's job file (JSON: scenes with raster, manifest, ...)")
    parser.add_argument("--model", required=True, help="the model file to predict with")
    parser.add_argument("--config", type=json.loads, required=True, help="JSON of the validated config")
    parser.add_argument("--out-dir", required=True, help="the shard's folder of rank files")
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--resume-dir", help="where ranks save finished tiles, and a rerun resumes from")
    args = parser.parse_args()
    ranks = start_local_ranks(args.config, "predict")
    # imported once the other ranks are started, so that every rank imports torch at the same time
    from rasterscale.jobs.files import read_job_file
    from rasterscale.predict.engine import run_prediction
    from rasterscale.runtime.ranks import run_spec

    run_prediction(
        scenes=read_job_file(args.job),
        model_file=args.model,
        config=args.config,
        spec=run_spec(args.config, "predict"),
        out_dir=args.out_dir,
        log_dir=args.log_dir,
        shards=args.shards,
        shard=args.shard,
        resume_dir=args.resume_dir,
    )
    ranks.finish()


if __name__ == "__main__":
    main()
