"""Which segmentation-models-pytorch architectures and encoders the dense tasks build and train (docs/models.md):
each pair built as rasterscale builds it (:func:`rasterscale.tasks.smpnet.build_network`, 4 input bands, 2
outputs, nothing downloaded), then AdamW steps on a batch of 2 tiles of 256 px (forward, cross-entropy, backward),
one CPU thread; the second step is timed.

    .venv/bin/python bench/dense_networks.py [--encoders resnet18 ...] [--architectures unet ...]
"""

from __future__ import annotations

import argparse
import time

import torch

from rasterscale.tasks.encoders import ARCHITECTURES, UNET_DECODER, default_decoder
from rasterscale.tasks.smpnet import build_network

ENCODERS = ("resnet18", "resnet50", "tu-resnet50", "efficientnet-b0", "mit_b0", "tu-convnext_atto")
SIZE, BATCH, BANDS = 256, 2, 4


def measure(architecture: str, encoder: str) -> str:
    """A markdown table row: parameters (M) and the seconds of a training step, or why it failed."""
    try:
        net = build_network(architecture, encoder, BANDS, 2, default_decoder(architecture))
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        images = torch.rand(BATCH, BANDS, SIZE, SIZE)
        masks = torch.randint(0, 2, (BATCH, SIZE, SIZE))
        seconds = 0.0
        for _ in range(2):
            start = time.perf_counter()
            logits = net(images)
            loss = torch.nn.functional.cross_entropy(logits, masks)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seconds = time.perf_counter() - start
        assert logits.shape == (BATCH, 2, SIZE, SIZE) and torch.isfinite(loss)
        params = sum(p.numel() for p in net.parameters()) / 1e6
        return f"| {architecture} | {encoder} | yes | yes | {params:.1f} M | {seconds:.2f} s |"
    except Exception as err:  # the table says what failed
        return f"| {architecture} | {encoder} | {type(err).__name__}: {str(err).splitlines()[0][:80]} | | | |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoders", nargs="+", default=list(ENCODERS))
    parser.add_argument("--architectures", nargs="+", default=list(ARCHITECTURES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, 1 thread, batch {BATCH} x {BANDS} bands x {SIZE} px; U-Net decoder {UNET_DECODER}"
    )
    print("| architecture | encoder | builds | trains a step | parameters | step |")
    print("|---|---|---|---|---|---|")
    for architecture in args.architectures:
        for encoder in args.encoders:
            print(measure(architecture, encoder), flush=True)


if __name__ == "__main__":
    main()
