"""Rasters: headers, the imagery spec that makes pixels the model's tiles, windows over rasterio's, pixel/CRS
geometry and tiled COGs. No torch."""

import os

# No code from a file the user hands over (docs/security.md): GDAL never runs a VRT's Python pixel function in a
# process that reads rasters, whatever the environment says (its default already refuses inline code).
os.environ["GDAL_VRT_ENABLE_PYTHON"] = "NO"
