"""Rasters where they live and scenes from STAC, over real servers on loopback: an HTTP server with Range support
(RangeHTTPServer's handler) and an S3 server (moto's), counting the bytes they serve.

A scene's path may be an http(s) URL, an s3:// URI or a GDAL /vsi path of a COG: the dry run checks its header from
a few KB, Snakemake never waits for it as a file, prediction reads it window by window and gives the same layer as
over a local copy, a server that stops mid-prediction fails the job with one line naming the URL (redacted) and the
rerun resumes from the finished tiles. A scene may also come from a STAC Item's asset, or one per item of the
``stac`` section's Items and ItemCollections."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import geopandas as gpd
import numpy as np
import pystac
import pytest
import rasterio
import yaml
from affine import Affine
from shapely.geometry import box

import snakemake_forks
from conftest import report, write_raster
from prediction import PredictScene
from rasterscale.config.objects import fetch_whole_files
from rasterscale.config.schema import validate_config
from rasterscale.errors import ConfigError, InputError, RasterReadError, redact
from rasterscale.jobs.paths import RunPaths, check_job
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import ImageSpec, ProcessRaster, read_tile
from rasterscale.raster.remote import file_name, gdal_path, is_remote, shown
from rasterscale.tasks.exported.card import card_path
from rasterscale.workflow import default_storage
from rasterscale.workflow.checks import build_plan
from rasterscale.workflow.reuse import main_plan
from remote_servers import RangeServer, S3Server
from workflow import rank_stems, run_workflow, workflow_command

SECRET = "s3cr3t-token"  # a signed URL's signature: never in a log or an error
TRANSFORM = Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)
RUN = RunPaths("model")  # the run of the site's model.pt, given as model.file without model.name: the file's stem


def write_cog(path: Path, width: int, height: int, seed: int = 5) -> Path:
    """A Cloud Optimized GeoTIFF (GDAL's COG driver: 128 px blocks, deflate, overviews) of random 16-bit RGB,
    incompressible: its size is its pixels' (two bytes each: a small raster whose blocks, not its header, are most of
    its bytes)."""
    from rasterio.shutil import copy as copy_raster

    data = np.random.default_rng(seed).integers(0, 65535, size=(3, height, width), dtype=np.uint16)
    plain = write_raster(path.with_suffix(".plain.tif"), width, height, data=data)
    copy_raster(plain, path, driver="COG", blocksize=128, compress="DEFLATE")
    plain.unlink()
    return path


def stac_item(item_id: str, href: str, asset: str = "visual") -> dict:
    """A STAC Item (pystac's) with one raster asset and a thumbnail."""
    bbox = [-81.99, 29.69, -81.98, 29.70]
    corners = [[bbox[0], bbox[1]], [bbox[2], bbox[1]], [bbox[2], bbox[3]], [bbox[0], bbox[3]], [bbox[0], bbox[1]]]
    when = datetime.datetime(2024, 5, 1, tzinfo=datetime.UTC)
    item = pystac.Item(item_id, {"type": "Polygon", "coordinates": [corners]}, bbox, when, {})
    item.add_asset(asset, pystac.Asset(href, media_type=pystac.MediaType.COG, roles=["visual"]))
    item.add_asset("thumbnail", pystac.Asset("thumb.png", media_type=pystac.MediaType.PNG, roles=["thumbnail"]))
    return item.to_dict(include_self_link=False)


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


@dataclass
class Site:
    """The servers, what they serve and an untrained detector to predict with."""

    root: Path
    cog: Path  # the local copy every remote scene serves
    http: RangeServer
    s3: S3Server
    model: PredictScene

    @property
    def size(self) -> int:
        return self.cog.stat().st_size

    def web_url(self) -> str:
        return self.http.url("a.tif", f"sv=2024-05-04&sig={SECRET}")

    def fetched(self, path: str) -> int:
        return self.s3.fetched(path) if path.startswith(f"/{BUCKET}/") else self.http.counter.bytes.get(path, 0)

    def reset(self) -> None:
        self.http.counter.reset()
        self.s3.reset()

    @property
    def secrets(self) -> tuple[str, ...]:
        """What no log, output or message may show: the signed URL's signature, the S3 user's keys."""
        return SECRET, self.s3.secret_key, self.s3.key_id


BUCKET = "scenes"
OUTPUTS = "outputs"  # the bucket of the whole S3 run's outputs (s3_run), on Snakemake's default storage
STORAGE = ("--default-storage-provider", "s3", "--default-storage-prefix", f"s3://{OUTPUTS}/run")
KEEP = "--keep-storage-local-copies"
# the bucket's objects: the COG, the same COG where the user may not read it, a STAC ItemCollection whose items' hrefs
# are s3:// (one absolute, one relative to the collection), the model file, annotations, and a small COG east of the
# first (a second scene: the project's layer)
IN_BUCKET = {
    "ortho/a.tif": "cog",
    "private/a.tif": "cog",
    "stac/collection.json": "collection",
    "models/model.pt": "model",
    "truth/a.gpkg": "annotations",
    "ortho/b.tif": "beside",
}


def write_bucket_files(root: Path, cog: Path, model: Path) -> dict[str, Path]:
    """The local files the bucket's objects are (:data:`IN_BUCKET`)."""
    from rasterio.shutil import copy as copy_raster

    east = Affine(0.1, 0, 404051.2, 0, -0.1, 3285000.0)
    (root / "bucket").mkdir(parents=True, exist_ok=True)
    plain = write_raster(
        root / "bucket/b.plain.tif", 256, 128, transform=east, data=np.full((3, 128, 256), 900, "uint16")
    )
    copy_raster(plain, root / "bucket/b.tif", driver="COG", blocksize=128, compress="DEFLATE")
    items = [stac_item("b.1", f"s3://{BUCKET}/ortho/a.tif"), stac_item("b.2", "../ortho/a.tif")]
    collection = write_json(root / "bucket/collection.json", pystac.ItemCollection(items).to_dict())
    boxes = gpd.GeoDataFrame(
        {"label": ["tree", "tree"]},
        geometry=[box(404001.0, 3284980.0, 404003.0, 3284982.0), box(404010.0, 3284990.0, 404012.5, 3284992.0)],
        crs="EPSG:32617",
    )
    annotations = root / "bucket/a.gpkg"
    boxes.to_file(annotations)
    return {"cog": cog, "collection": collection, "model": model, "annotations": annotations,
            "beside": root / "bucket/b.tif"}  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory, s3_server):
    """A 512 x 256 px 16-bit COG over HTTP (as a.tif, and as stac/item.tif, stac/c1.tif, stac/c2.tif behind the STAC
    items stac/item.json and collection.json) and on S3 (s3://scenes/ortho/a.tif, with the objects of
    :data:`IN_BUCKET`), on the session's S3 server, whose user's keys are a named profile of a credentials file."""
    root = tmp_path_factory.mktemp("remote")
    www = root / "www"
    (www / "stac").mkdir(parents=True)
    cog = write_cog(www / "a.tif", 512, 256)
    for name in ("item.tif", "c1.tif", "c2.tif"):
        shutil.copy(cog, www / "stac" / name)
    http = RangeServer(www).start()
    model = PredictScene.make(root / "model", 128, 128)  # an untrained RetinaNet at score threshold 0
    s3 = s3_server
    s3.create_bucket(BUCKET)
    s3.create_bucket(OUTPUTS)
    files = write_bucket_files(root, cog, model.model_file)
    for key, what in IN_BUCKET.items():
        s3.upload(files[what], BUCKET, key)
    write_json(www / "stac/item.json", stac_item("item-1", f"item.tif?sig={SECRET}"))  # relative, signed
    collection = [stac_item("c.1", http.url("stac/c1.tif")), stac_item("c.2", http.url("stac/c2.tif"))]
    write_json(root / "collection.json", pystac.ItemCollection(collection).to_dict())
    credentials, profiles = root / "aws/credentials", root / "aws/config"
    credentials.parent.mkdir()
    credentials.write_text(
        f"[rasterscale-test]\naws_access_key_id = {s3.key_id}\naws_secret_access_key = {s3.secret_key}\n"
    )
    profiles.write_text("[profile rasterscale-test]\nregion = us-east-1\n")
    with pytest.MonkeyPatch.context() as patch:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_NO_SIGN_REQUEST"):
            patch.delenv(key, raising=False)
        environment = {
            **s3.environment(),
            "AWS_PROFILE": "rasterscale-test",
            "CPL_AWS_CREDENTIALS_FILE": str(credentials),  # GDAL's name for AWS_SHARED_CREDENTIALS_FILE
            "AWS_CONFIG_FILE": str(profiles),
            "AWS_SHARED_CREDENTIALS_FILE": str(credentials),  # boto3's
            "HOME": str(root),  # no ~/.aws of the machine's
        }
        for key, value in environment.items():
            patch.setenv(key, value)
        s3.reset()
        yield Site(root, cog, http, s3, model)
    http.stop()


def predict_config(site: Site, scenes: dict | str, **extra) -> dict:
    """One CPU rank reading its tiles itself (no dataloader worker: one header fetch less a scene), a tile a batch
    (scenes predict alike whatever the batch's other scenes), saved after each. The scenes are one raster served
    several ways, all in one place: no seams between them (their mosaics would read each raster again)."""
    predict = {"scenes": "all", "accelerator": "cpu", "devices": 1, "workers": 0, "batch_size": 1,
               "save_every": 0}  # fmt: skip
    return {
        "scenes": scenes,
        "model": {"backbone": "resnet18", "file": str(site.model.model_file), "score_threshold": 0.0},
        "tiling": {"patch_size": site.model.patch_size, "overlap": site.model.overlap},
        "predict": predict,
        "project": {"seams": False},
        **extra,
    }


def all_scenes(site: Site) -> tuple[dict, dict]:
    """The same COG as a local file, over HTTP (a signed URL), on S3, as a STAC item's asset (a relative, signed
    href), and per item of a local ItemCollection (absolute hrefs)."""
    scale = {"min": 0, "max": 65535}  # 16-bit bands to uint8
    scenes = {
        "local": {"path": str(site.cog), "scale": scale},
        "web": {"path": site.web_url(), "scale": scale},
        "bucket": {"path": f"s3://{BUCKET}/ortho/a.tif", "scale": scale},
        "item": {"stac": site.http.url("stac/item.json"), "asset": "visual", "scale": scale},
    }
    return scenes, {"items": [str(site.root / "collection.json")], "asset": "visual", "scale": scale}


def files_text(*folders: Path) -> str:
    """The text of every file under ``folders`` (:func:`every_file_text`) in one string."""
    return "\n".join(text for folder in folders for _, text in every_file_text(folder))


# ---------------------------------------------------------------------------------------------------------
# Paths, redaction
# ---------------------------------------------------------------------------------------------------------


def test_urls_map_to_gdal_paths_and_are_shown_redacted():
    assert gdal_path("s3://bucket/a/b.tif") == "/vsis3/bucket/a/b.tif"
    assert gdal_path("https://h.org/a.tif?x=1") == "/vsicurl/https://h.org/a.tif?x=1"
    assert gdal_path("/vsigs/b/a.tif") == "/vsigs/b/a.tif" and gdal_path("rasters/a.tif") == "rasters/a.tif"
    assert [is_remote(p) for p in ("s3://b/k", "http://h/a", "/vsicurl/x", "rasters/a.tif", Path("s3:/x"))] == [
        True, True, True, False, False,
    ]  # fmt: skip
    assert shown("/vsicurl/https://u:pw@h.org/a.tif?sig=abc&se=1") == "https://***@h.org/a.tif?sig=***&se=***"
    assert shown("/vsis3/bucket/a.tif") == "s3://bucket/a.tif"
    assert file_name("https://h.org/x/a.tif?sig=abc") == "a.tif" and file_name("rasters/b.tif") == "b.tif"
    error = InputError(f"GDAL: /vsicurl/http://h/a.tif?X-Amz-Signature={SECRET}: HTTP 403")
    assert SECRET not in str(error) and "X-Amz-Signature=***: HTTP 403" in str(error)
    assert redact(redact(str(error))) == str(error)


# ---------------------------------------------------------------------------------------------------------
# Headers and windows, in this process
# ---------------------------------------------------------------------------------------------------------


def test_header_checks_fetch_a_few_kb_and_windows_their_blocks(site):
    site.reset()
    local = check_raster(site.cog)
    for kind, url, path in (
        ("http", site.web_url(), "/a.tif"),
        ("s3", "s3://scenes/ortho/a.tif", "/scenes/ortho/a.tif"),
    ):
        info = check_raster(url)
        assert (info.width, info.height, info.block_shapes, info.transform) == (512, 256, local.block_shapes,
                                                                                local.transform)  # fmt: skip
        assert info.path == url  # as given, not GDAL's /vsi name
        header = site.fetched(path)
        assert 0 < header <= 64 * 1024 < site.size
        spec = ImageSpec(low=(0.0, 0.0, 0.0), high=(65535.0, 65535.0, 65535.0), scale="declared")
        remote, here = ProcessRaster(url), ProcessRaster(site.cog)
        window = rasterio.windows.Window(200, 100, 128, 128)  # 4 blocks of 128 px
        assert np.array_equal(read_tile(remote.src, spec, window), read_tile(here.src, spec, window))
        window_bytes = site.fetched(path) - header
        assert 0 < window_bytes < site.size / 2
        report(
            f"remote header and window ({kind}): header check fetched "
            f"{header} of {site.size} bytes; a 128 px window over 4 blocks {window_bytes} bytes"
        )


CHILD = """
import json, os, sys
from rasterscale.config.objects import fetch_whole_files
from rasterscale.config.schema import validate_config
from rasterscale.errors import InputError, ConfigError
from rasterscale.raster.headers import check_raster
from rasterscale.raster.s3 import configure_s3, local_copy
lines = []
for case in json.loads(sys.argv[1]):
    os.environ.update(case.get("env", {}))
    for key in case.get("unset", []):
        os.environ.pop(key, None)
    try:
        if case.get("config"):
            validate_config(case["config"])
        else:
            configure_s3({})
        if case.get("copy"):
            local_copy(case["copy"], case["folder"])
        info = check_raster(case["url"]) if case.get("url") else None
        lines.append(f"read {info.width} x {info.height}" if info else "copied")
    except (InputError, ConfigError) as err:
        lines.append(str(err))
print(json.dumps(lines))
"""


def in_child(site: Site, cases: list[dict]) -> list[str]:
    """What a fresh process says of each case in turn (its environment changed as the case says, then a raster's
    header checked, an object copied, a config validated): GDAL keeps the credentials it found for the life of a
    process, so each test of where they come from needs one of its own."""
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    env = {**os.environ, "PYTHONPATH": scripts}
    command = [sys.executable, "-c", CHILD, json.dumps(cases)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=site.root, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


NO_PROFILE = ["AWS_PROFILE", "CPL_AWS_CREDENTIALS_FILE", "AWS_SHARED_CREDENTIALS_FILE"]
ENDPOINT_VARIABLES = ["AWS_S3_ENDPOINT", "AWS_HTTPS", "AWS_VIRTUAL_HOSTING", "AWS_ENDPOINT_URL_S3"]


def test_s3_credentials_come_from_the_environment_a_profile_or_the_config(site):
    """The same private COG read with the user's keys from each usual place, each in a fresh process: the
    environment's keys; a profile in boto3's credentials file alone (AWS_SHARED_CREDENTIALS_FILE, which GDAL is
    pointed at); the config's ``s3.profile`` and ``s3.endpoint`` with no AWS variable set. Without any, GDAL's
    reason and where to set them, in one line."""
    url, credentials = f"s3://{BUCKET}/ortho/a.tif", str(site.root / "aws/credentials")
    endpoint = {"s3": {"profile": "rasterscale-test", "endpoint": f"http://{site.s3.endpoint}"}}
    config = {**endpoint, "scenes": {"a": {"path": url, "scale": {"min": 0, "max": 65535}}}}
    cases = {
        "environment": [{"env": site.s3.credentials(), "unset": NO_PROFILE, "url": url}],
        "credentials file": [
            {"env": {"AWS_SHARED_CREDENTIALS_FILE": credentials}, "unset": ["CPL_AWS_CREDENTIALS_FILE"], "url": url}
        ],
        "config": [{"unset": ["AWS_PROFILE", *ENDPOINT_VARIABLES], "config": config, "url": url}],
        "none": [{"unset": NO_PROFILE, "env": {"CPL_AWS_CREDENTIALS_FILE": str(site.root / "nowhere")}, "url": url}],
    }
    said = {name: in_child(site, case)[0] for name, case in cases.items()}
    assert said["environment"] == said["credentials file"] == said["config"] == "read 512 x 256", said
    line = said["none"]
    assert line.startswith(f"{url}: remote raster cannot be opened (AWS_SECRET_ACCESS_KEY"), line
    assert "AWS_PROFILE" in line and "AWS_NO_SIGN_REQUEST=YES" in line and "\n" not in line


def test_s3_refusals_are_one_line_naming_the_url_and_s3s_reason(site, tmp_path):
    """A raster (GDAL's /vsis3/) and an object read whole (boto3) that cannot be read: a missing bucket, a missing
    key, an object the user's policy denies, a wrong secret key and an unknown key id: each one line naming the
    URL and what S3 said, never a key. (One process for all: each case's URL is its own, so GDAL's cache of what
    it found of a URL cannot answer for another case.)"""
    wrong_secret = {"AWS_SECRET_ACCESS_KEY": "wrong-secret-key-0123456789"}
    unknown_key = {"AWS_ACCESS_KEY_ID": "AKIAUNKNOWN000000000", "AWS_SECRET_ACCESS_KEY": "unknown-key-secret-0123"}
    refusals = {
        "missing bucket": ("s3://no-such-bucket/a.tif", {}, "The specified bucket does not exist"),
        "missing key": (f"s3://{BUCKET}/ortho/none.tif", {}, "The specified key does not exist"),
        "denied": (f"s3://{BUCKET}/private/a.tif", {}, "Access Denied"),
        "wrong secret": (f"s3://{BUCKET}/ortho/a.tif", wrong_secret, "The request signature we calculated"),
        "unknown key": (
            f"s3://{BUCKET}/ortho/b.tif", unknown_key, "The AWS Access Key Id you provided does not exist"
        ),
    }  # fmt: skip
    cases = []
    for url, keys, _ in refusals.values():
        env = {**site.s3.credentials(), **keys}
        cases += [{"env": env, "unset": NO_PROFILE, "url": url}, {"env": env, "copy": url, "folder": str(tmp_path)}]
    said = in_child(site, cases)
    lines = {}
    for (name, (url, keys, reason)), raster, copied in zip(refusals.items(), said[::2], said[1::2], strict=True):
        assert raster.startswith(f"{url}: remote raster cannot be opened ({reason}"), (name, raster)
        assert copied.startswith(f"{url}: cannot be fetched from S3 ("), (name, copied)
        assert reason in copied, (name, copied)
        for line in (raster, copied):
            assert "\n" not in line and not any(secret in line for secret in (*site.secrets, *keys.values()))
        lines[name] = copied
    assert not list(tmp_path.rglob("*.tif")), "a failed fetch left a copy"
    report("S3 refusals (objects read whole): " + "; ".join(f"{k}: {v[:110]}" for k, v in lines.items()))


# ---------------------------------------------------------------------------------------------------------
# The plan: errors at dry-run time
# ---------------------------------------------------------------------------------------------------------


def plan_error(site: Site, workdir: Path, scenes: dict, monkeypatch) -> str:
    monkeypatch.chdir(workdir)
    with pytest.raises((InputError, ConfigError)) as err:
        build_plan(predict_config(site, scenes))
    message = str(err.value)
    assert "\n" not in message and SECRET not in message
    return message


def test_a_striped_remote_raster_stops_the_plan_with_the_fix(site, tmp_path, monkeypatch):
    write_raster(site.root / "www/striped.tif", 300, 200, tiled=False)
    url = site.http.url("striped.tif", f"sig={SECRET}")
    message = plan_error(site, tmp_path, {"s": {"path": url}}, monkeypatch)
    assert message.startswith(f"{site.http.url('striped.tif')}?sig=***: remote raster is striped, not tiled")
    assert "rio cogeo create" in message and "gdal_translate -of COG" in message


def test_a_missing_remote_raster_is_one_line_naming_the_url_redacted(site, tmp_path, monkeypatch):
    message = plan_error(site, tmp_path, {"s": {"path": site.http.url("nowhere.tif", f"sig={SECRET}")}}, monkeypatch)
    assert message.startswith(f"{site.http.url('nowhere.tif')}?sig=***: remote raster cannot be opened (")
    assert "HTTP response code: 404" in message
    message = plan_error(site, tmp_path, {"s": {"path": "s3://scenes/ortho/nowhere.tif"}}, monkeypatch)
    assert message.startswith("s3://scenes/ortho/nowhere.tif: remote raster cannot be opened (")


def test_the_plan_skips_remote_rasters_in_inputs_and_staleness(site, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scenes, stac = all_scenes(site)
    plan = build_plan(predict_config(site, scenes, stac=stac))
    assert list(plan.scenes) == ["local", "web", "bucket", "item", "c_1", "c_2"]
    assert plan.scenes["item"].path == site.http.url("stac/item.tif", f"sig={SECRET}")
    assert plan.scenes["c_1"].path == site.http.url("stac/c1.tif")
    assert plan.batch_inputs(0)["rasters"] == [str(site.cog)]  # the one local raster: Snakemake waits for no URL
    assert plan.raster_inputs("web", "bucket") == []
    assert set(plan.inputs) == {str(site.cog), str(site.root / "collection.json"), str(site.model.model_file)}
    rasters = {scene.name: scene.raster for scene in plan.prediction_batch(0).scenes}
    assert (rasters["web"], rasters["bucket"]) == (site.web_url(), "s3://scenes/ortho/a.tif")  # the jobs' URLs


def test_the_plan_reads_scenes_annotations_and_model_from_the_bucket(site, tmp_path, monkeypatch):
    """Scenes from a scene table and a STAC ItemCollection in the bucket (s3:// hrefs, one relative to the
    collection), a scene's annotations and the model file from the bucket, with the endpoint a config key: the
    rasters stay URLs read where they live, the files read whole become local copies (Snakemake's inputs), fetched
    again only when the object changed (a conditional GET: no body the second time)."""
    for key in ENDPOINT_VARIABLES:
        monkeypatch.delenv(key)  # and monkeypatch restores them: the config sets them again in this process
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    scale = {"min": 0, "max": 65535}
    table = tmp_path / "scenes.tsv"
    table.write_text(
        "name\tpath\tannotations\tscale\n"
        f"own\ts3://{BUCKET}/ortho/a.tif\ts3://{BUCKET}/truth/a.gpkg\t{{min: 0, max: 65535}}\n"
    )
    config = predict_config(
        site,
        str(table),
        stac={"items": [f"s3://{BUCKET}/stac/collection.json"], "scale": scale},
        s3={"endpoint": f"http://{site.s3.endpoint}"},
    )
    config["model"]["file"] = f"s3://{BUCKET}/models/model.pt"
    plan = build_plan(config)  # the config's endpoint set in this process's environment (undone by monkeypatch)
    assert {name: scene.path for name, scene in plan.scenes.items()} == dict.fromkeys(
        ("own", "b_1", "b_2"), f"s3://{BUCKET}/ortho/a.tif"
    )
    copies = tmp_path / ".snakemake/rasterscale/objects" / BUCKET
    annotations, model = copies / "truth/a.gpkg", copies / "models/model.pt"
    assert plan.scenes["own"].annotations == str(annotations.relative_to(tmp_path))
    assert plan.settings.model.file == str(model.relative_to(tmp_path)) and plan.paths.run == "model"
    assert annotations.read_bytes() == (site.root / "bucket/a.gpkg").read_bytes()
    assert model.read_bytes() == site.model.model_file.read_bytes()
    assert set(plan.inputs) >= {str(annotations.relative_to(tmp_path)), str(model.relative_to(tmp_path))}
    stamp = model.stat().st_mtime_ns
    site.reset()
    build_plan(config)
    assert site.fetched(f"/{BUCKET}/models/model.pt") == site.fetched(f"/{BUCKET}/truth/a.gpkg") == 0
    assert model.stat().st_mtime_ns == stamp


def test_a_plan_that_read_a_bucket_object_is_built_again_and_sees_it_changed(site, tmp_path, monkeypatch):
    """A local raster whose annotations are in the bucket: the main process's plan is not reused from its record
    (no stat of the local copy tells the object changed), so the next plan asks S3 again and copies the new
    object."""
    monkeypatch.chdir(tmp_path)
    key = "truth/changing.gpkg"
    site.s3.upload(site.root / "bucket/a.gpkg", BUCKET, key)
    scene = {"path": str(site.cog), "scale": {"min": 0, "max": 65535}, "annotations": f"s3://{BUCKET}/{key}"}
    config = predict_config(site, {"local": scene})
    plan = main_plan(config)
    copy = tmp_path / plan.scenes["local"].annotations
    assert (
        plan.unwatched == plan.scenes["local"].annotations
        and copy.read_bytes() == (site.root / "bucket/a.gpkg").read_bytes()
    )
    changed = tmp_path / "changed.gpkg"
    gpd.read_file(site.root / "bucket/a.gpkg").iloc[:1].to_file(changed)
    site.s3.upload(changed, BUCKET, key)
    main_plan(config)
    assert copy.read_bytes() == changed.read_bytes()


def test_an_exported_models_card_beside_it_in_the_bucket_is_copied_beside_its_copy(site, tmp_path, monkeypatch):
    """model.file an exported model in the bucket with its card beside it (``<file>.yaml``): both copied, the card
    beside the model's copy where the task looks for it; a model without a card: no card, no error."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.onnx").write_bytes(b"onnx bytes")
    (tmp_path / "net.onnx.yaml").write_text("task: segmentation\n")
    site.s3.upload(tmp_path / "net.onnx", BUCKET, "exported/net.onnx")
    site.s3.upload(tmp_path / "net.onnx.yaml", BUCKET, "exported/net.onnx.yaml")
    site.s3.upload(tmp_path / "net.onnx", BUCKET, "exported/bare.onnx")
    for name in ("net", "bare"):
        config = {"scenes": {}, "stac": {}, "model": {"file": f"s3://{BUCKET}/exported/{name}.onnx", "card": None}}
        fetch_whole_files(config)
        copy = tmp_path / config["model"]["file"]
        assert copy.read_bytes() == b"onnx bytes"
        assert card_path(copy).exists() == (name == "net")
    assert card_path(tmp_path / ".snakemake/rasterscale/objects/scenes/exported/net.onnx").read_text() == (
        "task: segmentation\n"
    )


def test_a_url_with_credentials_in_it_is_refused(site, tmp_path, monkeypatch):
    url = site.http.url("a.tif").replace("http://", "http://reader:pa55word@")
    message = plan_error(site, tmp_path, {"s": {"path": url}}, monkeypatch)
    assert message.startswith(f"config: key 'scenes.s.path': the URL {site.http.url('a.tif')}".replace("//", "//***@"))
    assert "pa55word" not in message and "GDAL_HTTP_USERPWD" in message


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("results/model/bucket/detections.parquet", True),
        ("results/model/predict/batch-0/shard-1", True),
        ("results/models/model.pt", True),
        ("./results/model/batches/merge-0.json", True),
        ("results/model/jobs/predict/batch-0.json", False),  # the plan's, written before the DAG
        ("results/demo/jobs/scene.json", False),
        ("results/checks/environment/job.json", False),
        ("results/checks/environment/rank-0.json", True),
        ("resources/demo/a.tif", False),
        ("logs/predict/batch-0/shard-0.log", False),
        ("/data/ortho/a.tif", False),
        ("results", False),
    ],
)
def test_only_results_but_the_plans_job_files_go_to_the_bucket(path, expected):
    assert default_storage.in_bucket(path) is expected


def test_the_storage_prefixs_local_copy_is_a_link_to_the_working_directory(tmp_path):
    """Made once (a relative link), kept, moved where it pointed elsewhere; a folder of local copies is refused."""
    link = tmp_path / ".snakemake/storage/s3/outputs/run"
    default_storage.mirror_working_directory(link, tmp_path)
    assert os.readlink(link) == "../../../.." and link.resolve() == tmp_path.resolve()
    (tmp_path / "results").mkdir()
    assert (link / "results").resolve() == (tmp_path / "results").resolve()
    default_storage.mirror_working_directory(link, tmp_path)  # a job's re-parse: unchanged
    assert os.readlink(link) == "../../../.."
    link.unlink()
    link.symlink_to(tmp_path / "results")
    default_storage.mirror_working_directory(link, tmp_path)
    assert link.resolve() == tmp_path.resolve()
    link.unlink()
    link.mkdir()
    with pytest.raises(ConfigError, match=r"run: Snakemake's local copies of the storage prefix are a folder; remove"):
        default_storage.mirror_working_directory(link, tmp_path)


def test_default_storage_is_on_with_a_prefix_and_kept_local_copies_and_else_says_what_to_add():
    assert default_storage.check_default_storage(None, None, False) is False
    assert default_storage.check_default_storage("s3", "s3://outputs/run", True) is True
    with pytest.raises(ConfigError, match=r"^--default-storage-provider s3: give the bucket and folder the outputs"):
        default_storage.check_default_storage("s3", None, True)
    with pytest.raises(ConfigError, match=r"s3://outputs/run: add --keep-storage-local-copies \(or keep-storage"):
        default_storage.check_default_storage("s3", "s3://outputs/run", False)


def test_default_storage_without_its_local_copies_kept_is_refused_at_the_dry_run_in_one_line(site, tmp_path):
    """Outputs on Snakemake's default storage (its S3 plugin installed, the server reachable) without their local
    copies kept: one line that says what to add, before any job, and nothing in the bucket."""
    scenes = {"bucket": {"path": f"s3://{BUCKET}/ortho/a.tif", "scale": {"min": 0, "max": 65535}}}
    command = workflow_command(tmp_path, predict_config(site, scenes), "-n", *STORAGE)
    result = snakemake_forks.run(command, timeout=300, check=False)
    lines = [line for line in result.stderr.splitlines() if line.startswith("rasterscale: ")]
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(
        "rasterscale: --default-storage-provider s3 --default-storage-prefix s3://outputs/run: add "
        "--keep-storage-local-copies (or keep-storage-local-copies: true in the profile)"
    )
    assert "Traceback" not in result.stderr
    assert not (tmp_path / ".snakemake/storage/s3/outputs/run").is_symlink()
    assert site.s3.client().list_objects_v2(Bucket=OUTPUTS).get("KeyCount") == 0


# ---------------------------------------------------------------------------------------------------------
# STAC items and collections
# ---------------------------------------------------------------------------------------------------------


def test_stac_items_give_scenes(site, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    item = write_json(tmp_path / "items/one.json", stac_item("one", "../rasters/one.tif"))
    config = validate_config(
        {"scenes": {"x": {"stac": "items/one.json"}}, "stac": {"items": [site.http.url("stac/item.json")]}}
    )
    assert config["scenes"]["x"]["path"] == str(tmp_path / "rasters/one.tif")  # relative to the item
    assert config["scenes"]["item-1"]["path"] == site.http.url("stac/item.tif", f"sig={SECRET}")
    assert config["stac"] == {"items": [site.http.url("stac/item.json")], "asset": "visual"}
    table = tmp_path / "scenes.tsv"
    table.write_text(f"name\tstac\tasset\tbands\ny\t{item}\tvisual\t[3, 2, 1]\n")
    config = validate_config(
        {"scenes": str(table), "stac": {"items": [str(site.root / "collection.json")], "bands": [3, 2, 1]}}
    )
    assert {name: (s["path"], s["bands"]) for name, s in config["scenes"].items()} == {
        "y": (str(tmp_path / "rasters/one.tif"), [3, 2, 1]),
        "c_1": (site.http.url("stac/c1.tif"), [3, 2, 1]),
        "c_2": (site.http.url("stac/c2.tif"), [3, 2, 1]),
    }


@pytest.mark.parametrize(
    ("scenes", "stac", "message"),
    [
        ({"x": {"stac": "items/one.json", "asset": "analytic"}}, None,
         "items/one.json: STAC item 'one' has no asset 'analytic' (its assets: thumbnail, visual); set scenes.x.asset"),
        ({}, {"items": ["items/one.json"], "asset": "B04"},
         "items/one.json: STAC item 'one' has no asset 'B04' (its assets: thumbnail, visual); set stac.asset"),
        ({"x": {"stac": "items/none.json"}}, None, "items/none.json: STAC item not found"),
        ({"x": {"stac": "items/bad.json"}}, None, "items/bad.json: STAC item is not JSON ("),
        ({"x": {"stac": "items/catalog.json"}}, None,
         "items/catalog.json: not a STAC Item or ItemCollection (its type is 'Catalog'"),
        ({"x": {"stac": "{http}/stac/none.json?sig=" + SECRET}}, None,
         "{http}/stac/none.json?sig=***: STAC item cannot be read (HTTP 404: File not found)"),
        ({"x": {"stac": "items/one.json", "path": "a.tif"}}, None,
         "config: scenes.x: set 'path' or 'stac' (a STAC item's asset), not both"),
        ({"x": {"path": "a.tif", "asset": "visual"}}, None,
         "config: scenes.x: key 'asset' is the asset of a STAC item, and 'stac' is not set"),
        ({"one": {"path": "a.tif"}}, {"items": ["items/one.json"]},
         "config: key 'stac.items': STAC item 'one' of items/one.json gives the scene name 'one', which scenes.one"),
        ({}, {"items": ["items/one.json"], "assets": "visual"}, "config: unknown key 'stac.assets' (allowed: asset, "),
        ({}, {"items": "items/one.json"}, "config: key 'stac.items': 'items/one.json' is not of type 'array'"),
    ],
)  # fmt: skip
def test_stac_errors_are_one_line_naming_the_item_or_key(site, tmp_path, monkeypatch, scenes, stac, message):
    monkeypatch.chdir(tmp_path)
    write_json(tmp_path / "items/one.json", stac_item("one", "one.tif"))
    (tmp_path / "items/bad.json").write_text("{not json")
    write_json(tmp_path / "items/catalog.json", {"type": "Catalog", "id": "c", "description": "d", "links": []})
    http = site.http.url("").rstrip("/")
    scenes = {n: {k: v.replace("{http}", http) for k, v in s.items()} for n, s in scenes.items()}
    config = {"scenes": scenes, **({"stac": stac} if stac else {})}
    with pytest.raises((ConfigError, InputError)) as err:
        validate_config(config)
    assert message.replace("{http}", http) in str(err.value)
    assert "\n" not in str(err.value) and SECRET not in str(err.value)


# ---------------------------------------------------------------------------------------------------------
# The workflow: a dry run, a prediction, a server that stops
# ---------------------------------------------------------------------------------------------------------


def test_dry_run_checks_remote_headers_from_a_few_kb(site, tmp_path):
    scenes, stac = all_scenes(site)
    site.reset()
    command = workflow_command(tmp_path, predict_config(site, scenes, stac=stac), "-n")
    result = snakemake_forks.run(command, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", result.stdout, flags=re.M))
    assert {k: jobs.get(k) for k in ("tiles_batch_0", "predict", "merge_batch_0")} == dict.fromkeys(
        ("tiles_batch_0", "predict", "merge_batch_0"), "1"
    )
    assert not any(secret in result.stdout + result.stderr for secret in site.secrets)
    fetched = {path: site.fetched(path) for path in ("/a.tif", "/scenes/ortho/a.tif", "/stac/item.tif", "/stac/c1.tif")}
    assert all(0 < nbytes <= 64 * 1024 for nbytes in fetched.values()), fetched
    report(
        "remote dry run (header checks of 5 remote scenes): "
        + ", ".join(f"{path} fetched {nbytes} of {site.size} bytes" for path, nbytes in fetched.items())
    )


@dataclass
class RemotePrediction:
    """One prediction job over the same COG as a local file and three remote scenes, and what the servers served."""

    workdir: Path
    result: subprocess.CompletedProcess
    seconds: float
    fetched: dict[str, int]  # the bytes each remote scene's server served in that job, by the scene's name
    requests: int  # the requests the S3 server answered for the bucket's scene


@pytest.fixture(scope="module")
def remote_prediction(site, tmp_path_factory) -> RemotePrediction:
    """One prediction job over the same COG as a local file, over HTTP (a signed URL), on S3 and as a STAC item's
    asset (the scenes' layers asked for, not the report's quicklooks, which read a raster without overviews whole);
    the bytes served counted from a reset to the job's end. The model file comes from the bucket, and the way to
    S3 from the config alone (``s3.profile``, ``s3.endpoint``: no AWS_PROFILE nor endpoint in the environment the
    workflow starts in). Its local scene's detections are also the reference of an uninterrupted local prediction
    for the faults' test and the whole-S3 run."""
    workdir = tmp_path_factory.mktemp("remote-prediction")
    scenes = all_scenes(site)[0]
    config = predict_config(site, scenes, s3={"profile": "rasterscale-test", "endpoint": f"http://{site.s3.endpoint}"})
    config["model"]["file"] = f"s3://{BUCKET}/models/model.pt"
    site.reset()
    started = time.monotonic()
    layers = [RUN.scene_file(name, "detections.parquet") for name in ("local", "web", "bucket", "item")]
    with pytest.MonkeyPatch.context() as patch:
        for key in ("AWS_PROFILE", *ENDPOINT_VARIABLES):
            patch.delenv(key)
        result = run_workflow(workdir, config, *layers)  # not the report's quicklooks
    seconds = time.monotonic() - started
    paths = {"web": "/a.tif", "bucket": f"/{BUCKET}/ortho/a.tif", "item": "/stac/item.tif"}
    fetched = {name: site.fetched(path) for name, path in paths.items()}
    return RemotePrediction(workdir, result, seconds, fetched, site.s3.requests(paths["bucket"]))


@pytest.mark.slow
def test_prediction_over_remote_scenes_gives_the_local_layer_reading_windows(site, remote_prediction):
    """One prediction job over the same COG as a local file, over HTTP (a signed URL), on S3 and as a STAC item's
    asset (the scenes' layers asked for, not the report's quicklooks, which read a raster without overviews
    whole): every scene's detections are the local scene's, and each remote scene fetched its full-resolution
    blocks about once and its header once per process that opened it, never its overviews: less than the file.
    No log or output shows the URL's signature or the profile's secret key."""
    run = remote_prediction.workdir
    local = gpd.read_parquet(run / RUN.scene_file("local", "detections.parquet"))
    assert len(local) > 100
    for name in ("web", "bucket", "item"):
        assert gpd.read_parquet(run / RUN.scene_file(name, "detections.parquet")).equals(local), name
    tiles = len(gpd.read_parquet(run / RUN.scene_manifest("local")))
    with rasterio.open(site.cog) as src:  # the full-resolution blocks' bytes, what a prediction needs
        blocks = [(x, y) for x in range(-(-src.width // 128)) for y in range(-(-src.height // 128))]
        full = sum(int(src.get_tag_item(f"BLOCK_SIZE_{x}_{y}", "TIFF", bidx=1)) for x, y in blocks)
    lines = []
    for name, fetched in remote_prediction.fetched.items():
        assert full <= fetched < site.size, (name, fetched, full, site.size)
        lines.append(f"{name} fetched {fetched} of {site.size} bytes ({fetched / site.size:.0%}; blocks {full})")
    assert 0 < remote_prediction.requests < 4 * tiles  # a few ranged GETs a tile (the header's, the blocks')
    report(
        f"remote prediction ({remote_prediction.seconds:.0f} s; 4 scenes of {tiles} tiles, detections identical to "
        f"the local scene's): " + "; ".join(lines) + f"; S3 answered {remote_prediction.requests} requests for the "
        f"bucket's scene ({remote_prediction.requests / tiles:.1f} a tile, the header's included)"
    )
    # the URLs' secrets are in the jobs' inputs (their job files, results/{run}/jobs/), and in no log nor output
    outputs = [p for p in (run / "results").iterdir() if p.name != RUN.run]
    outputs += [p for p in (run / RUN.root).iterdir() if p.name != "jobs"]
    logged = [run / "logs", run / ".snakemake/log", *outputs]
    result = remote_prediction.result
    text = result.stdout + result.stderr + files_text(*logged)
    assert not any(secret in text for secret in site.secrets)
    assert SECRET in (run / RUN.job_file("predict", 0)).read_text()


def every_file_text(folder: Path) -> Iterator[tuple[Path, str]]:
    """Each file under ``folder`` as text, a zip archive's members too (the Snakemake report)."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                for member in archive.namelist():
                    yield path / member, archive.read(member).decode("utf-8", "replace")
        else:
            yield path, path.read_bytes().decode("utf-8", "replace")


def saved_tiles(run: Path) -> int:
    """The tiles a failed prediction job's rank saved (its resume parts)."""
    return sum(
        len(part["tiles"])
        for index in (run / RUN.shard_resume_dir(0, 0)).glob("*/rank-*.index.json")
        for part in json.loads(index.read_text())["parts"]
    )


def test_a_connection_broken_mid_read_is_one_line_naming_the_url_tile_and_short_answer(site):
    """The S3 server breaks each connection halfway through its answer (GDAL's retries spent): the rank's read of a
    tile (read_tile, as a prediction rank reads) fails with one line naming the URL, the tile and the short read."""
    url = site.s3.upload(site.cog, BUCKET, "ortho/broken.tif")  # a key of its own: nothing of it cached here
    spec = ImageSpec(low=(0.0, 0.0, 0.0), high=(65535.0, 65535.0, 65535.0), scale="declared")
    remote = ProcessRaster(url)
    site.s3.fault("drop")
    try:
        with pytest.raises(RasterReadError) as err:
            read_tile(remote.src, spec, rasterio.windows.Window(128, 128, 128, 128), tile_id=7)
    finally:
        site.s3.fault(None)
    line = str(err.value)
    assert line.startswith(f"{url}: tile 7 (window col 128, row 128, 128 x 128 px) could not be read ("), line
    assert re.search(r"got \d+ bytes, expected \d+", line) and "broke the connection" in line and "\n" not in line


@dataclass
class S3Run:
    """The whole workflow from S3, its prediction throttled once on the way (:func:`s3_run`)."""

    workdir: Path
    failed: subprocess.CompletedProcess  # the throttled run
    error: str  # the one line its prediction job failed with
    saved: int  # the tiles its rank saved before
    total: int  # the batch's tiles
    result: subprocess.CompletedProcess  # the whole run after it
    seconds: float  # of the whole run
    urls: tuple[str, ...]  # the scenes' rasters


def with_user_keys(patch: pytest.MonkeyPatch, site: Site) -> None:
    """The user's keys in the environment, and no profile: what the whole S3 run starts with."""
    for key in NO_PROFILE:
        patch.delenv(key)
    for key, value in site.s3.credentials().items():
        patch.setenv(key, value)


@pytest.fixture(scope="module")
def s3_run(site, tmp_path_factory) -> S3Run:
    """Two scenes, one with annotations, and the model file, all in the bucket, with the user's keys in the
    environment (no profile): the tile manifests made; a prediction that the S3 server throttles (503 SlowDown to
    every request after the rank's first ranges of pixels, GDAL's retries spent, quickly: GDAL_HTTP_RETRY_DELAY
    from the environment); then, with the server well, the whole workflow (the prediction resumed, merges, the
    project's layer, the evaluation, the report's pages) and Snakemake's report. Every run's outputs go to the
    bucket :data:`OUTPUTS` through Snakemake's default storage (:data:`STORAGE`)."""
    run = tmp_path_factory.mktemp("s3-run") / "run"
    scale = {"min": 0, "max": 65535}
    urls = (f"s3://{BUCKET}/ortho/a.tif", f"s3://{BUCKET}/ortho/b.tif")
    scenes = {
        "bucket": {"path": urls[0], "scale": scale, "annotations": f"s3://{BUCKET}/truth/a.gpkg"},
        "beside": {"path": urls[1], "scale": scale},
    }
    config = predict_config(site, scenes)
    config["model"]["file"] = f"s3://{BUCKET}/models/model.pt"
    with pytest.MonkeyPatch.context() as patch:
        with_user_keys(patch, site)
        run_workflow(run, config, *STORAGE, KEEP, RUN.batch_record("tiles", 0))  # read well: the fault is the rank's
        site.s3.fault("throttle", 2)
        try:
            patch.setenv("GDAL_HTTP_RETRY_DELAY", "0.1")  # the environment's wins: GDAL's 3 retries in a second
            failed = snakemake_forks.run(workflow_command(run, config, "--cores", "2", *STORAGE, KEEP), timeout=600)
            patch.delenv("GDAL_HTTP_RETRY_DELAY")
        finally:
            site.s3.fault(None)
        log = (run / "logs/predict/batch-0/shard-0.log").read_text()
        errors = [line for line in log.splitlines() if line.startswith("rasterscale: ")]
        assert failed.returncode != 0 and len(errors) == 1, log[-3000:]
        total = sum(len(gpd.read_parquet(run / RUN.scene_manifest(name))) for name in scenes)
        saved = saved_tiles(run)
        started = time.monotonic()
        result = run_workflow(run, config, *STORAGE, KEEP, "--report", "report.zip", "--report-after-run")
        seconds = time.monotonic() - started
    return S3Run(run, failed, errors[0], saved, total, result, seconds, urls)


@pytest.mark.slow
def test_s3_throttled_mid_prediction_fails_with_one_line_and_the_rerun_resumes(s3_run, remote_prediction):
    """The throttled prediction job failed with one line naming the URL, the tile and the throttling; the rerun
    predicted only the tiles not finished and merged the layer of an uninterrupted local prediction
    (``remote_prediction``'s local scene: same model, tiling and prediction settings)."""
    run, error = s3_run.workdir, s3_run.error
    assert error.startswith(tuple(f"rasterscale: rank 0: {url}: tile " for url in s3_run.urls)), error
    assert "the server answered HTTP 503 to every retry: it throttles the requests" in error
    assert "run the same command again" in error
    assert 0 < s3_run.saved < s3_run.total
    log = (run / "logs/predict/batch-0/shard-0.log").read_text()
    assert f"resuming: {s3_run.saved} of {s3_run.total} tiles already done" in log
    records = [
        json.loads(stem.with_suffix(".json").read_text())
        for name in ("bucket", "beside")
        for stem in rank_stems(run / RUN.root, name)
    ]
    redone = sum(r["profile"]["tiles"] for r in records)
    assert sum(r["resumed"] for r in records) == s3_run.saved and redone == s3_run.total - s3_run.saved
    resumed = gpd.read_parquet(run / RUN.scene_file("bucket", "detections.parquet"))
    reference = gpd.read_parquet(remote_prediction.workdir / RUN.scene_file("local", "detections.parquet"))
    assert len(resumed) > 100 and resumed.equals(reference)
    report(
        f"S3 throttled mid-prediction after 2 ranges: {s3_run.saved} of {s3_run.total} tiles saved, the job failed "
        f"with: {error[:220]}...; the rerun predicted the other {redone}, detections identical to a local run's"
    )


@pytest.mark.slow
def test_a_whole_run_from_s3_writes_every_layer_and_leaves_no_secret(site, s3_run, remote_prediction):
    """The whole run from S3 (:func:`s3_run`) wrote the scenes' layers, the project's, the evaluation, the report's
    pages and Snakemake's report; no file the run wrote (logs, job files, stored plans, the header cache, reports,
    benchmarks, profiles, .snakemake/), nor its output, the throttled run's included, holds the secret key or the
    key id. The scan is armed: it finds the signed URL's signature in ``remote_prediction``'s job file."""
    run = s3_run.workdir
    written = [path.name for path in (run / RUN.root).iterdir()]
    assert {"bucket", "beside", "project", "jobs", "report"} <= set(written), written
    assert (run / RUN.evaluation_file("bucket")).exists() and (run / "report.zip").exists()
    outputs = [
        (Path(f"snakemake output {n}"), r.stdout + r.stderr) for n, r in enumerate((s3_run.failed, s3_run.result))
    ]
    texts = [*outputs, *every_file_text(run)]
    armed = [path for path, text in every_file_text(remote_prediction.workdir) if SECRET in text]  # the scan reads
    assert RUN.job_file("predict", 0) in [str(path.relative_to(remote_prediction.workdir)) for path in armed]
    assert any(".zip/" in str(path) and "bucket" in text for path, text in texts)  # ...job files and zip members
    found = [f"{path}: {secret[:4]}..." for path, text in texts for secret in site.secrets[1:] if secret in text]
    assert not found, found
    report(
        f"whole run from S3 ({s3_run.seconds:.0f} s after the throttled one: two scenes, annotations and the model "
        f"in the bucket): {len(texts)} files scanned (the report's zip's members too), no secret found"
    )


def bucket_objects(site: Site, prefix: str) -> dict[str, bytes]:
    """The objects under ``prefix`` of the outputs' bucket, by their key less the prefix."""
    client = site.s3.client()
    keys = [
        item["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=OUTPUTS, Prefix=prefix)
        for item in page.get("Contents", [])
    ]
    return {key[len(prefix) :]: client.get_object(Bucket=OUTPUTS, Key=key)["Body"].read() for key in keys}


@pytest.mark.slow
def test_a_whole_s3_runs_outputs_are_in_the_bucket_and_its_job_files_stay_local(site, s3_run):
    """Snakemake's default storage took every file the whole run wrote under results/ to the bucket, byte for byte
    the working directory's (its local mirror): manifests, rank files, the batches' records, the layers, the
    project's, the evaluation and the report's pages; the plan's job files stayed local, as logs/ did."""
    run = s3_run.workdir
    local = {str(p.relative_to(run)): p.read_bytes() for p in (run / "results").rglob("*") if p.is_file()}
    stored = bucket_objects(site, "run/")
    jobs = sorted(path for path in local if "/jobs/" in path or path == check_job())
    assert RUN.job_file("predict", 0) in jobs and check_job() in jobs
    expected = {path: data for path, data in local.items() if path not in jobs}
    assert sorted(set(stored) - set(expected)) == [] and sorted(set(expected) - set(stored)) == []
    assert all(stored[path] == data for path, data in expected.items())
    for layer in ("project/detections.gpkg", "bucket/detections.parquet", "bucket/evaluation.json", "report/run.html"):
        assert f"{RUN.root}/{layer}" in stored, layer
    assert not any(key.startswith(("logs/", "benchmarks/", ".snakemake/")) for key in stored)
    report(f"whole S3 run's outputs in s3://{OUTPUTS}/run/: {len(stored)} objects, {len(jobs)} job files kept local")


@pytest.mark.slow
def test_a_rerun_does_nothing_and_outputs_gone_locally_are_read_back_from_the_bucket(site, s3_run, monkeypatch):
    """After the whole run, nothing is left to do. With the prediction's rank files and a scene's layer gone from
    the working directory, the layer asked for again (its merge forced) is merged from the rank files read back
    from the bucket, the same layer, stored again."""
    run = s3_run.workdir
    with_user_keys(monkeypatch, site)
    config = yaml.safe_load((run / "config.yaml").read_text())
    again = snakemake_forks.run(workflow_command(run, config, "-n", *STORAGE, KEEP), timeout=300)
    assert "Nothing to be done" in again.stdout + again.stderr, again.stdout[-3000:]
    target = RUN.scene_file("bucket", "detections.parquet")
    layer = run / target
    before = layer.read_bytes()
    shutil.rmtree(run / RUN.shard_dir(0, 0))
    layer.unlink()
    result = run_workflow(run, config, *STORAGE, KEEP, "--forcerun", "merge_batch_0", target)
    output = result.stdout + result.stderr
    assert f"Retrieving from storage: s3://{OUTPUTS}/run/{RUN.shard_dir(0, 0)}" in output
    assert (run / RUN.shard_dir(0, 0)).is_dir() and layer.read_bytes() == before
    assert f"Storing in storage: s3://{OUTPUTS}/run/{target}" in output


def test_an_s3_key_the_storage_plugin_started_without_is_refused_naming_how_to_give_it():
    """The plugin that writes the outputs started before the config was read: the config's endpoint, profile or
    region must already be in the environment (or the endpoint on the plugin's command line), else one line."""
    section = {"endpoint": "http://127.0.0.1:9000", "profile": "lab", "region": None}
    given = {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000", "AWS_PROFILE": "lab"}
    no_settings = type("Settings", (), {"endpoint_url": None})()
    default_storage.check_plugin_environment(section, given, "s3", no_settings)
    default_storage.check_plugin_environment(section, {}, "gcs", no_settings)  # not S3's plugin
    flag = type("Settings", (), {"endpoint_url": "http://127.0.0.1:9000/"})()
    default_storage.check_plugin_environment(section, {"AWS_PROFILE": "lab"}, "s3", flag)
    with pytest.raises(ConfigError) as err:
        default_storage.check_plugin_environment(section, {"AWS_PROFILE": "lab"}, "s3", no_settings)
    assert str(err.value) == (
        "key 's3.endpoint': Snakemake's S3 storage plugin, which writes the outputs to the bucket, starts before the "
        "config is read and does not see it: set AWS_ENDPOINT_URL_S3=http://127.0.0.1:9000 in the environment "
        "snakemake starts in (or --storage-s3-endpoint-url http://127.0.0.1:9000)"
    )
    with pytest.raises(ConfigError, match=r"^key 's3.region': .* set AWS_DEFAULT_REGION=eu-west-1 in the env"):
        default_storage.check_plugin_environment({"region": "eu-west-1"}, {}, "s3", no_settings)
