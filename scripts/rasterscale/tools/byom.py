"""``make demo-byom``: bring your own model, shown with the segmentation demo's. Its trained model
(``results/models/crowns_segmenter.pt``, from ``make demo-segmentation``) is exported to ONNX, TorchScript and a
torch.export program (:mod:`rasterscale.tools.export`), and each file predicts the held-out scene through the
workflow as a user's exported model would (``model.file`` and the card beside it), in ``results/byom/<form>/``. Each
form's mIoU must be the native model's within :data:`TOLERANCE`; a table is printed and written to
``results/byom/summary.json``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from rasterscale.atomic import write_json
from rasterscale.jobs.paths import RunPaths, trained_model
from rasterscale.tools.export import export_model

TOLERANCE = 0.005  # mIoU, against the native model's
FORMS = {"onnx": "onnx", "torchscript": "torchscript.pt", "torch.export": "pt2"}


def form_config(base: dict[str, Any], scene: str, model_file: Path) -> dict[str, Any]:
    """The demo's config predicting its held-out scene with ``model_file``, every path absolute (the form's run
    has a working folder of its own)."""
    held_out = dict(base["scenes"][scene])
    for key in ("path", "annotations"):
        if held_out.get(key):
            held_out[key] = str(Path(held_out[key]).resolve())
    return {
        **base,
        "scenes": {scene: held_out},
        "model": {"name": base["model"]["name"], "file": str(model_file.resolve())},
        "train": {**base["train"], "scenes": []},
        "predict": {**base["predict"], "scenes": [scene]},
        "demo": {"scenes": {}},
    }


def miou(workdir: Path, run: str, scene: str) -> float:
    """The scene's mIoU as the run ``run`` (model.name: every form's run keeps the demo's name) scored it."""
    return float(json.loads((workdir / RunPaths(run).evaluation_file(scene)).read_text())["miou"])


def run(config_file: Path, cores: int, forms: list[str]) -> dict[str, Any]:
    """Each form exported and run in ``results/byom/<form>/`` (its own results, batches and logs: the demo's are
    left as they are); the mIoUs beside the native model's."""
    base = yaml.safe_load(config_file.read_text())
    scene = base["predict"]["scenes"][0]
    name = base["model"]["name"]
    native_model = Path(trained_model(name))
    rows: dict[str, Any] = {"native": {"miou": miou(Path("."), name, scene), "file": str(native_model)}}
    for form in forms:
        workdir = Path("results/byom") / form.replace(".", "_")
        exported = workdir / f"{native_model.stem}.{FORMS[form]}"
        export_model(native_model, exported, form)
        config = workdir / "config.yaml"
        config.write_text(yaml.safe_dump(form_config(base, scene, exported), sort_keys=False))
        command = ["--cores", str(cores), "--directory", str(workdir), "--configfile", str(config.resolve())]
        subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", "Snakefile", *command], check=True)
        rows[form] = {"miou": miou(workdir, name, scene), "file": str(exported)}
    for row in rows.values():
        row["difference"] = round(row["miou"] - rows["native"]["miou"], 4)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("config/segmentation.yaml"))
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS))
    args = parser.parse_args()
    rows = run(args.config, args.cores, args.forms)
    write_json(rows, "results/byom/summary.json")
    print(f"{'model':<14}{'mIoU':>8}{'difference':>12}")
    for form, row in rows.items():
        print(f"{form:<14}{row['miou']:>8.4f}{row['difference']:>+12.4f}")
    worst = max(abs(row["difference"]) for row in rows.values())
    if worst > TOLERANCE:
        sys.exit(f"demo-byom: an exported form's mIoU differs from the native model's by {worst:.4f} (> {TOLERANCE})")
