"""rasterscale: deep learning over large geospatial rasters, from a laptop to a SLURM GPU cluster.

All workflow logic lives in this package; the entry scripts in ``scripts/`` and the rules in ``rules/`` are thin.

Importing it lets OpenMP threads wait asleep (:func:`rasterscale.runtime.cores.wait_passively`): every entry script
imports it before torch, whose OpenMP reads the policy once, when it loads.
"""

from rasterscale.runtime.cores import wait_passively

wait_passively()
