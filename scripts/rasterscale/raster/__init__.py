"""Rasters: headers, the imagery spec that makes pixels the model's tiles, windows over rasterio's, pixel/CRS
geometry and tiled COGs. No torch."""
