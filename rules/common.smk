# The workflow's plan (rasterscale.workflow.plan), built once per invocation by the main process with every check
# (rasterscale.workflow.checks) and stored; a job's re-parse loads it (rasterscale.workflow.storage). What the rules
# need of it, in Snakemake's terms: input functions, params, wildcard constraints, launchers, and the one-line exit.
#
# The rules' vocabulary, all of it defined here:
#   PLAN        the plan's facts: scenes, batches (batch_numbers), seams, footprints, launch geometry, settings (typed)
#   STEPS       one object a step (rasterscale.workflow.steps: STEPS.tiles, STEPS.predict, STEPS.merge, ...), bound
#               to the plan: its rules' names, inputs, outputs, resources, threads, logs, and its jobs' files
#   PATHS       this run's outputs under results/{run}/ (rasterscale.jobs.paths.RunPaths)
#   RULE_BATCHES  the batches whose rules (STEPS.tiles.rule(batch), ...) this parse defines
#   REQUESTED   the files the command line names (a batch rule declares those of its files, all with IN_BUCKET)
#   IN_BUCKET   outputs on Snakemake's default storage (rasterscale.workflow.default_storage): results/ in the bucket
#   entry_point, launcher   a step's command, and its ranks' prefix (a DDP step's)
#   report_flag, scored_files, training_outputs   outputs shown in the report (report_step: its categories)
#   pattern, fail, warn, note   wildcard constraints, the one-line exit, notices
import dataclasses
import gc
import importlib.util
import os
import shlex
import sys
from pathlib import Path

from snakemake_interface_executor_plugins.settings import DeploymentMethod

# Snakemake's processes hold millions of long-lived objects at scale (the plan, the job files' entries, the DAG's
# jobs). At Python's default thresholds (a collection every 700 allocations) collecting them took a sixth of a
# 100,000-scene dry run (152 -> 126 s); cyclic garbage is rare here, and this still collects it.
gc.set_threshold(100_000, 50, 100)


def fail(message):
    """Stop the workflow with one line (no traceback): config and input errors are the user's to fix."""
    sys.stderr.write(f"rasterscale: {message}\n")
    sys.exit(1)


def warn(message):
    sys.stderr.write(f"rasterscale: warning: {message}\n")


def note(message):
    sys.stderr.write(f"rasterscale: {message}\n")


# This workflow's own files, from the folder of the file being parsed (rules/, workflow.current_basedir), never
# from the working directory nor workflow.basedir (the main Snakefile's: the caller's, where this workflow is a
# module of another). From a local checkout its package, scripts/rasterscale, comes first on the path (before any
# installed copy) and its entry scripts run from scripts/. A remote module (github(...)) has no local checkout:
# Snakemake fetches its rules, `script:` entries, conda environment and report captions, the package comes from
# the environment (README.md, "Use as a Snakemake module") and the entry scripts from Snakemake's source cache.
RULES_DIR = workflow.current_basedir.get_path_or_uri(secret_free=True)
SCRIPTS = Path(RULES_DIR).parent / "scripts" if os.path.isdir(RULES_DIR) else None
if SCRIPTS is not None:
    sys.path.insert(0, str(SCRIPTS))
elif importlib.util.find_spec("rasterscale") is None:
    fail(
        f"the workflow is a remote module ({RULES_DIR}) and its package rasterscale is not installed here:"
        " pip install -e a clone of the workflow at the same version, or use the clone's Snakefile as the module"
    )

from rasterscale.config.schema import SCHEMA_PATH  # noqa: E402

if not SCHEMA_PATH.exists():
    fail(
        f"{SCHEMA_PATH}: no config schema beside the installed package rasterscale (a non-editable install):"
        " pip install -e a clone of the workflow instead, or use the clone's Snakefile as the module"
    )

from rasterscale.errors import ConfigError, InputError  # noqa: E402
from rasterscale.runtime.lifetime import JOB_PARENT, this_process  # noqa: E402
from rasterscale.runtime.preflight import PreflightError  # noqa: E402
from rasterscale.workflow import batches, reports  # noqa: E402
from rasterscale.workflow.steps import Steps  # noqa: E402
from rasterscale.workflow.steps import report as report_step  # noqa: E402
from rasterscale.workflow import default_storage  # noqa: E402
from rasterscale.workflow.estimate import print_estimate  # noqa: E402
from rasterscale.workflow.reuse import main_plan  # noqa: E402
from rasterscale.workflow.storage import fingerprint, job_plan, store_batch_plans  # noqa: E402


def mirror_storage_prefix():
    """Outputs on Snakemake's default storage (rasterscale.workflow.default_storage): results/ goes to the bucket,
    everything else stays local, and the local copy of the storage prefix is the working directory."""
    default_storage.route_declared_files(workflow.modifier.path_modifier)
    prefix = workflow.storage_settings.default_storage_prefix.rstrip("/")
    some_object = workflow.storage_registry.default_storage_provider.object(f"{prefix}/x")
    default_storage.mirror_working_directory(Path(str(some_object.local_path())).parent)


# The main process builds the plan with every check and writes the jobs' files, each only when its content changed
# (a job reruns when what it uses changed, and only then), or reuses both while nothing they read changed; a job's
# re-parse loads the stored plan and writes nothing. Then the plan's cost estimate, one line a section, from the bench
# results in results/throughput.json here or in this checkout (rasterscale.workflow.estimate).
PLAN_KEY = fingerprint(config)  # the stored plan's: the raw config's hash
try:
    IN_BUCKET = default_storage.check_default_storage(
        workflow.storage_settings.default_storage_provider,
        workflow.storage_settings.default_storage_prefix,
        workflow.storage_settings.keep_storage_local,
    )
    if IN_BUCKET:
        mirror_storage_prefix()
        started_with = dict(os.environ)  # what the storage plugin saw: the config's s3 section is not applied yet
    if workflow.is_main_process:
        PLAN = main_plan(config, warn=warn)
    else:
        PLAN = job_plan(config, warn=warn, argv=sys.argv)
    if IN_BUCKET and workflow.is_main_process:
        default_storage.check_plugin_environment(
            dataclasses.asdict(PLAN.settings.s3),
            started_with,
            workflow.storage_settings.default_storage_provider,
            workflow.storage_registry.default_storage_provider.settings,
        )
except (ConfigError, InputError) as err:
    fail(err)

if workflow.is_main_process:
    print_estimate(PLAN, note, SCRIPTS.parent if SCRIPTS is not None else None)

# Every rank ends when this snakemake process is gone (rasterscale.runtime.lifetime): the rule's shell outlives a
# killed snakemake, so without this its ranks would run on as orphans. Set once, when the workflow loads.
os.environ[JOB_PARENT] = str(this_process())

# The batches whose rules (tiles_batch_{b}, merge_batch_{b}, score_batch_{b}) this parse defines: all of them,
# or in a job's re-parse those of its --allowed-rules (its parse does not grow with the project).
RULE_BATCHES = batches.rule_batches(PLAN.batch_numbers, workflow.is_main_process, sys.argv)
# The files the command line may ask for: a batch's rule declares its record, its files gone since, and these; all
# of them with outputs in a bucket (only declared files go there)
REQUESTED = batches.EVERY_FILE if IN_BUCKET else batches.requested_files(sys.argv)
PATHS = PLAN.paths  # this run's outputs: results/{run}/
STEPS = Steps(PLAN)
# the jobs' Python: this workflow's own, or in a job of a conda environment (--sdm conda) that environment's
DEPLOYMENT = getattr(workflow.deployment_settings, "deployment_method", None) or ()
PYTHON = "python" if DeploymentMethod.CONDA in DEPLOYMENT else sys.executable


def entry_point(step):
    """Command that runs a step's entry script, scripts/{step.entry}.py, with the jobs' Python: the script of this
    checkout, or a remote module's from Snakemake's source cache (quoted: either path may hold a space)."""
    name = step.entry
    script = SCRIPTS / f"{name}.py" if SCRIPTS is not None else workflow.source_path(f"../scripts/{name}.py")
    return f"{shlex.quote(PYTHON)} {shlex.quote(str(script))}"


def pattern(names):
    """A wildcard constraint that matches exactly these names (none: nothing)."""
    return "|".join(names) or "^$"


def launcher(step):
    """Params function: the prefix that starts a DDP step's ranks, after the pre-flight checks of its job's final
    resources (rasterscale.workflow.steps.base.RanksStep.prefix: its launcher's, rasterscale.runtime.launchers)."""

    def prefix(wildcards, resources):
        plugin = workflow.executor_plugin
        try:
            return step.prefix(dict(resources), plugin.name if plugin is not None else None)
        except PreflightError as err:
            fail(err)

    return prefix


def forget_batch_rule_functions():
    """Drop the per-batch rules' functions from the workflow's globals, where Snakemake binds every rule's (the rules
    keep theirs): Snakemake copies these globals each time it formats a job's shell command, several times a job,
    so that with three rules a batch the dry run grew with batches times jobs (at 100,000 scenes, 4,700 globals
    copied for each of 7,800 jobs: a third of the dry run)."""
    for name in batches.BATCH_RULES:
        for batch in RULE_BATCHES:
            globals().pop(f"__{batches.batch_rule(name, batch)}", None)


def store_job_plans():
    """Before the jobs run (onstart), the plan of each batch, which its jobs' re-parse loads instead of the whole
    plan (rasterscale.workflow.storage)."""
    store_batch_plans(PLAN, PLAN_KEY)


def default_targets():
    """Rule all's input (through a lambda: evaluated only when all is the target, not for `snakemake
    check_environment`): everything the config asks for, or one line when it asks for nothing."""
    if PLAN.nothing_to_do():
        fail(PLAN.nothing_to_do())
    return STEPS.final_targets()


def report_flag(path, caption, category, item, subcategory):
    """An output shown in the report: its caption (report/{caption}.rst), category, subcategory and the label the
    report lists it by (every item of a subcategory has one)."""
    return report(
        path,
        caption=f"../report/{caption}.rst",
        category=category,
        subcategory=subcategory,
        labels={"item": item},
    )


def scored_files(batch):
    """A batch's scoring job's files besides its record (rasterscale.workflow.steps.score.Score.declared_files), those
    the report shows flagged under the scene's name."""
    return [
        report_flag(f.path, f.caption, report_step.SCENES, f.item, f.scene) if f.caption else f.path
        for f in STEPS.score.declared_files(batch, REQUESTED)
    ]


def training_outputs(model):
    """Rule train's outputs: the task's model files, its training curves (plot and CSV) in the report."""
    outputs = STEPS.train.outputs(model)
    outputs["plot"] = report_flag(outputs["plot"], "training", report_step.TRAINING, "training curves", model)
    outputs["metrics"] = report_flag(
        outputs["metrics"], "training_metrics", report_step.TRAINING, "training curves (CSV)", model
    )
    return outputs
