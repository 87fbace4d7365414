"""The files that pass between the workflow and its jobs, and between jobs: the job files the plan writes (each
job's members and frozen settings, :mod:`rasterscale.jobs.files`), where every file lives
(:mod:`rasterscale.jobs.paths`), the ranks' files and records (:mod:`rasterscale.jobs.rankfiles`), the parts a rank
saves to resume from (:mod:`rasterscale.jobs.resume`) and the prediction profile records
(:mod:`rasterscale.jobs.profile`). The workflow (which writes job files) and the engines (which read them) both
stand on this layer; it imports neither, nor torch."""
