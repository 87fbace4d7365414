"""Outputs in a bucket through Snakemake's own default storage: ``--default-storage-provider s3
--default-storage-prefix s3://bucket/run --keep-storage-local-copies`` (or the same keys in a profile).

Snakemake maps every declared file to a storage object ``{prefix}/{path}`` with a local copy at
``{local-storage-prefix}/{provider}/{bucket}/{prefix}/{path}`` (``.snakemake/storage/s3/bucket/run/...``), hands
the jobs those local copies, uploads each job's outputs as it ends and judges what to run from the objects in the
bucket. rasterscale's jobs read and write the paths their job files name (``results/...``, written by the plan
before the DAG), so the working directory becomes that local mirror (:func:`mirror_working_directory`): the local
copy of ``results/x`` is ``results/x`` itself, and Snakemake's uploads and retrievals go through it.

What goes to the bucket (:func:`in_bucket`): everything under ``results/`` the rules declare (the scenes' and the
project's layers, manifests, the prediction's rank files, the batches' records, models, scores, report pages).
What stays local: the job files (the plan's, under a ``jobs/`` folder) and every file outside ``results/``: the
config's own files (rasters, annotations and models given by path), ``logs/``, ``benchmarks/``, ``.snakemake/``
(the stored plans, the header cache, Snakemake's metadata) and the prediction's rank scratch (``*.resume``, no
declared file). The local copies are kept (``--keep-storage-local-copies``, required): the plan reads the batches'
records and the jobs read the files a record stands for from the working directory, which Snakemake would empty
otherwise (docs/data.md, "Object storage").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rasterscale.errors import ConfigError
from rasterscale.jobs.paths import RESULTS, check_job
from rasterscale.raster.s3 import s3_environment

JOBS = "jobs"  # the folder name of the plan's job files, wherever they are (results/{run}/jobs/, {demo}/jobs/)


def check_default_storage(provider: str | None, prefix: str | None, keep_local: bool) -> bool:
    """Whether the run's outputs go to Snakemake's default storage; one line that says what to add when the
    combination cannot work."""
    if provider is None:
        return False
    where = f"--default-storage-provider {provider}" + (f" --default-storage-prefix {prefix}" if prefix else "")
    if not prefix:
        raise ConfigError(
            f"{where}: give the bucket and folder the outputs go to as well (--default-storage-prefix "
            "s3://bucket/run, or default-storage-prefix: in the profile)"
        )
    if not keep_local:
        raise ConfigError(
            f"{where}: add --keep-storage-local-copies (or keep-storage-local-copies: true in the profile): the "
            "working directory is the bucket's local mirror, whose files the plan and the jobs read (docs/data.md, "
            '"Object storage")'
        )
    return True


def in_bucket(path: str) -> bool:
    """Whether Snakemake's default storage takes this declared file: a relative path under ``results/`` that is no
    job file of the plan's (those are written before the DAG and stay local, as everything else does)."""
    normal = os.path.normpath(path)
    parts = normal.split(os.sep)
    return parts[0] == RESULTS and len(parts) > 1 and JOBS not in parts[1:-1] and normal != check_job()


def route_declared_files(path_modifier: Any) -> None:
    """Let Snakemake's default storage take only the files :func:`in_bucket` names: its path modifier
    (``workflow.modifier.path_modifier``, which applies the default storage to every declared file and target not
    flagged ``local()``) passes every other path through unchanged, as ``local()`` would."""
    apply: Callable[[Any], Any] = path_modifier.apply_default_storage
    if getattr(apply, "routes_declared_files", False):
        return

    def apply_to_results(path: Any) -> Any:
        return apply(path) if in_bucket(str(path)) else path

    apply_to_results.routes_declared_files = True  # type: ignore[attr-defined]
    path_modifier.apply_default_storage = apply_to_results


def mirror_working_directory(local_prefix: str | Path, workdir: str | Path = ".") -> None:
    """Make Snakemake's local copy of the storage prefix (``local_prefix``, e.g. ``.snakemake/storage/s3/bucket/run``)
    a link to the working directory, so that the local copy of ``results/x`` is ``results/x``. Kept where it is one
    already; a folder there (local copies of an earlier run, made without this link) is refused in one line."""
    link = Path(local_prefix)
    target = os.path.relpath(Path(workdir).resolve(), link.parent.resolve())
    if link.is_symlink():
        if os.readlink(link) == target:
            return
        link.unlink()
    elif link.exists():
        raise ConfigError(
            f"{link}: Snakemake's local copies of the storage prefix are a folder; remove it (the objects stay in "
            "the bucket): rasterscale links it to the working directory"
        )
    link.parent.mkdir(parents=True, exist_ok=True)
    temporary = link.with_name(f".{link.name}.{os.getpid()}.link")
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(target, target_is_directory=True)
    os.replace(temporary, link)  # atomic: a job's re-parse sees the old link or the new one


# the variables of the s3 section (rasterscale.raster.s3.s3_environment) that boto3, and so the storage plugin, reads
PLUGIN_READS = {"AWS_ENDPOINT_URL_S3": "endpoint", "AWS_PROFILE": "profile", "AWS_DEFAULT_REGION": "region"}


def check_plugin_environment(
    section: Mapping[str, Any], started_with: Mapping[str, str], provider: str, plugin_settings: Any
) -> None:
    """Snakemake's S3 storage plugin, which writes the outputs, makes its boto3 client when Snakemake starts, before
    the config is read: the ``s3`` section's keys (``section``) reach it only where the environment Snakemake
    started in (``started_with``) already held them, or for the endpoint its own ``--storage-s3-endpoint-url``
    (the ``endpoint_url`` of its ``plugin_settings``). Otherwise the outputs would go to another S3 service,
    profile or region than the one the inputs are read from: one line that says how to give it. A ``provider``
    other than ``s3`` passes. (The jobs Snakemake submits inherit the config's environment: only the main process
    needs this.)"""
    if provider != "s3":
        return
    plugin_endpoint = getattr(plugin_settings, "endpoint_url", None)
    for variable, value in s3_environment(section).items():
        key = PLUGIN_READS.get(variable)
        if key is None or started_with.get(variable) == value:
            continue
        if key == "endpoint" and (plugin_endpoint or "").rstrip("/") == value:
            continue
        also = f" (or --storage-s3-endpoint-url {value})" if key == "endpoint" else ""
        raise ConfigError(
            f"key 's3.{key}': Snakemake's S3 storage plugin, which writes the outputs to the bucket, starts before "
            f"the config is read and does not see it: set {variable}={value} in the environment snakemake starts "
            f"in{also}"
        )
