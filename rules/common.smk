# Python helpers for the workflow: config validation, input checks, paths and launchers.
import json
import os
import shlex
import sys
from pathlib import Path

SCRIPTS = Path(workflow.basedir) / "scripts"
sys.path.insert(0, str(SCRIPTS))

from rasterscale.raster.cog import striped_sources  # noqa: E402
from rasterscale.errors import ConfigError  # noqa: E402
from rasterscale.config.schema import nothing_to_do, validate_config  # noqa: E402
from rasterscale.config.scenes import scene_key  # noqa: E402
from rasterscale.errors import InputError  # noqa: E402
from rasterscale.raster.imagery import check_imagery  # noqa: E402
from rasterscale.raster.headers import check_raster  # noqa: E402
from rasterscale.workflow.checks import unwritable_folder  # noqa: E402
from rasterscale.runtime.preflight import launch_geometry  # noqa: E402
from rasterscale.predict.rankfiles import rank_stem  # noqa: E402
from rasterscale.predict.tile_resume import resume_dir  # noqa: E402
from rasterscale.tasks.registry import task_spec  # noqa: E402
from rasterscale.grid.split import check_validation_band  # noqa: E402


def fail(message):
    """Stop the workflow with one line (no traceback): config and input errors are the user's to fix."""
    sys.stderr.write(f"rasterscale: {message}\n")
    sys.exit(1)


SCENE_ORIGINS = {}  # scene -> the scene table's file and line it came from (config.scene_key)
NOTICES = []  # warnings: renamed keys, scenes scored on their training data
DEFAULT_BANDS = set()  # scenes whose bands the config leaves out: a raster of more than 3 colours stops them
try:
    CONFIG = validate_config(config, origins=SCENE_ORIGINS, notices=NOTICES, default_bands=DEFAULT_BANDS)
except ConfigError as err:
    fail(err)
for notice in NOTICES:
    sys.stderr.write(f"rasterscale: warning: {notice}\n")
UNWRITABLE = unwritable_folder(".", [CONFIG["demo"]["directory"]] if CONFIG["demo"]["scenes"] else [])
if UNWRITABLE is not None:
    fail(
        f"{Path(UNWRITABLE).resolve()}: folder is not writable, and the workflow writes into it; make it writable "
        "(chmod u+w), or run in a folder you can write (--directory)"
    )

SCENES = CONFIG["scenes"]
DEMO = CONFIG["demo"]
MODEL = CONFIG["model"]
TRAIN = CONFIG["train"]
PREDICT = CONFIG["predict"]
PYTHON = sys.executable
TASK = task_spec(CONFIG["task"])
# launch geometry (ranks per node, nodes, shards) of each DDP section: computed in one place
GEOMETRY = {section: launch_geometry(CONFIG, section) for section in ("train", "predict")}

try:
    # the effective class names: config keys over what the model file (model.checkpoint / train.init) says
    LABELS = TASK.labels(CONFIG)  # use these, never MODEL["labels"]
except (ConfigError, InputError) as err:
    fail(err)


def is_demo_scene(name):
    return name in DEMO["scenes"]


def demo_raster(name):
    return f"{DEMO['directory']}/{name}.tif"


UNTILED = {}  # scene -> its striped rasters (itself, or a VRT's sources): read from a tiled COG (rules/cog.smk)


def scene_source(name):
    """The raster the config names for a scene."""
    return SCENES[name]["path"]


def cog_raster(name):
    return f"results/{name}/cog.tif"


def scene_raster(name):
    """The raster a scene is read from: its own, or the tiled COG made from it when its own is striped."""
    return cog_raster(name) if name in UNTILED else scene_source(name)


def scene_annotations(name):
    return SCENES[name].get("annotations", "")


def scene_imagery(name):
    """The scene's imagery keys (bands, scale) for the manifest's imagery spec, as JSON."""
    scene = SCENES[name]
    imagery = {"key": f"scenes.{name}", "bands": scene.get("bands"), "scale": scene.get("scale")}
    return json.dumps(imagery, separators=(",", ":"))


def scene_image_name(name):
    """The image name a scene's CSV/VOC annotations give its boxes under (scenes.X.image_path)."""
    return SCENES[name].get("image_path") or Path(scene_source(name)).name


def check_scene(name, scene):
    """Header checks of one scene's existing inputs."""
    path = scene["path"]
    demo = is_demo_scene(name)
    if demo and path != demo_raster(name):
        fail(f"scenes.{name}: a demo scene's path must be {demo_raster(name)}")
    if not Path(path).exists():
        if demo:
            return
        fail(f"{path}: raster not found ({scene_key(name, 'path', SCENE_ORIGINS)})")
    raster = check_raster(path)
    bands = None if name in DEFAULT_BANDS else scene.get("bands")
    check_imagery(raster, bands, scene.get("scale"), f"scenes.{name}")
    if name in TRAIN["scenes"] and not MODEL["checkpoint"]:
        tiling = CONFIG["tiling"]
        check_validation_band(raster, name, tiling["patch_size"], tiling["overlap"], TRAIN["validation_fraction"])
    striped = striped_sources(path)
    if striped:
        UNTILED[name] = striped
    annotations = scene.get("annotations")
    if annotations and (Path(annotations).exists() or not demo):
        TASK.check_annotations(annotations, raster, LABELS, scene.get("label_column"), scene_image_name(name))


def check_scene_inputs():
    """Header checks of every existing input at load time (so also on `snakemake -n`); an error of a scene
    from a scene table names its line."""
    for name, scene in SCENES.items():
        try:
            check_scene(name, scene)
        except InputError as err:
            fail(f"{err} ({SCENE_ORIGINS[name]})" if name in SCENE_ORIGINS else err)


check_scene_inputs()

for name in [name for name in SCENES if name in UNTILED and name in {*TRAIN["scenes"], *PREDICT["scenes"]}]:
    source = scene_source(name)
    what = f"{source} is striped, not tiled" if UNTILED[name] == [source] else f"{source} reads striped rasters"
    sys.stderr.write(
        f"rasterscale: warning: {what}: every windowed read would decode whole raster rows; scene {name} is "
        f"read from the tiled COG {cog_raster(name)} (rule convert_to_cog)\n"
    )


def entry_point(name):
    """Command that runs the entry script scripts/{name}.py with this workflow's Python (quoted: either path may
    hold a space)."""
    return f"{shlex.quote(PYTHON)} {shlex.quote(str(SCRIPTS / name) + '.py')}"


def world_size(section):
    """Ranks of one job of a DDP section (for prediction: of one shard)."""
    return GEOMETRY[section_name(section)].world_size


def predict_shards():
    return GEOMETRY["predict"].shards


def checkpoint_path():
    return MODEL["checkpoint"] or f"results/models/{MODEL['name']}.pt"


def trained_model_outputs(name):
    """Everything training writes for a model: the model file (and, for detection, its DeepForest folder),
    curves."""
    return TASK.trained_model_files(name)


def train_start_inputs(wildcards):
    """The files training starts from (train.init, model.backbone_weights), as rule inputs."""
    return {
        key: path for key, path in (("init", TRAIN["init"]), ("backbone_weights", MODEL["backbone_weights"])) if path
    }


def labels_json():
    return json.dumps(LABELS, separators=(",", ":"))


def scene_manifest(name):
    return f"results/{name}/tiles.parquet"


def shard_dir(batch, shard):
    """The folder a prediction job (batch, shard) writes its ranks' files into (rule predict's output)."""
    return f"results/predict/batch-{batch}/shard-{shard}"


def shard_resume_dir(batch, shard):
    """Where a prediction job's ranks checkpoint finished tiles: beside its output, which a failed job loses
    (not an output: the job removes it when it succeeds)."""
    return resume_dir(shard_dir(batch, shard))


def scene_rank_files(name, batch):
    """A scene's rank files (paths without suffix: rasterscale.predict.rankfiles), every shard's, in rank order."""
    world = world_size(PREDICT)
    return [rank_stem(shard_dir(batch, s), name, s * world + r) for s in range(predict_shards()) for r in range(world)]


def scene_outputs(name):
    """A scene's merged outputs (the task's, and the gathered profile), by the merge's names for them."""
    return TASK.outputs_of_scene(CONFIG, name)


# Batches of scenes: predict.scenes, predict.scenes_per_job at a time, in config order (static, computed once).
# One job per batch writes its scenes' tile manifests, one per (batch, shard) predicts them all with one model
# load, one per batch merges them: a Python start per batch, not per scene. Such a job's inputs reach it through
# the batch's job file (rule scene_batch), not its command line.
BATCHES = [
    PREDICT["scenes"][start : start + PREDICT["scenes_per_job"]]
    for start in range(0, len(PREDICT["scenes"]), PREDICT["scenes_per_job"])
]


def unbatched_scenes_pattern():
    """Wildcard constraint of the per-scene tile_manifest rule: the scenes no batch makes the manifest of."""
    return "|".join(name for name in SCENES if name not in PREDICT["scenes"]) or "^$"


def batch_file(batch):
    return f"results/batches/batch-{batch}.json"


def batch_job(batch):
    """What the jobs of a batch read from its job file: each scene's raster, manifest, imagery keys, rank files,
    outputs."""
    scenes = [
        {
            "name": name,
            "raster": scene_raster(name),
            "manifest": scene_manifest(name),
            "imagery": json.loads(scene_imagery(name)),
            "rank_files": scene_rank_files(name, int(batch)),
            **scene_outputs(name),
        }
        for name in BATCHES[int(batch)]
    ]
    return json.dumps({"batch": int(batch), "scenes": scenes}, indent=1)


def batch_inputs(batch):
    """The rasters and manifests of a batch's scenes."""
    names = BATCHES[batch]
    return {"rasters": [scene_raster(n) for n in names], "manifests": [scene_manifest(n) for n in names]}


def predict_job_config():
    """The task, model, tiling and predict sections a prediction job uses (not predict.scenes: the job file has
    them)."""
    predict = {key: value for key, value in PREDICT.items() if key != "scenes"}
    config = {"task": CONFIG["task"], "model": MODEL, "tiling": CONFIG["tiling"], "predict": predict}
    return json.dumps(config, separators=(",", ":"))


def merge_job_config():
    """What a merge job uses: the task, the resolved class names, the merge and predict sections."""
    predict = {key: value for key, value in PREDICT.items() if key != "scenes"}
    config = {"task": CONFIG["task"], "labels": LABELS, "merge": CONFIG["merge"], "predict": predict}
    return json.dumps(config, separators=(",", ":"))


# Launching the ranks: locally Lightning starts them; under the SLURM profile (slurm.launcher: srun) Slurm does,
# one task per device. docs/slurm.md explains; rasterscale/runtime/preflight.py holds the checks.
from rasterscale.runtime.lifetime import JOB_PARENT, this_process  # noqa: E402
from rasterscale.runtime.preflight import PreflightError, plan_launch  # noqa: E402

# Every rank ends when this snakemake process is gone (rasterscale.runtime.lifetime): the rule's shell outlives a killed
# snakemake, so without this its ranks would run on as orphans. Set once, when the workflow loads.
os.environ[JOB_PARENT] = str(this_process())

SLURM_NUMBERS = ("gpus_per_node", "mem_mb", "train_runtime", "predict_runtime", "train_stop_before_s")


def slurm_setting(key):
    """A `slurm` config value (numbers come as strings from a profile's `config:`)."""
    value = CONFIG["slurm"][key]
    return int(value) if key in SLURM_NUMBERS else value


def section_name(section):
    return "predict" if section is PREDICT else "train"


def ddp_resources(section):
    """Slurm resources of a DDP job (none locally): `devices` tasks, and GPUs, on each node of the job.

    The executor plugin turns `tasks_per_node` into --ntasks-per-node only with a truthy `mpi` resource and
    only when > 1 (and then runs the rule's command as is: it starts with srun). One rank per node on several
    nodes asks for the total (`tasks`) and pins one per node; one rank on one node needs no `mpi`: the
    executor runs it as one task (srun -n1).
    """
    if slurm_setting("launcher") != "srun":
        return {}
    geometry = GEOMETRY[section_name(section)]
    devices, nodes = geometry.devices, geometry.nodes
    resources = {"nodes": nodes, "cpus_per_task": section["workers"] + 1}  # workers are spawned per rank
    if devices > 1:
        resources.update(mpi="srun", tasks_per_node=devices)
    elif nodes > 1:
        resources.update(mpi="srun", tasks=nodes, slurm_extra="--ntasks-per-node=1")
    stop_before = slurm_setting("train_stop_before_s") if section is TRAIN else 0
    if stop_before:  # SIGTERM to every rank ahead of the time limit: a checkpoint, a clean stop (checkpoints.py)
        resources["slurm_extra"] = " ".join(
            filter(None, [resources.get("slurm_extra"), f"--signal=TERM@{stop_before}"])
        )
    if slurm_setting("gres") and section["accelerator"] != "cpu":
        resources["gres"] = f"{slurm_setting('gres')}:{devices}"
        if "tasks" in resources:
            resources["tasks_per_gpu"] = 0  # or the plugin turns `tasks` into --ntasks-per-gpu
    runtime = slurm_setting(f"{section_name(section)}_runtime")
    for key, value in [
        ("slurm_partition", slurm_setting("partition")),
        ("mem_mb", slurm_setting("mem_mb")),
        ("runtime", runtime),
    ]:
        if value:
            resources[key] = value
    return resources


def launcher(section):
    """Params function: the prefix that starts a DDP job's ranks, after the pre-flight checks of its resources.

    Empty locally (Lightning starts the ranks) and for a one-rank Slurm job (the executor's srun -n1 does);
    otherwise `srun --nodes=N --ntasks-per-node=G --cpus-per-task=C --kill-on-bad-exit=1 `, from the job's
    final resources (the profile's overrides included), which must match the config.
    """
    geometry = GEOMETRY[section_name(section)]

    def prefix(wildcards, resources):
        plugin = workflow.executor_plugin
        try:
            return plan_launch(
                geometry,
                dict(resources),
                slurm_setting("launcher"),
                plugin.name if plugin is not None else None,
                slurm_setting("gpus_per_node"),
            )
        except PreflightError as err:
            fail(err)

    return prefix


def rank_threads(section):
    return section["devices"] * (section["workers"] + 1)


def config_json(*sections):
    """The validated config's given sections as JSON (so a job reruns only when what it uses changes)."""
    return json.dumps({name: CONFIG[name] for name in sections}, separators=(",", ":"))


def training_scenes_json():
    scenes = [
        {
            "name": name,
            "raster": scene_raster(name),
            "manifest": f"results/{name}/tiles.parquet",
            "annotations": scene_annotations(name),
            "label_column": SCENES[name].get("label_column"),
            "image_path": scene_image_name(name),
        }
        for name in TRAIN["scenes"]
    ]
    return json.dumps(scenes, separators=(",", ":"))


def evaluated_scenes():
    return [name for name in PREDICT["scenes"] if scene_annotations(name)]


def evaluation_scene(name):
    """What a scene's evaluation reads (JSON): its raster, its merged outputs, its ground truth."""
    scene = {
        "name": name,
        "raster": scene_raster(name),
        "annotations": scene_annotations(name),
        "label_column": SCENES[name].get("label_column"),
        "image_path": scene_image_name(name),
        **scene_outputs(name),
    }
    return json.dumps(scene, separators=(",", ":"))


def final_targets():
    targets = []
    if TRAIN["scenes"] and not MODEL["checkpoint"]:
        targets += list(trained_model_outputs(MODEL["name"]).values())
    for name in PREDICT["scenes"]:
        targets += list(scene_outputs(name).values())
    for name in evaluated_scenes():
        targets += [f"results/{name}/evaluation.json", f"results/{name}/quicklook.png"]
    return targets


def default_targets():
    """Rule all's input (through a lambda: evaluated only when all is the target, not for `snakemake
    check_environment`): everything the config asks for, or one line when it asks for nothing."""
    if nothing_to_do(CONFIG):
        fail(nothing_to_do(CONFIG))
    return final_targets()


def print_evaluation_summary():
    rows = []
    for name in evaluated_scenes():
        path = Path(f"results/{name}/evaluation.json")
        if path.exists():
            m = json.loads(path.read_text())
            rows.append(f"  {name:<20} {TASK.summarize(m)}")
    if rows:
        print(f"rasterscale evaluation ({TASK.name}):")
        print("\n".join(rows))


PROFILE_TABLES_UP_TO = 4  # scenes; more get one line each (200 tables would bury the run's end)


def print_predict_profiles():
    """Each predicted scene's profile (gathered by the merge) as one table, at the end of the run; with many
    scenes, one line per scene (the tables are in the merge logs and predict_profile.json)."""
    from rasterscale.predict.profile import format_profile_table

    profiles = {}
    for name in PREDICT["scenes"]:
        path = Path(f"results/{name}/predict_profile.json")
        if path.exists():
            profiles[name] = json.loads(path.read_text())
    if len(profiles) <= PROFILE_TABLES_UP_TO:
        for name, profile in profiles.items():
            print(format_profile_table(profile, title=f"rasterscale predict profile: {name}"))
        return
    print(f"rasterscale predict profiles ({len(profiles)} scenes; tables in results/{{scene}}/predict_profile.json):")
    for name, profile in profiles.items():
        total = profile["total"]
        print(
            f"  {name:<24} {total['ranks']} rank(s) {total['tiles']:>7} tiles {total['tiles_per_s']:>8.2f} tiles/s "
            f"wall {total['wall_s']:.1f} s"
        )
