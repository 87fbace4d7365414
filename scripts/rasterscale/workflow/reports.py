"""What the workflow prints at the end of a successful run: each evaluated scene's scores in one line, and each
predicted scene's prediction profile (a table each, or one line each for many scenes), read from the files the
evaluation and merge jobs wrote."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from rasterscale.jobs.profile import format_profile_table
from rasterscale.workflow.plan import Plan

PROFILE_TABLES_UP_TO = 4  # scenes; more get one line each (200 tables would bury the run's end)


def evaluation_summary(plan: Plan, workdir: str | Path = ".") -> list[str]:
    """The summary's lines: a title and one line per evaluated scene that has its evaluation (none: no lines)."""
    rows = []
    for name in plan.evaluated_scenes():
        path = Path(workdir) / plan.paths.evaluation_file(name)
        if path.exists():
            rows.append(f"  {name:<20} {plan.task.summarize(json.loads(path.read_text()))}")
    return [f"rasterscale evaluation ({plan.task.name}):", *rows] if rows else []


def predict_profiles(plan: Plan, workdir: str | Path = ".") -> list[str]:
    """Each predicted scene's profile (gathered by the merge) as one table; with more than PROFILE_TABLES_UP_TO
    scenes, one line per scene (the tables are in the merge logs and predict_profile.json)."""
    profiles = {}
    for name in plan.predict_scenes:
        path = Path(workdir) / plan.paths.scene_profile(name)
        if path.exists():
            profiles[name] = json.loads(path.read_text())
    if len(profiles) <= PROFILE_TABLES_UP_TO:
        return [
            format_profile_table(profile, title=f"rasterscale predict profile: {name}")
            for name, profile in profiles.items()
        ]
    tables = plan.paths.scene_profile("{scene}")
    lines = [f"rasterscale predict profiles ({len(profiles)} scenes; tables in {tables}):"]
    for name, profile in profiles.items():
        total = profile["total"]
        lines.append(
            f"  {name:<24} {total['ranks']} rank(s) {total['tiles']:>7} tiles {total['tiles_per_s']:>8.2f} tiles/s "
            f"wall {total['wall_s']:.1f} s"
        )
    return lines


def print_evaluation_summary(plan: Plan, out: Callable[[str], None] = print) -> None:
    for line in evaluation_summary(plan):
        out(line)


def print_predict_profiles(plan: Plan, out: Callable[[str], None] = print) -> None:
    for line in predict_profiles(plan):
        out(line)
