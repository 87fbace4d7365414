"""Datasets over tile manifests (task-neutral, torch): windowed reads, regions, and which samples a rank takes
in which order."""
