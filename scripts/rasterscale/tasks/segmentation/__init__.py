"""Semantic segmentation: model, ground truth, blending, merge and metrics."""

NODATA_CLASS = 255  # no data in classes.tif and class rasters; "not this rank's" in a rank raster; "ignore" in a mask
PROBABILITY_SCALE = 1 / 255  # probability bands (a rank raster's, probabilities.tif's) hold round(p * 255)
