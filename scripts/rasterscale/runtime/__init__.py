"""Running ranks: launch geometry and its pre-flight checks, starting a node's ranks together, their lifetime,
numeric precision per device, and the Lightning trainer and per-rank logs both engines share."""
