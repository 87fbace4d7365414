"""DeepForest env: write the DeepForest-format model the side-by-side bench fine-tunes from.

A ResNet-50 RetinaNet built by DeepForest's own ``RetinaNetHub`` with no download (torchvision's
``retinanet_resnet50_fpn`` patched to ``weights_backbone=None``, as any hub-free use must), saved with
``save_pretrained``: config.json + model.safetensors, exactly as DeepForest writes its released models.
"""

import argparse

import torch
from offline import patch_torchvision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="model folder to write")
    parser.add_argument("--label", default="Tree")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    patch_torchvision()
    from deepforest.models import retinanet

    torch.manual_seed(args.seed)
    model = retinanet.RetinaNetHub(backbone_weights=None, num_classes=1, label_dict={args.label: 0})
    model.save_pretrained(args.out)
    print(f"DeepForest RetinaNetHub (resnet50, untrained, seed {args.seed}) -> {args.out}")


if __name__ == "__main__":
    main()
