"""Regression: one value (or K values) per pixel, e.g. canopy height from imagery, blended across tile overlaps into
a float32 COG per scene, and tree tops from a height layer (:mod:`rasterscale.tasks.regression.treetops`)."""
