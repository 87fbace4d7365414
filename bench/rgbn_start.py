"""make bench-rgbn: does fine-tuning a DeepForest tree model on RGBN start from a better point than training from
scratch? Through the real workflow: an RGB detector as a DeepForest model folder (--start, else the demo's
results/models/crowns/, else trained here with config/config.yaml's settings); two synthetic RGBN scenes with other
seeds than the demo's (2048² px, seeds 21 and 22, nir: true, their crown boxes as annotations); two RGBN detectors
trained on the first with the demo's backbone, feature pyramid, tiling, batch, lr and seed for the same --steps, one
from the RGB folder (train.init: its first convolution adapted from 3 to 4 bands) and one from scratch; the held-out
scene predicted (2 ranks) and scored with each, with the adapted start before any step (train.max_steps 0 is
refused: that model is built here as the training job builds it and predicted through model.file), and, for
reference, with the RGB folder itself on the scene's red, green and blue bands. Both RGBN detectors take the
folder's backbone and feature pyramid (the demo's, resnet18 and 128 channels, for the demo's folder).
Writes results/bench-rgbn.json. Not a test: the figures are reported, not asserted.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from rasterscale.atomic import write_json  # noqa: E402
from rasterscale.jobs.paths import RunPaths  # noqa: E402
from rasterscale.runtime.precision import cpu_info  # noqa: E402
from rasterscale.tasks.detection.model import (  # noqa: E402
    build_detector,
    init_from_model_file,
    load_detector,
    save_detector,
)
from rasterscale.tasks.detection.modelfiles import read_header  # noqa: E402

DEMO_CONFIG = REPO / "config/config.yaml"
DEMO_FOLDER = REPO / "results/models/crowns"
SIDE = 2048  # px of each synthetic RGBN scene (0.1 m)
SEEDS = {"rgbn_train": 21, "rgbn_heldout": 22}  # the demo's are 1 and 2
BANDS = [1, 2, 3, 4]
BAND_NAMES = ["red", "green", "blue", "nir"]
ADAPTED = "first convolution adapted from 3 to 4 bands"
PREDICT = {"scenes": ["rgbn_heldout"], "devices": 2, "batch_size": 4, "workers": 0, "accelerator": "cpu"}


def run_workflow(workdir: Path, config: dict, targets: list[str] | None = None) -> float:
    """The workflow on ``config`` in ``workdir`` (its default targets, else ``targets``); seconds it took."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir)]
    command += ["--configfile", str(workdir / "config.yaml"), "--cores", "2", *(targets or [])]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the workflow failed in {workdir}:\n{done.stderr[-4000:]}")
    return time.perf_counter() - started


def rgb_start(root: Path, start: str | None) -> tuple[Path, str, float | None]:
    """The RGB detector as a DeepForest model folder: where it is, where it came from, seconds to train it here."""
    if start:
        return Path(start).resolve(), "--start", None
    if (DEMO_FOLDER / "model.safetensors").is_file():
        return DEMO_FOLDER, "the demo's", None
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    name = config["model"]["name"]
    seconds = run_workflow(root / "rgb", config, [f"results/models/{name}.pt"])
    return root / "rgb/results/models" / name, "trained here with config/config.yaml", seconds


def rgbn_config(demo: dict, data: Path, name: str, steps: int, folder: Path) -> dict:
    """An RGBN run on the synthetic scenes in ``data`` with the demo's model (on the RGB ``folder``'s backbone and
    feature pyramid), tiling and training settings, for ``steps`` steps (enough epochs for them; the demo's
    warm-up, which training caps at a fifth of the steps)."""
    scenes = {
        scene: {"path": str(data / f"{scene}.tif"), "annotations": str(data / f"{scene}.gpkg"), "bands": BANDS}
        for scene in SEEDS
    }
    train = {**demo["train"], "scenes": ["rgbn_train"], "max_steps": steps, "epochs": 100, "log_every_n_steps": 1}
    header = read_header(folder)
    model = {**demo["model"], "backbone": header.backbone, "fpn_channels": header.fpn_channels}
    model.update(name=name, band_names=BAND_NAMES)
    return {"scenes": scenes, "tiling": demo["tiling"], "model": model, "train": train, "predict": PREDICT}


def synthesize(root: Path, config: dict) -> float:
    """The RGBN scenes and their crown boxes through the workflow's demo section; seconds."""
    data = root / "data"
    scenes = {scene: {"width": SIDE, "height": SIDE, "seed": seed, "nir": True} for scene, seed in SEEDS.items()}
    demo = {"directory": str(data), "scenes": scenes}
    targets = [str(data / f"{scene}.{suffix}") for scene in SEEDS for suffix in ("tif", "gpkg")]
    return run_workflow(root / "data-run", {**config, "demo": demo}, targets)


def adapted_start(finetuned: Path, folder: Path, path: Path) -> str:
    """The fine-tuned run's start before any step, as its training job built it (the model file's configuration,
    the folder's weights with the first convolution adapted), saved to ``path``; what was loaded."""
    _, cfg, _ = load_detector(finetuned)
    model = build_detector(cfg)
    loaded = init_from_model_file(model, cfg, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_detector(model, cfg, path)
    return loaded


def losses(metrics_csv: Path) -> dict:
    """First and last training loss of a model's curve, and the mean of its last 5 steps."""
    with open(metrics_csv) as handle:
        values = [float(row["train_loss"]) for row in csv.DictReader(handle) if row.get("train_loss")]
    return {"first": values[0], "last": values[-1], "last5": sum(values[-5:]) / len(values[-5:])}


def scores(workdir: Path) -> dict:
    """The held-out scene's scores of the run in ``workdir``, whose model (and run) is named after the folder."""
    evaluation = json.loads((workdir / RunPaths(workdir.name).evaluation_file("rgbn_heldout")).read_text())
    return {key: evaluation[key] for key in ("precision", "recall", "f1", "map50", "predictions", "ground_truth")}


def adaptation_line(workdir: Path, name: str) -> str | None:
    """The training log's line saying what was done to the first convolution."""
    for log in sorted((workdir / "logs/train").rglob(f"{name}*")):
        if log.is_file():
            line = next((line for line in log.read_text().splitlines() if ADAPTED in line), None)
            if line:
                return line.strip()
    return None


def predict_only(workdir: Path, base: dict, model_file: str, bands: list[str]) -> dict:
    """The held-out scene's ``bands`` predicted with ``model_file`` and scored; seconds."""
    config = copy.deepcopy(base)
    del config["scenes"]["rgbn_train"], config["train"]
    config["scenes"]["rgbn_heldout"]["bands"] = BANDS[: len(bands)]
    config["model"] = {**base["model"], "name": workdir.name, "file": model_file, "band_names": bands}
    return {"seconds": run_workflow(workdir, config), "heldout": scores(workdir)}


def bench(root: Path, start: str | None, steps: int) -> dict:
    started = time.perf_counter()
    folder, source, rgb_seconds = rgb_start(root, start)
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    data = root / "data"
    base = rgbn_config(demo, data, "rgbn", steps, folder)
    results: dict = {"cpu": cpu_info()[0], "steps": steps, "start": {"folder": str(folder), "source": source}}
    results["start"]["training_seconds"] = rgb_seconds
    results["synthesis_seconds"] = synthesize(root, base)
    runs: dict = {}
    for name, init in (("rgbn_finetuned", str(folder)), ("rgbn_scratch", "")):
        config = rgbn_config(demo, data, name, steps, folder)
        config["train"]["init"] = init
        seconds = run_workflow(root / name, config)
        runs[name] = {"seconds": seconds, "loss": losses(root / name / f"results/models/{name}.metrics.csv")}
        runs[name]["heldout"] = scores(root / name)
    results["first_convolution"] = adaptation_line(root / "rgbn_finetuned", "rgbn_finetuned")
    step0 = root / "rgbn_step0"
    finetuned = root / "rgbn_finetuned/results/models/rgbn_finetuned.pt"
    results["step0_loaded"] = adapted_start(finetuned, folder, step0 / "start.pt")
    runs["rgbn_step0"] = predict_only(step0, base, str(step0 / "start.pt"), BAND_NAMES)
    runs["rgb_reference"] = predict_only(root / "rgb_reference", base, str(folder), BAND_NAMES[:3])
    results["runs"] = runs
    f1 = {name: runs[name]["heldout"]["f1"] for name in ("rgbn_finetuned", "rgbn_scratch")}
    maps = {name: runs[name]["heldout"]["map50"] for name in ("rgbn_finetuned", "rgbn_scratch")}
    results["finetuned_beats_scratch"] = (
        f1["rgbn_finetuned"] > f1["rgbn_scratch"] and maps["rgbn_finetuned"] > maps["rgbn_scratch"]
    )
    results["seconds"] = time.perf_counter() - started
    return results


def table(results: dict) -> str:
    runs, steps = results["runs"], results["steps"]
    step0 = runs["rgbn_step0"]["heldout"]
    lines = [
        f"{'start':<44} {'step-0 F1':>9} {f'F1 @{steps}':>8} {f'mAP50 @{steps}':>11} {'loss first':>10} "
        f"{'loss last':>9} {'seconds':>7}"
    ]
    for name, label, first in (
        ("rgbn_finetuned", "DeepForest RGB folder adapted to RGBN", f"{step0['f1']:.3f}"),
        ("rgbn_scratch", "scratch", "-"),
    ):
        run = runs[name]
        lines.append(
            f"{label:<44} {first:>9} {run['heldout']['f1']:>8.3f} {run['heldout']['map50']:>11.3f} "
            f"{run['loss']['first']:>10.3f} {run['loss']['last']:>9.3f} {run['seconds']:>7.0f}"
        )
    seconds = runs["rgbn_step0"]["seconds"]
    lines.append(f"step 0 (the adapted start, not trained): mAP50 {step0['map50']:.3f}, predicted in {seconds:.0f} s")
    rgb = runs["rgb_reference"]["heldout"]
    lines.append(f"reference, the RGB folder on the scene's RGB bands: F1 {rgb['f1']:.3f}, mAP50 {rgb['map50']:.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", help="an RGB detector's DeepForest model folder (default: the demo's, else trained)")
    parser.add_argument("--steps", type=int, default=40, help="training steps of each RGBN detector")
    parser.add_argument("--out", default=str(REPO / "results/bench-rgbn.json"))
    parser.add_argument("--workdir", help="scratch folder, kept (default: a temporary one, removed afterwards)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rasterscale-rgbn-") as scratch:
        results = bench(Path(args.workdir or scratch).resolve(), args.start, args.steps)
    write_json(results, args.out)
    start = results["start"]
    trained = f", trained in {start['training_seconds']:.0f} s" if start["training_seconds"] else ""
    print(f"RGB start: {start['folder']} ({start['source']}{trained}); CPU {results['cpu']}")
    print(table(results))
    print(f"fine-tuning log: {results['first_convolution']}")
    verdict = "beats" if results["finetuned_beats_scratch"] else "does NOT beat"
    print(f"fine-tuned from the RGB folder {verdict} scratch after {results['steps']} steps (F1 and mAP@0.5)")
    print(f"{results['seconds']:.0f} s in all -> {args.out}")


if __name__ == "__main__":
    main()
