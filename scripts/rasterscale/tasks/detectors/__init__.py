"""What the tasks that find objects share (detection's boxes, instances' crowns): their models are torchvision
detectors on a ResNet-FPN backbone (RetinaNet, Mask R-CNN), with DeepForest's model folders beside their files, and
their outputs are vector layers of objects. The package is laid out as a task folder is (tasks/README.md), each
module the shared half of its role:

- ``spec``: the torch-free spec of a task that finds objects (its layers, keys, summary, counts);
- ``task`` and ``rankoutput``: the torch half (training step, starts, saving, inference's fast path) and a rank's
  objects of a scene as one GeoParquet file;
- ``model`` (torch) and ``modelfiles`` (torch-free): the ResNet-FPN backbone, and what the detectors' model files
  share (their configuration and header, DeepForest's model folders);
- ``merge``, ``metrics``, ``project``, ``quicklook`` (torch-free): the cross-tile merge, the scores against ground
  truth, the project's layer and the picture of a scene, whatever an object's shape.

Nothing here names a task; the dense tasks' shared halves are :mod:`rasterscale.tasks.dense`,
:mod:`rasterscale.tasks.blending`, :mod:`rasterscale.tasks.encoders` and :mod:`rasterscale.tasks.smpnet`.
"""
