"""The cog step: a striped (untiled) input raster converted once to the tiled COG it is read from (rule ``cog``;
the plan's ``scene_raster``), on ``cog.threads`` threads, within GDAL's block cache of its memory estimate. Its
command line says all (no job file)."""

from __future__ import annotations

from typing import Any

from rasterscale.raster.cog import BLOCK_SIZE
from rasterscale.workflow import resources
from rasterscale.workflow.steps.base import RuleFunction, Step

GDAL_CACHE_MB = 512  # GDAL's block cache of the conversion (its rule sets GDAL_CACHEMAX to this)
BUFFERS_PER_THREAD = 4  # blocks a conversion thread holds: read, overview, compressed, written


class Cog(Step):
    name = "cog"
    gdal_cache_mb = GDAL_CACHE_MB

    def scenes(self) -> list[str]:
        """The scenes read from a COG of their own: those with striped rasters."""
        return sorted(self.plan.untiled)

    def source(self, wildcards: Any) -> str:
        """Input function: the raster the config names for the scene."""
        return self.plan.scene_source(wildcards.scene)

    def output(self) -> str:
        return self.plan.paths.cog_raster("{scene}")

    def threads(self) -> int:
        return self.plan.settings.cog.threads

    def mem_mb(self, name: str) -> int:
        """Through a temporary file (rio-cogeo), never in memory: GDAL's block cache (:data:`GDAL_CACHE_MB`: a
        striped source's strips are cached there, whatever its size) and each thread's blocks of 512 px."""
        size = resources.scene_size(self.plan, name)
        block = BLOCK_SIZE * BLOCK_SIZE * size.bands * size.itemsize
        return resources.job_mb(GDAL_CACHE_MB * resources.MB + self.threads() * BUFFERS_PER_THREAD * block)

    def resources(self) -> dict[str, RuleFunction]:
        return self.memory(lambda wildcards: self.mem_mb(wildcards.scene))
