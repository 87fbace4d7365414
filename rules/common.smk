# Python helpers for the workflow: config validation, input checks, paths and launchers.
import json
import os
import sys
from pathlib import Path

SCRIPTS = Path(workflow.basedir) / "scripts"
sys.path.insert(0, str(SCRIPTS))

from rasterscale.config import ConfigError, validate_config  # noqa: E402
from rasterscale.inputs import InputError, check_raster, read_annotations  # noqa: E402


def fail(message):
    """Stop the workflow with one line (no traceback): config and input errors are the user's to fix."""
    sys.stderr.write(f"rasterscale: {message}\n")
    sys.exit(1)


try:
    CONFIG = validate_config(config)
except ConfigError as err:
    fail(err)

SCENES = CONFIG["scenes"]
DEMO = CONFIG["demo"]
MODEL = CONFIG["model"]
TRAIN = CONFIG["train"]
PREDICT = CONFIG["predict"]
PYTHON = sys.executable


def is_demo_scene(name):
    return name in DEMO["scenes"]


def demo_raster(name):
    return f"{DEMO['directory']}/{name}.tif"


def demo_boxes(name):
    return f"{DEMO['directory']}/{name}.gpkg"


def scene_raster(name):
    return SCENES[name]["path"]


def scene_annotations(name):
    return SCENES[name].get("annotations", "")


def check_scene_inputs():
    """Header checks of every existing input at load time (so also on `snakemake -n`)."""
    for name, scene in SCENES.items():
        path = scene["path"]
        demo = is_demo_scene(name)
        if demo and (path, scene.get("annotations", demo_boxes(name))) != (
            demo_raster(name),
            scene.get("annotations", demo_boxes(name)),
        ):
            fail(f"scenes.{name}: a demo scene's path must be {demo_raster(name)}")
        if not Path(path).exists():
            if demo:
                continue
            fail(f"{path}: raster not found (scenes.{name}.path)")
        raster = check_raster(path)
        annotations = scene.get("annotations")
        if annotations and (Path(annotations).exists() or not demo):
            read_annotations(annotations, raster, MODEL["labels"], scene.get("label_column"))


try:
    check_scene_inputs()
except InputError as err:
    fail(err)


def entry_point(name):
    """Command that runs the entry script scripts/{name}.py with this workflow's Python."""
    return f"{PYTHON} {SCRIPTS / name}.py"


def world_size(section):
    return section["devices"] * section.get("nodes", 1)


def predict_shards():
    return PREDICT.get("nodes", 1)


def checkpoint_path():
    return MODEL["checkpoint"] or f"results/models/{MODEL['name']}.pt"


def rank_files(wildcards):
    ranks = predict_shards() * world_size(PREDICT)
    return [f"results/{wildcards.scene}/predict/rank-{r}.parquet" for r in range(ranks)]


def shard_outputs(shard):
    """Output patterns of one prediction shard: its ranks' files."""
    world = world_size(PREDICT)
    return [f"results/{{scene}}/predict/rank-{shard * world + r}.parquet" for r in range(world)]


def launcher(section):
    """Prefix that starts the ranks: empty locally, where Lightning spawns them itself."""
    return ""


def rank_threads(section):
    return section["devices"] * (section["workers"] + 1)


def config_json():
    return json.dumps(CONFIG, separators=(",", ":"))


def training_scenes_json():
    scenes = [
        {
            "name": name,
            "raster": scene_raster(name),
            "manifest": f"results/{name}/tiles.parquet",
            "annotations": scene_annotations(name),
            "label_column": SCENES[name].get("label_column"),
        }
        for name in TRAIN["scenes"]
    ]
    return json.dumps(scenes, separators=(",", ":"))


def evaluated_scenes():
    return [name for name in PREDICT["scenes"] if scene_annotations(name)]


def final_targets():
    targets = []
    if TRAIN["scenes"] and not MODEL["checkpoint"]:
        name = MODEL["name"]
        targets += [
            f"results/models/{name}.pt",
            f"results/models/{name}.metrics.csv",
            f"results/models/{name}.png",
        ]
    for name in PREDICT["scenes"]:
        targets += [
            f"results/{name}/detections.gpkg",
            f"results/{name}/detections.parquet",
        ]
    for name in evaluated_scenes():
        targets += [f"results/{name}/evaluation.json", f"results/{name}/quicklook.png"]
    return targets


def print_evaluation_summary():
    rows = []
    for name in evaluated_scenes():
        path = Path(f"results/{name}/evaluation.json")
        if path.exists():
            m = json.loads(path.read_text())
            rows.append(
                f"  {name:<20} precision={m['precision']:.3f} recall={m['recall']:.3f} "
                f"f1={m['f1']:.3f} map50={m['map50']:.3f}"
            )
    if rows:
        print("rasterscale evaluation (IoU >= %.2f):" % CONFIG["evaluate"]["iou_threshold"])
        print("\n".join(rows))
