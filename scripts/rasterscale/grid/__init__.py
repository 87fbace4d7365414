"""The tile grid: a dependency-free tile, tile manifests with their imagery spec and grid, and how tiles are split
over shards and ranks. No torch."""
