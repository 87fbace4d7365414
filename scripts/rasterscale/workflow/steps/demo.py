"""The demo step: a demo scene synthesized (rule ``demo``) into ``demo.directory`` as its job file, beside the demo's
data, says: its raster and its truths (boxes, crowns, canopy height, tree tops)."""

from __future__ import annotations

import dataclasses

from rasterscale.jobs import paths
from rasterscale.jobs.files import SynthesisJob
from rasterscale.workflow import resources
from rasterscale.workflow.steps.base import JobFiles, RuleFunction, Step

BYTES_PER_PIXEL = 40  # the synthesis: 32 B/px measured at 2048 px square, 21 at 4096 with NIR


class Demo(Step):
    name = SynthesisJob.KIND

    @property
    def directory(self) -> str:
        return str(self.plan.settings.demo.directory)

    def job_file(self, batch: int | str | None = None) -> str:
        """A scene's, by its name: every run that reads the scene shares it."""
        return paths.synthesis_job(self.directory, str(batch))

    def scenes(self) -> list[str]:
        """The demo scenes the config reads (a config without them writes nothing into demo.directory)."""
        read = {scene.path for scene in self.plan.scenes.values()}
        return [name for name in self.plan.settings.demo.scenes if self.plan.demo_raster(name) in read]

    def outputs(self) -> dict[str, str]:
        """A scene's raster and truths, as patterns of ``{name}``."""
        suffixes = {
            "raster": "tif",
            "boxes": "gpkg",
            "crowns": "crowns.gpkg",
            "height": "height.tif",
            "tops": "tops.gpkg",
        }
        return {key: f"{self.directory}/{{name}}.{suffix}" for key, suffix in suffixes.items()}

    def mem_mb(self, name: str) -> int:
        """The scene's whole raster, canopy height and noise fields are in memory (:data:`BYTES_PER_PIXEL`)."""
        demo = self.plan.settings.demo.scenes.get(name)
        return resources.job_mb(demo.width * demo.height * BYTES_PER_PIXEL if demo is not None else 0)

    def resources(self) -> dict[str, RuleFunction]:
        return self.memory(lambda wildcards: self.mem_mb(wildcards.name))

    def job(self, name: str) -> SynthesisJob:
        """The demo section with this scene only (another config's demo scenes change nothing)."""
        demo = self.plan.settings.demo
        return SynthesisJob(name, self.carrying(demo=dataclasses.replace(demo, scenes={name: demo.scenes[name]})))

    def job_files(self) -> JobFiles:
        for name in self.scenes():
            yield self.job_file(name), self.job(name)
