"""A rasterscale dense model file (segmentation, regression, points) exported as TorchScript, a torch.export program or
ONNX, with its model card beside it (``<file>.yaml``): what ``model.file`` takes back, and what other tools run.

The exported network is the whole model: it normalizes its input itself (the card gives no ``normalize``) and
takes tiles of the model's ``patch_size`` (its ``tile_size``), any batch size.

    python scripts/export_model.py results/models/crowns_segmenter.pt results/byom/crowns_segmenter.onnx
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml

from rasterscale.atomic import atomic_path
from rasterscale.errors import InputError
from rasterscale.settings import job_settings
from rasterscale.tasks.exported.card import FORMS, card_path, form_of
from rasterscale.tasks.modelfiles import NotATorchFile, torch_payload
from rasterscale.tasks.registry import task_spec

MAX_BATCH = 1024  # the exported batch dimension's upper bound (torch.export needs one)


def model_task(path: str | Path) -> str:
    """The task a rasterscale model file records; one line naming the file otherwise."""
    try:
        payload = torch_payload(Path(path))
    except NotATorchFile:
        raise InputError(f"{path}: not a rasterscale model file (a .pt file that training writes)") from None
    task = payload.get("task") if isinstance(payload, Mapping) else None
    if not task:
        raise InputError(f"{path}: not a rasterscale model file (it records no task)")
    return str(task)


def card_of(task: str, cfg: Any, output: str) -> dict[str, Any]:
    """The card of an exported rasterscale model: its labels, bands and tile size; it normalizes itself."""
    return {
        "task": task,
        "labels": list(cfg.labels),
        "bands": list(cfg.input.names),
        "input": "raw" if cfg.input.raw else "scaled",
        "tile_size": int(cfg.patch_size),
        "output": output,
    }


def write_form(model: torch.nn.Module, example: torch.Tensor, path: Path, form: str) -> None:
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit's deprecation notices
        if form == "torchscript":
            torch.jit.save(torch.jit.trace(model, example), str(path))
        elif form == "torch.export":
            program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
            torch.export.save(program, str(path))
        else:
            torch.onnx.export(
                model,
                (example,),
                str(path),
                input_names=["image"],
                output_names=["output"],
                dynamo=True,
                external_data=False,
                dynamic_shapes=({0: batch},),
                verbose=False,
            )


def export_model(model_file: str | Path, out: str | Path, form: str | None = None) -> Path:
    """Export ``model_file`` to ``out`` (its form from ``form``, else the name: .onnx, .pt2, else TorchScript) and
    write its card beside it, both atomically. The card's path."""
    out = Path(out)
    form = form or form_of(out)
    if form not in FORMS:
        raise InputError(f"{out}: unknown form {form!r} (one of {', '.join(FORMS)})")
    task = model_task(model_file)
    spec = task_spec(task)
    if not spec.exported_outputs:
        raise InputError(
            f"{model_file}: {task} models are not exported (only the tasks whose networks give a map per pixel)"
        )
    model, cfg = spec.load().load_model(model_file, job_settings({"task": task, "model": {}}))  # no model key set
    model.eval()
    example = torch.rand(2, cfg.input.count, cfg.patch_size, cfg.patch_size)
    with atomic_path(out) as tmp:  # a sibling of the same suffix: torch.export.save wants .pt2
        write_form(model, example, tmp, form)
    card = card_path(out)
    with atomic_path(card) as tmp:
        tmp.write_text(yaml.safe_dump(card_of(task, cfg, spec.exported_outputs[0]), sort_keys=False))
    return card


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a rasterscale model file (segmentation, regression or points .pt)")
    parser.add_argument("out", help="the exported file: .onnx, .pt2 (torch.export), else TorchScript")
    parser.add_argument("--form", choices=FORMS, help="the form, when the name does not say it")
    args = parser.parse_args()
    card = export_model(args.model, args.out, args.form)
    print(f"export: {args.model} -> {args.out} ({args.form or form_of(args.out)}), card {card}")
