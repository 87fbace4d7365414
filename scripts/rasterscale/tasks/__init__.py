"""Tasks: what rasterscale predicts over a raster. The core (tiling, sharding, launching, rank files, pre-flight
checks) knows nothing of them. Each task is a folder: ``spec`` (torch-free, :class:`~rasterscale.tasks.spec.TaskSpec`:
its outputs, model files, config keys, labels, annotation checks, merge and evaluation) and ``task`` (the torch
half, :class:`~rasterscale.tasks.api.Task`: model, training samples, rank outputs), listed in
:mod:`rasterscale.tasks.registry`. Every task folder names its modules by role with one vocabulary (``groundtruth``,
``metrics``, ``rankoutput``, ``merge``, ``model``, ``modelfiles``, ...): ``tasks/README.md`` lists them, with what
"project" means.

- ``detection``: boxes (torchvision RetinaNet, DeepForest's model) -> a vector layer per scene.
- ``instances``: crowns as polygons (torchvision Mask R-CNN, DeepForest's polygon model) -> a polygon layer per
  scene. It and detection share the package :mod:`rasterscale.tasks.detectors`.
- ``segmentation``: a class per pixel (a segmentation-models-pytorch U-Net) -> a COG of classes per scene, its
  probabilities and its polygons.
- ``regression``: a value per pixel (a segmentation-models-pytorch U-Net) -> a float32 COG per scene. It and
  segmentation share :mod:`rasterscale.tasks.dense`, :mod:`rasterscale.tasks.blending`,
  :mod:`rasterscale.tasks.merging` (their merge, torch-free), :mod:`rasterscale.tasks.encoders` and
  :mod:`rasterscale.tasks.smpnet`.
"""
