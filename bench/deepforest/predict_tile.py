"""DeepForest env: predict a raster with DeepForest as its users do, and time it.

``main.deepforest`` with the model folder as ``model.name`` (its defaults otherwise: batch 1, fp32, workers 0,
score_thresh 0.1, nms_thresh 0.05), then ``predict_tile(path, patch_size, patch_overlap)`` with its default
dataloader strategy. Writes the boxes in raster pixels (CSV, DeepForest's own columns) and the timings.
"""

import argparse
import json
import time

STARTED = time.perf_counter()

import torch  # noqa: E402
from offline import patch_torchvision  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="DeepForest model folder (config.json + model.safetensors)")
    parser.add_argument("--raster", required=True)
    parser.add_argument("--out", required=True, help="CSV of the predicted boxes (pixel coordinates)")
    parser.add_argument("--timings", required=True, help="JSON of the timings")
    parser.add_argument("--patch-size", type=int, default=400)
    parser.add_argument("--patch-overlap", type=float, default=0.05)
    parser.add_argument("--strategy", default=None, help="predict_tile's dataloader_strategy (default: its own)")
    parser.add_argument("--batch-size", type=int, default=None, help="config batch_size (default: its own, 1)")
    args = parser.parse_args()
    patch_torchvision()
    from deepforest import main as deepforest_main

    imported = time.perf_counter()
    config_args = {"model": {"name": args.model}}
    if args.batch_size:
        config_args["batch_size"] = args.batch_size
    model = deepforest_main.deepforest(config_args=config_args)
    loaded = time.perf_counter()
    options = {"dataloader_strategy": args.strategy} if args.strategy else {}
    boxes = model.predict_tile(
        path=args.raster, patch_size=args.patch_size, patch_overlap=args.patch_overlap, **options
    )
    predicted = time.perf_counter()
    frame = boxes.drop(columns="geometry") if boxes is not None else None
    if frame is None:
        raise SystemExit(f"DeepForest found no boxes in {args.raster}")
    frame[["xmin", "ymin", "xmax", "ymax", "score", "label"]].to_csv(args.out, index=False)
    timings = {
        "import_s": round(imported - STARTED, 2),
        "load_s": round(loaded - imported, 2),
        "predict_tile_s": round(predicted - loaded, 2),
        "boxes": len(frame),
        "threads": torch.get_num_threads(),
        "score_thresh": float(model.model.score_thresh),
        "nms_thresh": float(model.model.nms_thresh),
        "batch_size": int(model.config.batch_size),
        "deepforest": __import__("deepforest").__version__,
    }
    with open(args.timings, "w") as handle:
        json.dump(timings, handle, indent=2)
    print(json.dumps(timings))


if __name__ == "__main__":
    main()
