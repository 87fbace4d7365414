"""Detection: boxes with torchvision's RetinaNet (DeepForest's model), one vector layer per scene."""
