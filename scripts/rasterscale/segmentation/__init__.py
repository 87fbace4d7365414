"""Semantic segmentation: model, ground truth, blending, merge and metrics."""
