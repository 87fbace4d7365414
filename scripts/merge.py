"""Entry: merge each scene of a batch (its job file lists them) from its rank files into its layers, after checking
from the rank records that every tile was processed exactly once, and gather the ranks' prediction profiles into
one file and one table."""

import argparse
import dataclasses

from rasterscale.atomic import write_json
from rasterscale.errors import run_entry
from rasterscale.grid.manifest import read_manifest
from rasterscale.jobs.files import MergeJob
from rasterscale.jobs.profile import format_profile_table, write_scene_profile
from rasterscale.jobs.rankfiles import check_scene_records
from rasterscale.settings import CogSettings
from rasterscale.tasks.registry import task_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="the batch's merge job file (rasterscale.jobs.files.MergeJob)")
    parser.add_argument("--record", required=True, help="the batch's merge record to write (JSON: files written)")
    parser.add_argument("--threads", type=int, default=1, help="cores the layers' COGs are written on")
    args = parser.parse_args()
    job = MergeJob.read(args.job)
    settings = dataclasses.replace(job.settings, cog=CogSettings(threads=args.threads))  # the rule's threads
    spec = task_spec(job.settings.task)  # not the task itself: no torch in a merge job
    written: list[str] = []
    for scene in job.scenes:
        stems = list(scene.rank_files)
        check_scene_records(stems, read_manifest(scene.manifest)["tile_id"].to_numpy())
        outputs = [stem + spec.rank_suffix for stem in stems]
        merged = spec.merge(scene, outputs, settings, job.labels)
        print(f"{scene.name}: merged {len(stems)} rank files: {merged}")
        profile = write_scene_profile(stems, scene.outputs["profile"])
        print(format_profile_table(profile, title=f"predict profile ({scene.outputs['profile']})"))
        written += list(scene.outputs.values())
    write_json({"job": args.job, "outputs": written}, args.record)  # last: the batch's merge is done


if __name__ == "__main__":
    run_entry(main)
