"""What the dry run verifies: :func:`build_plan` validates the raw config, checks every scene's existing inputs
(raster, imagery keys, annotations, the validation band of a training scene) and the model file's labels, and
returns the frozen :class:`rasterscale.workflow.plan.Plan`; and the working directory the workflow writes into
(:func:`unwritable_folder`). Problems raise :class:`ConfigError` or :class:`InputError` (one line, naming the key or
file, and a scene table's line).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rasterio.crs import CRS
from rasterio.errors import CRSError

from rasterscale.config.scenes import is_glob, scene_key
from rasterscale.config.schema import validate_config
from rasterscale.errors import ConfigError, InputError
from rasterscale.grid.project import Footprint, find_seams
from rasterscale.grid.split import check_validation_band
from rasterscale.jobs import paths
from rasterscale.raster.bands import differs_wildly
from rasterscale.raster.cog import striped_sources
from rasterscale.raster.header_cache import plan_headers
from rasterscale.raster.headers import DEFAULT_BANDS, CheckedHeader, RasterInfo, check_raster, headers_from, siblings
from rasterscale.raster.imagery import ImageSpec, band_statistics, check_imagery, mask_of
from rasterscale.raster.item_header import ItemHeader
from rasterscale.raster.item_header import recorded_skips as recorded_skips_in
from rasterscale.raster.remote import check_tiled, is_remote, local_files
from rasterscale.raster.s3 import is_local_copy
from rasterscale.runtime.preflight import launch_geometry
from rasterscale.settings import SceneSettings, Settings, config_without_scenes, settings_of
from rasterscale.tasks.registry import task_spec
from rasterscale.workflow.batches import form_batches, read_written_batches
from rasterscale.workflow.plan import SECTIONS, Plan

STATISTICS_SIDE = 256  # a predicted scene's statistics, against a raw model's, from a read this small (dry run)
SKIPPED = "skipped"  # results/{run}/jobs/skipped/{scene}.json: a scene its tile-manifest job found not as trusted
WORKFLOW_FOLDERS = ("results", "results/models", "logs", "benchmarks", ".snakemake")


def build_plan(
    raw: Mapping[str, Any],
    workdir: str | Path = ".",
    warn: Callable[[str], None] | None = None,
    cache_headers: bool = False,
) -> Plan:
    """Validate the raw config, check every scene's existing inputs (so also on ``snakemake -n``) and return the
    plan. ``warn`` gets each notice as soon as the config is validated (so before a later error) and each striped
    scene's warning. Raises ConfigError or InputError; an error of a scene from a scene table names its line.

    The scenes' headers are read ahead of their checks by a thread pool; with ``cache_headers`` (the main
    process's plan), through the header cache of ``workdir`` (:mod:`rasterscale.raster.header_cache`)."""
    origins: dict[str, str] = {}
    notices: list[str] = []
    default_bands: set[str] = set()
    items: dict[str, ItemHeader] = {}
    config = validate_config(raw, origins=origins, notices=notices, default_bands=default_bands, item_headers=items)
    say = warn if warn is not None else _silent
    for notice in notices:
        say(notice)
    settings = settings_of(config)
    check_writable(settings, workdir)
    if settings.model.name in paths.SHARED:
        given = (raw.get("model") or {}).get("name") is not None
        named = "" if given else f" (model.file {settings.model.file}'s name: model.name is unset)"
        raise ConfigError(
            f"config: model.name {settings.model.name!r}{named} names the run's folder "
            f"results/{settings.model.name}/, which every run shares; name the model otherwise"
        )
    geometry = {section: launch_geometry(settings, section) for section in SECTIONS}
    task = task_spec(settings.task)
    labels = tuple(task.labels(settings))  # use these, never model.labels
    model_input = task.model_input(settings)
    plan = Plan(config, tuple(notices), origins, labels, geometry=geometry, model_input=model_input, trusted=items)
    skipped = recorded_skips(plan, workdir) if settings.scenes_on_error == "skip" else {}
    for name, reason in skipped.items():
        say(f"scene {name} is left out (scenes_on_error: skip), as its tile-manifest job found: {reason}")
    untiled, footprints, found = _check_scenes(plan, default_bands, skipped, workdir if cache_headers else None, say)
    inputs = {path: file_stat(Path(workdir) / path) for path in checked_files(settings)}
    plan = plan.with_(untiled=untiled, inputs=inputs, footprints=footprints, unwatched=unwatched_read(plan))
    if skipped or found:
        plan = without_scenes(plan, {**skipped, **found})
    if plan.has_project():
        check_project_crs(plan)
        if settings.project.seams:
            plan = plan.with_(seams=tuple(find_seams(footprints, settings.tiling.overlap)))
    plan = _batches(plan, workdir)
    for line in plan.striped_warnings():
        say(line)
    return plan


def _silent(line: str) -> None:
    pass


def _check_scenes(
    plan: Plan,
    default_bands: set[str],
    skipped: Mapping[str, str],
    cached: str | Path | None,
    say: Callable[[str], None],
) -> tuple[dict[str, tuple[str, ...]], dict[str, Footprint], dict[str, str]]:
    """Check every scene but ``skipped``: its striped rasters, the footprints of the predicted ones, and (with
    scenes_on_error: skip) the scenes that failed, each with its one line (a warning each); with ``stop`` a scene's
    error is raised. A scene whose STAC item gives its header (``plan.trusted``) is checked against that header: its
    raster is not opened. The others' headers are read ahead, through the header cache of ``cached`` when given."""
    settings = plan.settings
    skip = settings.scenes_on_error == "skip"
    trusted = {s.path: plan.trusted[n] for n, s in settings.scenes.items() if n in plan.trusted and n not in skipped}
    read = (s.path for n, s in settings.scenes.items() if n not in skipped and s.path not in trusted)
    untiled, footprints, failed = {}, {}, {}
    predicted = set(plan.predict_scenes)
    roles = (frozenset(predicted), frozenset(settings.train.scenes))  # a list's `in` a scene: quadratic
    cache = Path(cached) / paths.HEADER_CACHE if cached is not None else None

    def header(path: str) -> CheckedHeader:  # a trusted raster's built when asked (not 200,000 held at once)
        return (trusted[path].raster_info(path), None) if path in trusted else reads.header(path)

    with plan_headers(read, cache, say) as reads, headers_from(header):
        for name, scene in settings.scenes.items():
            if name in skipped:
                continue
            try:
                striped, raster = _check_scene(plan, name, scene, default_bands, say, roles)
            except InputError as err:
                if not skip:
                    raise
                failed[name] = str(err)
                say(f"scene {name} is left out (scenes_on_error: skip): {err}")
                continue
            if striped:
                untiled[name] = tuple(striped)
            if raster is not None and name in predicted:
                footprints[name] = footprint_of(raster)
    return untiled, footprints, failed


def recorded_skips(plan: Plan, workdir: str | Path) -> dict[str, str]:
    """The scenes whose tile-manifest job found their raster unreadable or not what their STAC item says (its record
    under results/{run}/jobs/skipped/ matches the item and raster of this plan), with the job's reason."""
    trusted = {name: (plan.scenes[name].path, header) for name, header in plan.trusted.items()}
    return recorded_skips_in(Path(workdir) / plan.paths.jobs_dir(SKIPPED), trusted)


def without_scenes(plan: Plan, skipped: Mapping[str, str]) -> Plan:
    """The plan without the ``skipped`` scenes (scenes_on_error: skip), and with them and why in ``skipped``; one
    line when no scene is left to train on or to predict."""
    settings = plan.settings
    for section, listed in (("train", settings.train.scenes), ("predict", settings.predict.scenes)):
        if listed and all(name in skipped for name in listed):
            first = next(iter(skipped.values()))
            raise InputError(f"{section}.scenes: every scene of it is left out (scenes_on_error: skip): {first}")
    config = config_without_scenes(plan.config, set(skipped))
    kept_trusted = {name: header for name, header in plan.trusted.items() if name not in skipped}
    return dataclasses.replace(plan, config=config, trusted=kept_trusted, skipped=dict(skipped))


def footprint_of(raster: RasterInfo) -> Footprint:
    """A scene's footprint from its header: CRS (its EPSG code where it has one), bounds, pixel size."""
    t = raster.transform
    xs, ys = (t.c, t.c + t.a * raster.width), (t.f, t.f + t.e * raster.height)
    crs = raster.crs.to_string() if raster.crs is not None else ""
    dtype = raster.dtypes[0] if raster.dtypes else ""
    return Footprint(crs, (min(xs), min(ys), max(xs), max(ys)), (abs(t.a), abs(t.e)), raster.count, dtype)


def check_project_crs(plan: Plan) -> None:
    """The project's layers need one CRS: the scenes' own, or project.crs (one line naming both otherwise)."""
    by_crs: dict[str, list[str]] = {}
    for name, footprint in plan.footprints.items():
        by_crs.setdefault(footprint.crs, []).append(name)
    listed = "; ".join(f"{crs}: {_some(names)}" for crs, names in by_crs.items())
    crs = plan.settings.project.crs
    if crs:
        try:
            CRS.from_user_input(crs)
        except CRSError as err:
            raise ConfigError(f"project.crs: {crs!r} is not a CRS ({err})") from err
    if len(by_crs) > 1 and not crs:
        raise ConfigError(
            f"predict.scenes: the scenes are in {len(by_crs)} CRSs ({listed}); set project.crs to the CRS of the "
            "project's layers (e.g. project: {crs: EPSG:32618})"
        )


def _some(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def _batches(plan: Plan, workdir: str | Path) -> Plan:
    """The plan with its prediction batches: the recorded ones that still hold, then the new scenes and seams."""
    members = plan.project_sources() if plan.has_project() else plan.predict_scenes
    size = plan.settings.predict.scenes_per_job
    base = Path(workdir)
    recorded = read_written_batches(plan.paths.jobs_dir("tiles"), workdir)
    batches, kept = form_batches(members, plan.batch_entry, size, recorded, lambda r: (base / r).exists())
    return plan.with_(members=batches, kept=kept)


def _check_scene(
    plan: Plan,
    name: str,
    scene: SceneSettings,
    default_bands: set[str],
    say: Callable[[str], None],
    roles: tuple[frozenset[str], frozenset[str]],
) -> tuple[list[str], RasterInfo | None]:
    """Header checks of one scene's existing inputs (``roles``: the predicted and the training scenes); its striped
    rasters (none when tiled or absent) and its header (none when absent)."""
    settings = plan.settings
    path = scene.path
    demo = name in settings.demo.scenes
    if demo and path != plan.demo_raster(name):
        raise ConfigError(f"scenes.{name}: a demo scene's path must be {plan.demo_raster(name)}")
    if not is_remote(path) and not Path(path).exists():
        if demo:
            return [], None
        raise InputError(f"{path}: raster not found ({scene_key(name, 'path', plan.origins)})")
    try:
        raster = check_raster(path)
        bands = None if name in default_bands else scene.bands
        check_imagery(raster, bands, scene.scale, f"scenes.{name}", plan.model_input.raw)
        if name in roles[0]:
            check_scene_input(plan, name, scene, say)
        if name in roles[1] and not settings.model.file:
            tiling, train = settings.tiling, settings.train
            check_validation_band(raster, name, tiling.patch_size, tiling.overlap, train.validation_fraction)
        striped = striped_sources(path)
        check_tiled(path, striped)
        if not demo:
            plan.task.check_scene_keys(scene, lambda key: f"scenes.{name}.{key}")
        annotations = scene.annotations
        if annotations and (Path(annotations).exists() or not demo):
            image_name = plan.scene_image_name(name)
            column = scene.label_column
            warnings = plan.task.check_annotations(annotations, raster, list(plan.labels), column, image_name)
            for key, line in warnings or ():
                if not getattr(scene, key):
                    say(line.replace("{scene}", name))
    except InputError as err:
        if name in plan.origins:
            raise InputError(f"{err} ({plan.origins[name]})") from err
        raise
    return striped, raster


def check_scene_input(plan: Plan, name: str, scene: SceneSettings, say: Callable[[str], None]) -> None:
    """A predicted scene's bands against the model's: as many, and ``normalize`` only on training scenes (the
    model's statistics are used); a scene whose statistics differ wildly from a raw model file's gets a warning."""
    model = plan.model_input
    count = len(scene.bands or DEFAULT_BANDS)
    source = plan.settings.model.file or "the model"
    if count != model.count:  # the config's keys disagree whatever the raster: never skipped (scenes_on_error)
        raise ConfigError(
            f"{scene.path}: scenes.{name}.bands gives {count} band(s) but {source} takes {model.count} "
            f"[{', '.join(model.names)}]; set scenes.{name}.bands to {model.count} bands"
        )
    if scene.normalize is not None and name not in plan.train_scenes:
        raise ConfigError(
            f"config: key 'scenes.{name}.normalize' is set on a scene that is only predicted: the model's own "
            f"statistics are used ({model.describe()}); normalize: auto computes them from training scenes (set it on "
            "those, or model.normalize)"
        )
    local = not is_remote(scene.path) and name not in plan.trusted  # a trusted item's raster is not opened
    if model.raw and not model.pending and plan.settings.model.file and local:
        spec = ImageSpec(tuple(scene.bands or DEFAULT_BANDS), *mask_of(check_raster(scene.path)), raw=True)
        difference = differs_wildly(band_statistics(scene.path, spec, f"scenes.{name}", STATISTICS_SIDE), model)
        if difference:
            say(
                f"{scene.path}: scene {name}'s pixels differ from what the model was trained on ({difference}): "
                "another sensor or bit depth?"
            )


def checked_files(settings: Settings) -> Iterator[str]:
    """The local files a plan's checks read: every scene's raster and annotations, the model files, the STAC items
    scenes came from (a remote one's changes are not watched)."""
    return iter(local_files(_read_files(settings)))


def _read_files(settings: Settings) -> Iterator[str]:
    for scene in settings.scenes.values():
        yield from checked_scene_files(scene)
    yield from run_files(settings)


def checked_scene_files(scene: SceneSettings) -> Iterator[str]:
    """The files a plan's checks read of a scene: its raster, annotations, STAC item and tree tops (local or
    not)."""
    yield scene.path
    yield from (path for path in (scene.annotations, scene.stac, scene.tree_tops) if path)


def run_files(settings: Settings) -> Iterator[str]:
    """The files a plan's checks read besides the scenes': the STAC items scenes came from, the model files (a
    card file among them)."""
    yield from settings.stac.items
    model = settings.model
    card = model.card if isinstance(model.card, str) else None  # a card file, not one written into the config
    yield from (
        path for path in (model.file, card, settings.train.init, model.backbone_weights, model.encoder_weights) if path
    )


def file_stat(path: str | Path) -> tuple[int, int] | None:
    """A file's (size, mtime_ns), None when it does not exist."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_size, stat.st_mtime_ns)


def check_writable(settings: Settings, workdir: str | Path = ".") -> None:
    """An InputError naming the first folder the workflow writes into that it cannot (:func:`unwritable_folder`)."""
    demo = settings.demo
    unwritable = unwritable_folder(workdir, [demo.directory] if demo.scenes else [])
    if unwritable is not None:
        raise InputError(
            f"{Path(unwritable).resolve()}: folder is not writable, and the workflow writes into it; make it "
            "writable (chmod u+w), or run in a folder you can write (--directory)"
        )


def unwritable_folder(workdir: str | Path = ".", others: Sequence[str | Path] = ()) -> Path | None:
    """The first folder the workflow writes into that it cannot (the working directory, its results/, logs/,
    benchmarks/, .snakemake/ and ``others`` where they exist), or None."""
    workdir = Path(workdir)
    for folder in [workdir, *(workdir / name for name in WORKFLOW_FOLDERS), *map(Path, others)]:
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            return folder
    return None


GLOB = "glob:"  # a watched glob's key: GLOB + its pattern (rasterscale.workflow.reuse)
SIBLINGS = "siblings:"  # a watched file's sidecar files' names: SIBLINGS + its path


def unwatched_read(plan: Plan) -> str:
    """The first path the plan's checks read that no stat watches ("" when none): a remote file, a local copy of
    an S3 object (the object may change in its bucket: only the next plan's fetch asks), or a raster not trusted from
    its STAC item that is a VRT (its header depends on its sources)."""
    trusted = {plan.scenes[name].path for name in plan.trusted}
    for path in _read_files(plan.settings):
        if path in trusted:
            continue
        if is_remote(path) or is_local_copy(path) or path.lower().endswith(".vrt"):
            return path
    return ""


def watched_inputs(plan: Plan, raw: Mapping[str, Any], workdir: str | Path = ".") -> dict[str, Any] | None:
    """What the plan's building read, each by what tells its versions apart (:func:`watch_value`), for the main
    process to reuse the plan while none changed (:mod:`rasterscale.workflow.reuse`): the local files its checks
    read (``plan.inputs``: those of the scenes it left out too), their sidecar files (``x.tif.aux.xml``, a model
    file's card ``x.pt.yaml``, a shapefile's ``.dbf``) and which there are (one added), the files in a folder read
    as one (a model folder), the scene table or a glob's matches, the rasters of a kept batch's scenes the config
    no longer names, and the run's records of left-out scenes and of batches (``jobs/skipped/``,
    ``jobs/tiles/``: another config of this run rewrites them). None when the checks read what no stat watches
    (``plan.unwatched``)."""
    if plan.unwatched:
        return None
    base = Path(workdir)
    files = [path for path in plan.inputs if os.path.isfile(base / path)]
    kept = [raster for scene in plan.kept.values() for raster in scene.rasters if not is_remote(raster)]
    within = [str(f) for path in plan.inputs if os.path.isdir(base / path) for f in _files_in(Path(path), workdir)]
    beside = [str(Path(path).parent / name) for path in files for name in siblings(base / path)]
    records = [plan.paths.jobs_dir(kind) for kind in (SKIPPED, "tiles")]
    keys = [*plan.inputs, *beside, *(SIBLINGS + path for path in files), *within, *kept, *records]
    listed = raw.get("scenes")
    if isinstance(listed, str):
        keys.append(GLOB + listed if is_glob(listed) else listed)
    return {key: watch_value(key, workdir) for key in dict.fromkeys(keys)}


def _files_in(folder: Path, workdir: str | Path) -> list[Path]:
    """The files under a folder the checks read as one input (a model folder: its config and weights; a folder of
    VOC annotations), as the config names them: a file changed in place changes no folder's mtime."""
    base = Path(workdir)
    return sorted(folder / path.relative_to(base / folder) for path in (base / folder).rglob("*") if path.is_file())


def watch_value(key: str, workdir: str | Path = ".") -> Any:
    """A watched input's version (:func:`watched_inputs`): a file's or folder's [size, mtime_ns] (None when
    absent), a glob's matches (how many, and their hash), a file's sidecar files (their names)."""
    if key.startswith(GLOB):
        matches = sorted(glob.glob(key[len(GLOB) :], recursive=True))
        return [len(matches), hashlib.sha256("\n".join(matches).encode()).hexdigest()]
    if key.startswith(SIBLINGS):
        try:
            return sorted(siblings(Path(workdir) / key[len(SIBLINGS) :]))
        except OSError:
            return None
    stat = file_stat(Path(workdir) / key)
    return list(stat) if stat is not None else None
