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
from dataclasses import dataclass
from pathlib import Path

import geopandas as gpd
import numpy as np
import pystac
import pytest
import rasterio
from affine import Affine

import snakemake_forks
from conftest import report, write_raster
from prediction import PredictScene
from rasterscale.config.schema import validate_config
from rasterscale.errors import ConfigError, InputError, redact
from rasterscale.jobs.paths import RunPaths
from rasterscale.raster.headers import check_raster
from rasterscale.raster.imagery import ImageSpec, ProcessRaster, read_tile
from rasterscale.raster.remote import file_name, gdal_path, is_remote, shown
from rasterscale.workflow.checks import build_plan
from remote_servers import RangeServer, S3Server
from workflow import rank_stems, run_workflow, workflow_command

SECRET = "s3cr3t-token"  # a signed URL's signature: never in a log or an error
KEY_SECRET = "profile-secret-key"  # the AWS profile's secret key: never in a log
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
        counter = self.s3.counter if path.startswith("/scenes/") else self.http.counter
        return counter.bytes.get(path, 0)

    def reset(self) -> None:
        self.http.counter.reset()
        self.s3.counter.reset()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A 512 x 256 px 16-bit COG over HTTP (as a.tif, and as stac/item.tif, stac/c1.tif, stac/c2.tif behind the STAC
    items stac/item.json and collection.json) and on S3 (s3://scenes/ortho/a.tif), GDAL's AWS credentials a named
    profile of a credentials file."""
    root = tmp_path_factory.mktemp("remote")
    www = root / "www"
    (www / "stac").mkdir(parents=True)
    cog = write_cog(www / "a.tif", 512, 256)
    for name in ("item.tif", "c1.tif", "c2.tif"):
        shutil.copy(cog, www / "stac" / name)
    http = RangeServer(www).start()
    s3 = S3Server().start()
    s3.upload(cog, "ortho/a.tif")
    write_json(www / "stac/item.json", stac_item("item-1", f"item.tif?sig={SECRET}"))  # relative, signed
    collection = [stac_item("c.1", http.url("stac/c1.tif")), stac_item("c.2", http.url("stac/c2.tif"))]
    write_json(root / "collection.json", pystac.ItemCollection(collection).to_dict())
    credentials, profiles = root / "aws/credentials", root / "aws/config"
    credentials.parent.mkdir()
    credentials.write_text(f"[rasterscale-test]\naws_access_key_id = AKIDTEST\naws_secret_access_key = {KEY_SECRET}\n")
    profiles.write_text("[profile rasterscale-test]\nregion = us-east-1\n")
    model = PredictScene.make(root / "model", 128, 128)  # an untrained RetinaNet at score threshold 0
    with pytest.MonkeyPatch.context() as patch:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_NO_SIGN_REQUEST"):
            patch.delenv(key, raising=False)
        environment = {
            **s3.environment(),
            "AWS_PROFILE": "rasterscale-test",
            "CPL_AWS_CREDENTIALS_FILE": str(credentials),  # GDAL's name for AWS_SHARED_CREDENTIALS_FILE
            "AWS_CONFIG_FILE": str(profiles),
            "AWS_SHARED_CREDENTIALS_FILE": str(credentials),  # moto's server, in this process, reads the profile too
        }
        for key, value in environment.items():
            patch.setenv(key, value)
        s3.counter.reset()
        yield Site(root, cog, http, s3, model)
    http.stop()
    s3.stop()


def predict_config(site: Site, scenes: dict, **extra) -> dict:
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
        "bucket": {"path": "s3://scenes/ortho/a.tif", "scale": scale},
        "item": {"stac": site.http.url("stac/item.json"), "asset": "visual", "scale": scale},
    }
    return scenes, {"items": [str(site.root / "collection.json")], "asset": "visual", "scale": scale}


def files_text(*folders: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for folder in folders for p in folder.rglob("*") if p.is_file())


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


def test_s3_needs_credentials_and_says_where_they_come_from(site, monkeypatch):
    """The module's credentials are a profile of a credentials file (AWS_PROFILE, CPL_AWS_CREDENTIALS_FILE); without
    any, GDAL's reason and where to set them, in one line. (Run in a child process: GDAL keeps credentials it
    found for the life of a process.)"""
    monkeypatch.delenv("AWS_PROFILE")
    monkeypatch.setenv("CPL_AWS_CREDENTIALS_FILE", str(site.root / "nowhere"))
    monkeypatch.setenv("HOME", str(site.root))  # no ~/.aws of the machine's
    code = (
        "from rasterscale.raster.headers import check_raster\n"
        "from rasterscale.errors import InputError\n"
        "try:\n    check_raster('s3://scenes/ortho/a.tif')\nexcept InputError as err:\n    print(err)\n"
    )
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    env = {**os.environ, "PYTHONPATH": scripts}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    line = result.stdout.strip()
    assert line.startswith("s3://scenes/ortho/a.tif: remote raster cannot be opened (AWS_SECRET_ACCESS_KEY")
    assert "AWS_PROFILE" in line and "AWS_NO_SIGN_REQUEST=YES" in line and "\n" not in line


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
    assert {k: jobs.get(k) for k in ("tile_manifests_batch_0", "predict", "merge_batch_0")} == dict.fromkeys(
        ("tile_manifests_batch_0", "predict", "merge_batch_0"), "1"
    )
    assert SECRET not in result.stdout + result.stderr and KEY_SECRET not in result.stdout + result.stderr
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


@pytest.fixture(scope="module")
def remote_prediction(site, tmp_path_factory) -> RemotePrediction:
    """One prediction job over the same COG as a local file, over HTTP (a signed URL), on S3 and as a STAC item's
    asset (the scenes' layers asked for, not the report's quicklooks, which read a raster without overviews whole);
    the bytes served counted from a reset to the job's end. Its local scene's detections are also the reference of
    an uninterrupted local prediction for the stopping server's test."""
    workdir = tmp_path_factory.mktemp("remote-prediction")
    scenes = all_scenes(site)[0]
    site.reset()
    started = time.monotonic()
    layers = [RUN.scene_file(name, "detections.parquet") for name in ("local", "web", "bucket", "item")]
    result = run_workflow(workdir, predict_config(site, scenes), *layers)  # not the report's quicklooks
    seconds = time.monotonic() - started
    paths = {"web": "/a.tif", "bucket": "/scenes/ortho/a.tif", "item": "/stac/item.tif"}
    return RemotePrediction(workdir, result, seconds, {name: site.fetched(path) for name, path in paths.items()})


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
    report(
        f"remote prediction ({remote_prediction.seconds:.0f} s; 4 scenes of {tiles} tiles, detections identical to "
        "the local scene's): " + "; ".join(lines)
    )
    # the URLs' secrets are in the jobs' inputs (their job files, results/{run}/jobs/), and in no log nor output
    outputs = [p for p in (run / "results").iterdir() if p.name != RUN.run]
    outputs += [p for p in (run / RUN.root).iterdir() if p.name != "jobs"]
    logged = [run / "logs", run / ".snakemake/log", *outputs]
    result = remote_prediction.result
    text = result.stdout + result.stderr + files_text(*logged)
    assert SECRET not in text and KEY_SECRET not in text
    assert SECRET in (run / RUN.job_file("predict", 0)).read_text()


@pytest.mark.slow
def test_a_server_that_stops_mid_prediction_fails_with_one_line_and_the_rerun_resumes(
    site, remote_prediction, tmp_path
):
    """The HTTP server stops right after its second answer beyond the raster's header (the rank's second range of
    pixels: GDAL reads ahead, doubling the range while reads are sequential, so the third would hold the rest of
    this small raster): the prediction job fails with one line naming the URL (its signature redacted) and the tile;
    with the server back (same port), the rerun predicts only the tiles that were not finished and merges the layer
    of an uninterrupted local prediction (the local scene's of ``remote_prediction``: same model, tiling and
    prediction settings). Both runs ask for the scene's layer alone (no scores, quicklooks or report pages)."""
    www = tmp_path / "www"
    www.mkdir()
    shutil.copy(site.cog, www / "scene.tif")
    server = RangeServer(www).start()
    url = server.url("scene.tif", f"sig={SECRET}")
    scale = {"min": 0, "max": 65535}
    scenes = {"web": {"path": url, "scale": scale}, "local": {"path": str(site.cog), "scale": scale}}
    config = predict_config(site, scenes)
    config["predict"]["scenes"] = ["web"]
    server.stop_when = lambda ranges: sum(not header.startswith("bytes=0-") for _, header in ranges) >= 2
    run, layer = tmp_path / "run", RUN.scene_file("web", "detections.parquet")
    failed = snakemake_forks.run(workflow_command(run, config, "--cores", "2", layer), timeout=600)
    assert failed.returncode != 0
    assert server.stop_when is None  # it stopped
    served = sum(server.counter.bytes.values())
    log = (run / "logs/predict/batch-0/shard-0.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("rasterscale: ")]
    assert len(errors) == 1, log[-3000:]
    assert errors[0].startswith(f"rasterscale: rank 0: {server.url('scene.tif')}?sig=***: tile ")
    assert "could not be read" in errors[0] and "run the same command again" in errors[0]
    saved_tiles = sum(
        len(part["tiles"])
        for index in (run / RUN.shard_resume_dir(0, 0)).glob("*/rank-*.index.json")
        for part in json.loads(index.read_text())["parts"]
    )
    server.start()
    try:
        run_workflow(run, config, layer)
    finally:
        server.stop()
    log = (run / "logs/predict/batch-0/shard-0.log").read_text()
    total = len(gpd.read_parquet(run / RUN.scene_manifest("web")))
    assert f"resuming: {saved_tiles} of {total} tiles already done" in log
    records = [json.loads(stem.with_suffix(".json").read_text()) for stem in rank_stems(run / RUN.root, "web")]
    redone = sum(r["profile"]["tiles"] for r in records)
    assert 0 < saved_tiles < total and sum(r["resumed"] for r in records) == saved_tiles
    assert redone == total - saved_tiles
    resumed = gpd.read_parquet(run / layer)
    reference = gpd.read_parquet(remote_prediction.workdir / RUN.scene_file("local", "detections.parquet"))
    assert len(resumed) > 100 and resumed.equals(reference)
    text = failed.stdout + failed.stderr + files_text(run / "logs", run / ".snakemake/log")
    assert SECRET not in text
    report(
        f"remote server stopped mid-prediction (after serving {served} of the raster's {site.size} bytes): "
        f"{saved_tiles} of {total} tiles saved; the job failed with: {errors[0][:150]}...; the rerun "
        f"predicted {redone} of {total} tiles, detections identical to a local run's"
    )
