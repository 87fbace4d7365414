"""rasterscale: deep learning over large geospatial rasters, from a laptop to a SLURM GPU cluster.

All workflow logic lives in this package; the entry scripts in ``scripts/`` and the rules in ``rules/`` are thin.
"""
