"""Crown polygons: instance segmentation (task ``instances``)."""
