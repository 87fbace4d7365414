"""Entry: DDP prediction over random tiles, no raster needed (checks ranks, devices, throughput), as its job file
says. Run locally, this process forks the job's other ranks once it has imported what they run
(rasterscale.runtime.launch)."""

import argparse

from rasterscale.jobs.files import CheckJob
from rasterscale.runtime.launch import start_local_ranks
from rasterscale.runtime.ranks import rank_layout
from rasterscale.tools.envcheck import run_environment_check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="the check's job file (rasterscale.jobs.files.CheckJob)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args()
    job = CheckJob.read(args.job)
    ranks = start_local_ranks(job.settings, "predict")

    run_environment_check(job.settings, rank_layout(job.settings, "predict"), args.out_dir, args.log_dir)
    ranks.finish()


if __name__ == "__main__":
    main()
