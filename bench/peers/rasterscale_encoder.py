"""rasterscale's side of ``test_encoder_weights.py``, run in rasterscale's own environment (``.venv``): the
segmentation network that training builds for a config, its encoder started as training starts it (the calls of
``rasterscale.train.engine.train``: the task's model config, the model its training module builds,
``initial_weights``), and that encoder's features on a batch. The input's statistics (``normalize: auto``, pooled
from the training scenes' manifests by training) are set to mean 0, std 1: the encoder is run on the batch as is.

    .venv/bin/python bench/peers/rasterscale_encoder.py --config CONFIG.json --batch BATCH.pt --out FEATURES.pt

Writes the features (a list of tensors, eval mode) and prints the log line of the start.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from rasterscale.config.schema import validate_config
from rasterscale.settings import settings_of
from rasterscale.tasks.registry import task_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a config (JSON) with model.encoder_weights")
    parser.add_argument("--batch", required=True, help="a (N, B, H, W) float tensor (torch.save)")
    parser.add_argument("--out", required=True, help="where the encoder's features go (torch.save)")
    args = parser.parse_args()
    settings = settings_of(validate_config(json.loads(Path(args.config).read_text())))
    task = task_spec(settings.task).load()
    model_cfg = task.model_config(settings)
    if model_cfg.input.pending:  # normalize: auto, which training fills from the scenes' manifests (none here)
        count = model_cfg.input.count
        model_cfg = replace(model_cfg, input=model_cfg.input.with_statistics([0.0] * count, [1.0] * count))
    model = task.build_model(model_cfg)
    print(task.initial_weights(model, model_cfg, settings))
    encoder = model.get_submodule("net.encoder").eval()
    with torch.inference_mode():
        features = [f.clone() for f in encoder(torch.load(args.batch))]
    torch.save(features, args.out)


if __name__ == "__main__":
    main()
