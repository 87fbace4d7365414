"""The pages and figures of the Snakemake report (``snakemake --report report.zip``; which file is which and what
the plan hands each job: :mod:`rasterscale.workflow.steps.report`):

- the run's page: the task, the model (and what its file records of its training), the precision each section
  asked for and ran at, the launch geometry, and the validated config;
- a predicted scene's scores (its ``evaluation.json``) with what its merged output holds, and its prediction profile
  (``predict_profile.json``) as HTML tables, and a plot of its ranks' throughput, memory and time;
- the project map: every scene's footprint (from its raster's header) with its merged output's count, in one
  figure.

A page is one self-contained HTML file (the report shows it in a frame); every file is written atomically.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from rasterscale.atomic import atomic_path, save_figure, write_json
from rasterscale.jobs.files import ProjectMapJob, RunPageJob, ScoredScene
from rasterscale.jobs.profile import TABLE_COLUMNS, table_cell
from rasterscale.raster.headers import read_raster_header
from rasterscale.settings import ModelSettings, to_dict
from rasterscale.tasks.spec import TaskSpec
from rasterscale.workflow.steps.report import SCENE_FILES

LISTED_SCENES = 200  # scenes the run's page lists by name; more are counted
LABELLED_FOOTPRINTS = 30  # footprints the project map names; more get their colour only

STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1e293b; margin: 1.2em 1.6em;
       background: #fff; }
h1 { font-size: 1.45em; margin: 0 0 .2em; } h2 { font-size: 1.15em; margin: 1.4em 0 .4em; }
p.lead { color: #475569; margin: 0 0 1em; } p.note { color: #64748b; font-size: .9em; margin: .3em 0; }
table { border-collapse: collapse; margin: .3em 0 .6em; }
th, td { border: 1px solid #cbd5e1; padding: .28em .7em; text-align: left; vertical-align: top; }
th { background: #f1f5f9; font-weight: 600; } td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.total td { font-weight: 600; background: #f8fafc; }
pre { background: #f8fafc; border: 1px solid #e2e8f0; padding: .8em; overflow-x: auto; font-size: .85em; }
code { font-size: .92em; }
"""


# -- HTML -------------------------------------------------------------------------------------------------------


def cell(value: Any) -> str:
    """A value as a table cell's text: floats with 3 decimals (4 significant digits under 0.001), integers with
    thousands separators, None as '-'."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.3f}" if value == 0 or abs(value) >= 0.001 else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(cell(v) for v in value)
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={cell(v)}" for k, v in value.items())
    return str(value)


def _is_number(text: str) -> bool:
    return text.replace(",", "").replace(".", "", 1).replace("%", "").lstrip("-").isdigit()


def table(
    header: Sequence[str] | None, rows: Iterable[Sequence[Any]], total: Sequence[Any] | None = None, align: bool = True
) -> str:
    """An HTML table (no header row when ``header`` is None); cells are :func:`cell` texts (a str is taken as it
    is), escaped, numbers right-aligned when ``align``; ``total`` is a last row in bold."""

    def row(values: Sequence[Any], css: str = "") -> str:
        texts = [value if isinstance(value, str) else cell(value) for value in values]
        cells = "".join(
            f"<td{' class=num' if align and _is_number(text) else ''}>{html.escape(text)}</td>" for text in texts
        )
        return f"<tr{css}>{cells}</tr>"

    body = [row(values) for values in rows]
    if total is not None:
        body.append(row(total, css=' class="total"'))
    head = (
        ""
        if header is None
        else "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr></thead>"
    )
    return f"<table>{head}<tbody>{''.join(body)}</tbody></table>"


def key_values(rows: Iterable[tuple[str, Any]]) -> str:
    """A two-column table of names and values, left-aligned."""
    return table(None, rows, align=False)


def section(heading: str, *parts: str) -> str:
    return f"<h2>{html.escape(heading)}</h2>" + "".join(parts)


def note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def page(title: str, lead: str, *sections: str) -> str:
    """A self-contained page: its title, a line under it, its sections."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f'<h1>{html.escape(title)}</h1><p class="lead">{html.escape(lead)}</p>{"".join(sections)}</body></html>\n'
    )


def write_text(text: str, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


# -- the run's page ---------------------------------------------------------------------------------------------


def _names(names: Sequence[str]) -> str:
    listed = ", ".join(names[:LISTED_SCENES])
    more = f" and {len(names) - LISTED_SCENES} more" if len(names) > LISTED_SCENES else ""
    return f"{len(names)}: {listed}{more}" if names else "none"


def ran_at(profiles: Mapping[str, Mapping[str, Any]]) -> str:
    """The precision(s) the prediction ranks ran at, from the scenes' profiles."""
    found = sorted({str(rank.get("precision")) for p in profiles.values() for rank in p["ranks"]} - {"None"})
    return ", ".join(found) or "-"


GEOMETRY_COLUMNS = [
    "section",
    "accelerator",
    "devices",
    "nodes",
    "ranks per job",
    "jobs (shards)",
    "batch size",
    "workers per rank",
    "threads per job",
]


def overview_rows(
    facts: RunPageJob, model: str, trained: Sequence[str], predicted: Sequence[str]
) -> list[tuple[str, Any]]:
    """The run's page's overview: task, model, classes, model file, training and predicted scenes, tiles."""
    tiling = facts.settings.tiling
    origin = "trained by this run" if facts.trained else "model.file"
    return [
        ("task", facts.settings.task),
        ("model", model),
        ("classes", ", ".join(facts.labels)),
        ("model file", f"{facts.model_file} ({origin})" if facts.model_file else "none"),
        ("training scenes", _names(trained) if facts.trained else "none (no training in this run)"),
        ("predicted scenes", _names(predicted)),
        ("tiles", f"{tiling.patch_size} px, overlap {tiling.overlap} px"),
    ]


def model_rows(model: ModelSettings, meta: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    """The model's keys (but its name) and what its file records of its training (``meta``)."""
    rows = [(key, value) for key, value in to_dict(model).items() if value not in (None, "") and key != "name"]
    if meta:
        rows += [(f"training: {key}", meta[key]) for key in ("steps", "epochs", "seconds") if key in meta]
        rows += [
            (f"training: {key}", value) for key, value in meta.items() if key in ("batch_sizes", "batch_plan")
        ]  # batch_plan: older model files
        validation = {k: v for k, v in (meta.get("validation") or {}).items() if k != "epoch"}
        rows += [(f"last validation: {key}", value) for key, value in validation.items()]
    return rows


def precision_rows(
    facts: RunPageJob, meta: Mapping[str, Any] | None, profiles: Mapping[str, Mapping[str, Any]], predicted: bool
) -> list[tuple[str, Any, Any]]:
    """The precision each section that ran asked for (config) and ran at (the model file's record, the ranks'
    profiles)."""
    train, predict = facts.settings.train, facts.settings.predict
    rows = []
    if facts.trained:
        rows.append(("train", train.precision, (meta or {}).get("precision", "-")))
    if predicted:
        rows.append(("predict", predict.precision, ran_at(profiles)))
    return rows


def geometry_rows(facts: RunPageJob, predicted: bool) -> list[tuple[Any, ...]]:
    """The launch geometry of each section that ran (:data:`GEOMETRY_COLUMNS`)."""
    rows = []
    for name, values in facts.geometry.items():
        if (name == "train" and not facts.trained) or (name == "predict" and not predicted):
            continue
        run = facts.settings.ddp_section(name)
        batch = f"{run.batch_size} " + ("global" if name == "train" else "per rank")
        rows.append(
            (
                name,
                run.accelerator,
                values["devices"],
                values["nodes"],
                values["world_size"],
                values["shards"],
                batch,
                "from cores" if run.workers is None else run.workers,  # unset: each rank's (runtime.cores)
                values["threads"],
            )
        )
    return rows


def run_page(facts: RunPageJob, meta: Mapping[str, Any] | None, profiles: Mapping[str, Mapping[str, Any]]) -> str:
    """The run's page: task and model, what the model file records of its training (``meta``), precision asked
    and used per section, launch geometry, scenes, the validated config."""
    settings = facts.settings
    model, scenes = settings.model, settings.scenes
    trained = settings.train.scenes if facts.trained else ()
    predicted = settings.predict.scenes
    shown = {key: value for key, value in to_dict(settings).items() if key != "scenes"}
    listed = [(name, scene.path, scene.annotations or "-") for name, scene in list(scenes.items())[:LISTED_SCENES]]
    return page(
        f"Run: {facts.settings.task}, model {model.name}",
        f"{len(predicted)} scene(s) predicted, {len(trained)} trained on.",
        section("Overview", key_values(overview_rows(facts, str(model.name), trained, predicted))),
        section("Model", key_values(model_rows(model, meta))),
        section(
            "Precision",
            table(["section", "asked (config)", "ran at"], precision_rows(facts, meta, profiles, bool(predicted))),
            note("auto: each rank picks what its device runs natively; the ranks of a job agree on one value."),
        ),
        section("Launch geometry", table(GEOMETRY_COLUMNS, geometry_rows(facts, bool(predicted)))),
        section(
            "Scenes",
            table(["scene", "raster", "annotations"], listed),
            note(_names(list(scenes))) if len(scenes) > LISTED_SCENES else "",
        ),
        skipped_section(facts.skipped),
        section("Config (validated, scenes listed above)", f"<pre>{html.escape(yaml.safe_dump(shown))}</pre>"),
    )


def skipped_section(skipped: Mapping[str, str]) -> str:
    """The scenes left out of the run (scenes_on_error: skip), each with why; nothing when none was."""
    if not skipped:
        return ""
    return section(
        f"Skipped scenes ({len(skipped)})",
        table(["scene", "why"], list(skipped.items())),
        note("scenes_on_error: skip left them out of the plan; fix them and run again to add them."),
    )


# -- a scene's pages --------------------------------------------------------------------------------------------


def metrics_tables(metrics: Mapping[str, Any]) -> str:
    """An evaluation's scores as tables: its single values, each mapping (a value per class), and a confusion
    matrix (with ``labels``) as a matrix, rows the truth."""
    scalars = [(key, value) for key, value in metrics.items() if not isinstance(value, (Mapping, list))]
    parts = [key_values(scalars)]
    for key, value in metrics.items():
        if isinstance(value, Mapping):
            parts.append(f"<h3>{html.escape(key)}</h3>" + table(["class", key], list(value.items())))
    labels = [str(label) for label in metrics.get("labels", [])]
    confusion = metrics.get("confusion")
    if confusion is not None and len(confusion) == len(labels):
        rows = [(f"true {label}", *counts) for label, counts in zip(labels, confusion, strict=True)]
        parts.append("<h3>confusion (pixels)</h3>" + table(["", *(f"predicted {label}" for label in labels)], rows))
    return "".join(parts)


def scores_page(
    scene: str, metrics: Mapping[str, Any] | None, summary: str, counts: Mapping[str, int], unit: str
) -> str:
    """A scene's page of scores (its evaluation's, when it has one) and of what its merged output holds."""
    if metrics is None:
        scores = section("Scores", note("Not scored: the scene has no annotations (scenes.<name>.annotations)."))
    else:
        scores = section("Scores", f"<p><code>{html.escape(summary)}</code></p>", metrics_tables(metrics))
    total = sum(counts.values())
    held = section(
        "Merged output", table(["class", unit], list(counts.items()), total=("all", total) if counts else None)
    )
    return page(f"Scene {scene}: scores", f"{total:,} {unit} in the merged output.", scores, held)


PROFILE_DETAILS = [
    ("rank", "rank", "{}"),
    ("shard", "shard", "{}"),
    ("host", "host", "{}"),
    ("precision", "precision", "{}"),
    ("batch size", "batch_size", "{}"),
    ("workers", "workers", "{}"),
    ("threads", "threads", "{}"),
    ("compute s", "compute_s", "{:.2f}"),
    ("output s", "output_s", "{:.2f}"),
    ("data wait s", "wait_s", "{:.2f}"),
    ("workers rss peak MB", "workers_rss_peak_mb", "{:.0f}"),
    ("memory total MB", "memory_total_mb", "{:.0f}"),
]


def profile_page(scene: str, profile: Mapping[str, Any]) -> str:
    """A scene's prediction profile: a row per rank (the columns of the end-of-run table), the totals, and where
    and how each rank ran."""
    ranks, total = profile["ranks"], profile["total"]
    header = [name for name, _, _ in TABLE_COLUMNS]
    rows = [[table_cell(rank, key, fmt) for _, key, fmt in TABLE_COLUMNS] for rank in ranks]
    totals = {**total, "rank": "all", "device": "", "strategy": ""}
    kinds = ", ".join(sorted({str(rank["memory_kind"]) for rank in ranks})) or "-"
    sources = ", ".join(sorted({str(rank["utilization_source"]) for rank in ranks})) or "-"
    details = [[table_cell(rank, key, fmt) for _, key, fmt in PROFILE_DETAILS] for rank in ranks]
    return page(
        f"Scene {scene}: prediction profile",
        f"{total['ranks']} rank(s), {total['tiles']:,} tiles, {total['tiles_per_s']:.2f} tiles/s, "
        f"wall {total['wall_s']:.1f} s.",
        section(
            "Ranks",
            table(header, rows, total=[table_cell(totals, key, fmt) for _, key, fmt in TABLE_COLUMNS]),
            note(
                f"memory: {kinds} (cuda_allocated: torch's peak per batch on the GPU; host_rss: the rank's resident "
                f"set after each batch); utilization: {sources}. tiles/s and batches/s add up over ranks; wall is "
                "the longest rank's."
            ),
        ),
        section("Where and how", table([name for name, _, _ in PROFILE_DETAILS], details)),
    )


def plot_profile(scene: str, profile: Mapping[str, Any], png: str | Path) -> None:
    """A scene's ranks side by side: tiles/s, memory (peak and mean of the device, the process's peak resident
    set) and where each rank's wall went (compute, output, data wait)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks, total = profile["ranks"], profile["total"]
    x = np.arange(len(ranks))
    names = [str(rank["rank"]) for rank in ranks]
    width = max(12.0, 0.35 * len(ranks) * 3)
    fig, (ax_speed, ax_memory, ax_time) = plt.subplots(1, 3, figsize=(width, 4.4))
    ax_speed.bar(x, [rank["tiles_per_s"] for rank in ranks], color="#2563eb")
    ax_speed.set_title("throughput")
    ax_speed.set_ylabel("tiles/s")
    kinds = {"cuda_allocated": "GPU, allocated", "host_rss": "resident set"}
    kind = ", ".join(sorted({kinds.get(str(rank["memory_kind"]), str(rank["memory_kind"])) for rank in ranks}))
    bar = 0.27
    ax_memory.bar(x - bar, [rank["memory_peak_mb"] for rank in ranks], bar, label="peak", color="#dc2626")
    ax_memory.bar(x, [rank["memory_mean_mb"] for rank in ranks], bar, label="mean", color="#f59e0b")
    ax_memory.bar(x + bar, [rank["host_rss_peak_mb"] for rank in ranks], bar, label="process peak", color="#64748b")
    ax_memory.set_title("memory")
    ax_memory.set_ylabel(f"MB ({kind})")
    legend = {"fontsize": 9, "loc": "upper center", "ncol": 3, "frameon": False}
    ax_memory.legend(**legend)
    bottom = np.zeros(len(ranks))
    for key, label, colour in (
        ("compute_s", "compute", "#16a34a"),
        ("output_s", "output", "#9333ea"),
        ("wait_s", "data wait", "#f97316"),
    ):
        values = np.array([float(rank.get(key, 0.0)) for rank in ranks])
        ax_time.bar(x, values, bottom=bottom, label=label, color=colour)
        bottom += values
    ax_time.set_title("wall time")
    ax_time.set_ylabel("s")
    ax_time.legend(**legend)
    for ax in (ax_speed, ax_memory, ax_time):
        ax.set_ylim(0, ax.get_ylim()[1] * (1.25 if ax is not ax_speed else 1.05))  # room for the legends
        ax.set_xticks(x, names)
        ax.set_xlabel("rank")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"{scene}: {total['ranks']} rank(s), {total['tiles']:,} tiles, {total['tiles_per_s']:.2f} tiles/s, "
        f"wall {total['wall_s']:.1f} s"
    )
    save_figure(fig, png, dpi=100)


def render_scene(scored: ScoredScene, labels: Sequence[str], task_spec: TaskSpec) -> dict[str, int]:
    """Write a scene's renderings (its ``pages`` by the keys of :data:`SCENE_FILES`): its counts (JSON, what the
    project map reads), scores and profile pages, the profile's plot. Returns the counts."""
    outputs = scored.pages
    if set(outputs) != set(SCENE_FILES):
        raise ValueError(f"a scene's renderings are {sorted(SCENE_FILES)}, not {sorted(outputs)}")
    scene = scored.scene
    counts = task_spec.counts(scene, list(labels))
    write_json({"unit": task_spec.count_unit, "counts": counts, "total": sum(counts.values())}, outputs["counts"])
    metrics = read_json(scored.evaluation) if scored.evaluation else None
    summary = task_spec.summarize(metrics) if metrics is not None else ""
    write_text(scores_page(scene.name, metrics, summary, counts, task_spec.count_unit), outputs["scores"])
    profile = read_json(scene.outputs["profile"])
    write_text(profile_page(scene.name, profile), outputs["profile"])
    plot_profile(scene.name, profile, outputs["plot"])
    return counts


# -- the project map --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MapOutline:
    """A scene on the project map: its outline (x, y in the map's CRS), roles, and merged output's total count
    (None: not predicted)."""

    name: str
    outline: np.ndarray
    roles: tuple[str, ...]
    count: int | None


def raster_outline(path: str | Path, points_per_edge: int = 16) -> tuple[Any, np.ndarray]:
    """A raster's CRS and its outline from its header: the pixel grid's edges, ``points_per_edge`` points each
    (they stay true edges after a reprojection), in the raster's CRS, (N, 2)."""
    info = read_raster_header(path)
    t = np.linspace(0.0, 1.0, points_per_edge, endpoint=False)
    w, h = float(info.width), float(info.height)
    cols = np.concatenate([t * w, np.full_like(t, w), w - t * w, np.zeros_like(t)])
    rows = np.concatenate([np.zeros_like(t), t * h, np.full_like(t, h), h - t * h])
    a, b, c, d, e, f = (info.transform[k] for k in range(6))
    xs, ys = a * cols + b * rows + c, d * cols + e * rows + f
    return info.crs, np.column_stack([xs, ys])


def map_outlines(job: ProjectMapJob) -> tuple[Any, list[MapOutline]]:
    """The scenes' outlines in one CRS (theirs when they share one, else longitude/latitude) with their counts."""
    from rasterio.crs import CRS
    from rasterio.warp import transform

    outlines = [(scene, *raster_outline(scene["raster"])) for scene in job.scenes]
    crss = {crs.to_wkt() for _, crs, _ in outlines}
    target = outlines[0][1] if len(crss) == 1 else CRS.from_epsg(4326)
    footprints = []
    for scene, crs, outline in outlines:
        if crs != target:
            xs, ys = transform(crs, target, outline[:, 0], outline[:, 1])
            outline = np.column_stack([xs, ys])
        count = int(read_json(scene["counts"])["total"]) if scene["counts"] else None
        footprints.append(MapOutline(scene["name"], outline, tuple(scene["roles"]), count))
    return target, footprints


def plot_project_map(crs: Any, footprints: Sequence[MapOutline], unit: str, png: str | Path) -> None:
    """The scenes' footprints in one figure: a predicted scene filled by its count, a scene only trained on outlined,
    dashed; a marker at each footprint's centre (a footprint may be too small to see at the map's scale), and up to
    :data:`LABELLED_FOOTPRINTS` scenes named beside it with their count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize
    from matplotlib.patches import Polygon

    counts = [f.count for f in footprints if f.count is not None]
    norm = Normalize(0, max(max(counts, default=0), 1))
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(10, 8))
    labels = []
    for footprint in footprints:
        outline, centre = footprint.outline, footprint.outline.mean(axis=0)
        trained = "train" in footprint.roles
        if footprint.count is not None:
            colour = cmap(norm(footprint.count))
            ax.add_patch(Polygon(outline, closed=True, facecolor=colour, alpha=0.55, lw=1.2, edgecolor="black"))
            ax.scatter([centre[0]], [centre[1]], s=60, color=colour, edgecolors="black", zorder=3)
            text = f"{footprint.name}\n{footprint.count:,} {unit}" + ("\n(also trained on)" if trained else "")
            labels.append((centre, text, "black"))
        if trained:
            ax.add_patch(Polygon(outline, closed=True, fill=False, lw=1.6, ls="--", edgecolor=TRAINED))
            if footprint.count is None:
                ax.scatter([centre[0]], [centre[1]], s=60, marker="x", color=TRAINED, zorder=3)
                labels.append((centre, f"{footprint.name}\n(trained on)", TRAINED))
    every = np.concatenate([f.outline for f in footprints])
    (x0, y0), (x1, y1) = every.min(axis=0), every.max(axis=0)
    pad = 0.08 * max(x1 - x0, y1 - y0, 1e-9)
    ax.set_xlim(x0 - pad, x1 + pad)
    ax.set_ylim(y0 - pad, y1 + pad)
    ax.set_aspect("equal")
    ax.ticklabel_format(useOffset=False, style="plain")
    ax.tick_params(axis="x", labelrotation=30)
    geographic = crs.is_geographic
    units = "" if geographic else f" ({crs.linear_units})"
    ax.set_xlabel(("longitude" if geographic else "x") + units)
    ax.set_ylabel(("latitude" if geographic else "y") + units)
    ax.grid(alpha=0.3)
    if len(counts) > 1:
        bar = fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, shrink=0.8)
        bar.set_label(f"{unit} in the merged output")
    predicted = sum(f.count is not None for f in footprints)
    trained_on = sum("train" in f.roles for f in footprints)
    ax.set_title(
        f"{len(footprints)} scene(s) in {crs.to_string() or 'their CRS'}: {predicted} predicted "
        f"({sum(counts):,} {unit}), {trained_on} trained on (dashed)",
        fontsize=12,
    )
    if len(labels) <= LABELLED_FOOTPRINTS:
        fig.tight_layout()
        place_labels(fig, ax, labels)
    save_figure(fig, png, dpi=100)


TRAINED = "#b91c1c"  # the colour of the scenes trained on
LABEL_OFFSETS = [(9, 9, "left", "bottom"), (9, -9, "left", "top"), (-9, 9, "right", "bottom"), (-9, -9, "right", "top")]
LABEL_OFFSETS += [(0, 14, "center", "bottom"), (0, -14, "center", "top"), (24, 0, "left", "center")]


def place_labels(fig: Any, ax: Any, labels: Sequence[tuple[np.ndarray, str, str]]) -> None:
    """Name each point beside it, at the first of :data:`LABEL_OFFSETS` where the label covers no point and no label
    placed before, and stays inside the axes (else at the first offset)."""
    from matplotlib.transforms import Bbox

    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    marker = 7  # display pixels around a point that a label leaves free
    placed: list[Any] = [
        Bbox.from_extents(x - marker, y - marker, x + marker, y + marker)
        for x, y in ax.transData.transform(np.array([point for point, _, _ in labels]).reshape(-1, 2))
    ]
    style = {"textcoords": "offset points", "fontsize": 10, "zorder": 4}
    box = {"boxstyle": "round,pad=0.25", "facecolor": "white", "alpha": 0.85, "edgecolor": "none"}
    for point, text, colour in labels:
        chosen = None
        for dx, dy, ha, va in LABEL_OFFSETS:
            label = ax.annotate(text, point, xytext=(dx, dy), ha=ha, va=va, color=colour, bbox=box, **style)
            extent = label.get_window_extent(renderer)
            inside = frame.x0 <= extent.x0 and extent.x1 <= frame.x1 and frame.y0 <= extent.y0 and extent.y1 <= frame.y1
            if inside and not any(extent.overlaps(other) for other in placed):
                chosen = extent
                break
            label.remove()
        if chosen is None:
            dx, dy, ha, va = LABEL_OFFSETS[0]
            label = ax.annotate(text, point, xytext=(dx, dy), ha=ha, va=va, color=colour, bbox=box, **style)
            chosen = label.get_window_extent(renderer)
        placed.append(chosen)


MAP_PIXELS = 1000  # the summary raster is read decimated to at most this many pixels a side
OUTLINED_SCENES = 500  # scenes outlined over the summary raster, at most (each outline reads a header)


def read_summary(path: str | Path, bands: int = 4) -> tuple[Any, np.ma.MaskedArray, tuple[float, ...], list[str]]:
    """A summary raster's CRS, first ``bands`` bands decimated to :data:`MAP_PIXELS` (its overviews), extent
    (left, right, bottom, top) and band names."""
    import rasterio

    with rasterio.open(path) as src:
        step = max(1, -(-max(src.width, src.height) // MAP_PIXELS))
        count = min(bands, src.count)
        shape = (count, max(1, src.height // step), max(1, src.width // step))
        data = src.read(list(range(1, count + 1)), out_shape=shape, masked=True)
        names = [src.descriptions[i] or f"band {i + 1}" for i in range(count)]
        extent = (src.bounds.left, src.bounds.right, src.bounds.bottom, src.bounds.top)
        return src.crs, data, extent, names


def plot_summary_map(summary: str | Path, crs: Any, footprints: Sequence[MapOutline], png: str | Path) -> None:
    """The project's summary raster (objects per hectare, class cover or mean value a cell; up to 4 bands side
    by side), the scenes outlined over it when the map's CRS is the raster's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Polygon

    raster_crs, data, extent, names = read_summary(summary)
    fig, axes = plt.subplots(1, len(names), figsize=(10 * len(names) ** 0.5, 8), squeeze=False)
    for ax, band, name in zip(axes[0], data, names, strict=True):
        image = ax.imshow(band, extent=extent, cmap="viridis", interpolation="nearest")
        fig.colorbar(image, ax=ax, shrink=0.8).set_label(name)
        if crs == raster_crs:
            for footprint in footprints:
                ax.add_patch(Polygon(footprint.outline, closed=True, fill=False, lw=0.6, edgecolor="white"))
        ax.set_aspect("equal")
        ax.ticklabel_format(useOffset=False, style="plain")
        ax.tick_params(axis="x", labelrotation=30)
        ax.set_title(name)
    cell = abs(extent[1] - extent[0]) / max(data.shape[2], 1)
    fig.suptitle(f"project summary ({raster_crs.to_string()}, cells of {cell:g} on this map)", fontsize=12)
    fig.tight_layout()
    save_figure(fig, png, dpi=100)


def render_project_map(job: ProjectMapJob, unit: str, png: str | Path) -> None:
    """The project's summary raster (a run of several scenes), else the scenes' footprints and counts."""
    if job.summary:
        crs, footprints = map_outlines(job) if len(job.scenes) <= OUTLINED_SCENES else (None, [])
        plot_summary_map(job.summary, crs, footprints, png)
        return
    crs, footprints = map_outlines(job)
    plot_project_map(crs, footprints, unit, png)
