"""Entry: export a rasterscale segmentation or regression model file as ONNX, a torch.export program (.pt2) or
TorchScript, with its model card (rasterscale.tools.export)."""

from rasterscale.errors import run_entry
from rasterscale.tools.export import main

if __name__ == "__main__":
    run_entry(main)
