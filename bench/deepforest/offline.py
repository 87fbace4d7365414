"""Hub-free DeepForest: torchvision's ``retinanet_resnet50_fpn`` built without its ImageNet backbone download.

``RetinaNetHub.__init__`` (also under ``from_pretrained``) calls ``retinanet_resnet50_fpn(weights=None)``, whose
default ``weights_backbone`` downloads ResNet-50 ImageNet weights; the weights are then overwritten by the
model file anyway. Call :func:`patch_torchvision` before DeepForest builds a model.
"""

import functools

import torchvision.models.detection as detection


def patch_torchvision() -> None:
    if not isinstance(detection.retinanet_resnet50_fpn, functools.partial):
        detection.retinanet_resnet50_fpn = functools.partial(detection.retinanet_resnet50_fpn, weights_backbone=None)
