"""Prediction, whatever the task: the DDP engine, rank files, tile-level resume, the inference fast path and the
per-rank profile."""
