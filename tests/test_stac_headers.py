"""A STAC item's header trusted by the plan, checked by the tile-manifest job, and scenes_on_error: skip.

Where an item carries the ``proj`` extension and its bands' data type, the plan builds the scene's header from it and
opens no raster; the scene's tile-manifest job reads the real header and stops with one line naming the item and the
field where they differ (and records it: with ``scenes_on_error: skip`` the next plan leaves the scene out). With
``skip`` a scene whose raster cannot be read or checked is left out with one warning line, the rest runs, and the
report lists it.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from pathlib import Path

import geopandas as gpd
import numpy as np
import pytest
from affine import Affine

import snakemake_forks
from conftest import report, write_raster
from prediction import PredictScene
from rasterscale.config.stac import read_items
from rasterscale.errors import InputError
from rasterscale.raster.headers import read_raster_header
from rasterscale.raster.item_header import ItemHeader, disagreement, item_header, recorded_skips, verify
from rasterscale.workflow.checks import build_plan
from rasterscale.workflow.jobfiles import job_files
from workflow import jobs_planned, run_dir, run_workflow, workflow_command

WIDTH, HEIGHT = 300, 200
X0, Y0 = 404000.0, 3285000.0


def transform(i: int) -> Affine:
    """Scene i's: 300 x 200 px at 0.1 m, 100 m apart (no two abut: no seams)."""
    return Affine(0.1, 0, X0 + 100 * i, 0, -0.1, Y0)


def item(item_id: str, href: str, i: int, **properties) -> dict:
    """A STAC 1.1 item whose visual asset says its raster is scene i's (``properties`` over the proj fields)."""
    proj = {"proj:code": "EPSG:32617", "proj:shape": [HEIGHT, WIDTH], "proj:transform": list(transform(i))[:6]}
    asset = {"href": href, "bands": [{"name": n, "data_type": "uint8"} for n in ("red", "green", "blue")]}
    return {
        "type": "Feature",
        "stac_version": "1.1.0",
        "id": item_id,
        "geometry": None,
        "properties": {"datetime": "2024-05-01T00:00:00Z", **proj, **properties},
        "links": [],
        "assets": {"visual": asset},
    }


def collection(path: Path, *items: dict) -> str:
    path.write_text(json.dumps({"type": "FeatureCollection", "features": list(items)}))
    return str(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> PredictScene:
    return PredictScene.make(tmp_path_factory.mktemp("model"), 128, 128)  # an untrained RetinaNet, 128 px tiles


def predict_config(model: PredictScene, **extra) -> dict:
    predict = {"scenes": "all", "accelerator": "cpu", "devices": 1, "workers": 0, "batch_size": 4, "save_every": 0}
    return {
        "model": {"backbone": "resnet18", "file": str(model.model_file), "score_threshold": 0.0},
        "tiling": {"patch_size": 128, "overlap": 32},
        "predict": predict,
        **extra,
    }


# ---------------------------------------------------------------------------------------------------------
# The item's metadata
# ---------------------------------------------------------------------------------------------------------


def test_item_metadata_gives_the_header_the_asset_first(tmp_path):
    stac10 = item("a", "a.tif", 0, **{"proj:epsg": 32617, "proj:code": None})
    stac10["assets"]["visual"] = {
        "href": "a.tif",
        "eo:bands": [{"name": n} for n in "RGBN"],
        "raster:bands": [{"data_type": "uint16", "nodata": 0}] * 4,
        "proj:shape": [100, 50],  # the asset's own, over the item's
    }
    header = item_header(stac10, stac10["assets"]["visual"], "items.json")
    assert header is not None
    assert (header.crs, header.width, header.height, header.dtypes, header.nodata) == (
        "EPSG:32617",
        50,
        100,
        ("uint16",) * 4,
        0.0,
    )
    info = header.raster_info("a.tif")
    assert (info.count, info.crs.to_epsg(), info.transform, info.is_tiled) == (4, 32617, transform(0), True)
    bbox = item("b", "b.tif", 0, **{"proj:bbox": [X0, Y0 - 20, X0 + 30, Y0]})
    del bbox["properties"]["proj:transform"]
    bbox["assets"]["visual"] = {"href": "b.tif", "data_type": "float32", "nodata": "nan", "bands": [{"name": "h"}]}
    header = item_header(bbox, bbox["assets"]["visual"], "items.json")
    assert header is not None and header.transform == tuple(transform(0))[:6] and header.dtypes == ("float32",)
    assert header.nodata != header.nodata  # nan
    assert ItemHeader.from_dict(json.loads(json.dumps(header.to_dict()))).to_dict() == header.to_dict()
    for missing in ("proj:shape", "proj:transform", "proj:code"):
        partial = item("c", "c.tif", 0)
        del partial["properties"][missing]
        assert item_header(partial, partial["assets"]["visual"], "items.json") is None, missing
    unknown = item("e", "e.tif", 0, **{"proj:code": "NOT:A-CRS"})
    assert item_header(unknown, unknown["assets"]["visual"], "items.json") is None  # read, not trusted
    names_only = item("d", "d.tif", 0)
    names_only["assets"]["visual"] = {"href": "d.tif", "eo:bands": [{"name": "red"}]}  # no data type: not trusted
    assert item_header(names_only, names_only["assets"]["visual"], "items.json") is None
    naip = item_header(names_only, names_only["assets"]["visual"], "items.json", "uint8")  # stac.data_type: uint8
    assert naip is not None and naip.dtypes == ("uint8",) and naip.keys[3] == "stac.data_type"
    raster = write_raster(Path(tmp_path) / "d.tif", WIDTH, HEIGHT, count=1, data=np.zeros((1, HEIGHT, WIDTH), "uint16"))
    found = disagreement(naip, read_raster_header(raster))
    assert found is not None and "stac.data_type uint8 but " in found and found.endswith(" is uint16"), found


def test_a_header_that_differs_from_the_item_is_one_line_naming_the_item_and_field(tmp_path):
    raster = write_raster(tmp_path / "a.tif", WIDTH, HEIGHT, transform=transform(0))
    said = item("m_30085", str(raster), 0)
    header = item_header(said, said["assets"]["visual"], "items.json")
    assert header is not None and disagreement(header, read_raster_header(raster)) is None
    cases = {
        "proj:shape": ({"proj:shape": [WIDTH, HEIGHT]}, f"proj:shape [{WIDTH}, {HEIGHT}] but its raster "),
        "proj:code": ({"proj:code": "EPSG:32618"}, "proj:code EPSG:32618 but its raster "),
        "proj:transform": ({"proj:transform": list(transform(1))[:6]}, "proj:transform gives the transform ["),
    }
    for field, (properties, told) in cases.items():
        wrong = item("m_30085", str(raster), 0, **properties)
        line = disagreement(item_header(wrong, wrong["assets"]["visual"], "items.json"), read_raster_header(raster))
        assert line is not None and line.startswith(f"STAC item 'm_30085' of items.json: {told}"), (field, line)
    wrong = item("m_30085", str(raster), 0, **{"proj:shape": [WIDTH, HEIGHT]})
    header = item_header(wrong, wrong["assets"]["visual"], "items.json")
    record = tmp_path / "skipped/a.json"
    with pytest.raises(InputError) as err:
        verify(header, str(raster), record)
    assert str(err.value).endswith(f"is {WIDTH} x {HEIGHT} (width x height)") and "\n" not in str(err.value)
    assert recorded_skips(tmp_path / "skipped", {"a": (str(raster), header)}) == {"a": str(err.value)}
    other = item_header(said, said["assets"]["visual"], "items.json")  # the item was fixed since: not skipped
    assert recorded_skips(tmp_path / "skipped", {"a": (str(raster), other)}) == {}


# ---------------------------------------------------------------------------------------------------------
# The plan: trusted items open no raster; scenes_on_error
# ---------------------------------------------------------------------------------------------------------


def test_the_plan_trusts_proj_metadata_and_skips_what_it_cannot_read(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_raster(tmp_path / "a.tif", WIDTH, HEIGHT, transform=transform(0))
    Path("garbage.tif").write_text("not a raster")  # what a trusted item's raster is never opened to find
    items = collection(tmp_path / "items.json", item("a", "a.tif", 0), item("b", "garbage.tif", 1))
    config = predict_config(model, stac={"items": [items]})
    plan = build_plan(config, tmp_path, cache_headers=True)
    assert set(plan.trusted) == {"a", "b"} and plan.footprints["b"].bounds == (X0 + 100, Y0 - 20, X0 + 130, Y0)
    with sqlite3.connect(tmp_path / ".snakemake/rasterscale/headers.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM headers").fetchone() == (0,)  # no header read: none kept
    tiles = next(job for path, job in job_files(plan).items() if "/jobs/tiles/" in path)
    assert set(tiles.trusted) == {"a", "b"} and tiles.records.endswith("/jobs/skipped")
    broken = {"scenes": {"c": {"path": "garbage.tif"}, "d": {"path": "none.tif"}}}
    with pytest.raises(InputError, match=r"garbage\.tif: not a readable raster"):
        build_plan({**config, **broken}, tmp_path)
    warnings: list[str] = []
    plan = build_plan({**config, **broken, "scenes_on_error": "skip"}, tmp_path, warnings.append)
    assert plan.predict_scenes == ["a", "b"] and list(plan.scenes) == ["a", "b"]
    assert list(plan.skipped) == ["c", "d"] and "none.tif: raster not found" in plan.skipped["d"]
    assert warnings == [f"scene {name} is left out (scenes_on_error: skip): {plan.skipped[name]}" for name in "cd"]
    without = build_plan(config, tmp_path)
    assert {p: j.to_json() for p, j in job_files(plan).items() if "run_page" not in p} == {
        p: j.to_json() for p, j in job_files(without).items() if "run_page" not in p
    }  # the skipped scenes change no other scene's job
    with pytest.raises(InputError, match=r"predict\.scenes: every scene of it is left out"):
        build_plan({**predict_config(model), **broken, "scenes_on_error": "skip"}, tmp_path)


# ---------------------------------------------------------------------------------------------------------
# The workflow: the tile-manifest job checks what the plan trusted; a skipped scene in a real run
# ---------------------------------------------------------------------------------------------------------


def test_a_trusted_item_the_raster_disagrees_with_stops_its_tile_manifest_job_in_one_line(model, tmp_path):
    write_raster(tmp_path / "a.tif", WIDTH, HEIGHT, transform=transform(0))
    swapped = item("m_3008501_ne_16_060", "a.tif", 0, **{"proj:shape": [WIDTH, HEIGHT]})
    config = predict_config(model, stac={"items": [collection(tmp_path / "items.json", swapped)]})
    paths = run_dir(tmp_path, {"model": {"file": str(model.model_file)}})
    target = str((paths / "batches/tiles-0.json").relative_to(tmp_path))
    start = time.perf_counter()
    result = snakemake_forks.run(workflow_command(tmp_path, config, "--cores", "1", target), check=False)
    assert result.returncode != 0
    log = (tmp_path / "logs/tiles/batch-0.log").read_text().strip().splitlines()
    told = (
        f"rasterscale: STAC item 'm_3008501_ne_16_060' of {tmp_path / 'items.json'}: proj:shape [{WIDTH}, {HEIGHT}] "
        f"but its raster {tmp_path / 'a.tif'} is {WIDTH} x {HEIGHT} (width x height)"
    )
    assert log[-1] == told and not any("Traceback" in line for line in log), log
    assert (paths / "jobs/skipped/m_3008501_ne_16_060.json").exists()
    skip = snakemake_forks.run(workflow_command(tmp_path, {**config, "predict": {**config["predict"], "scenes": []},
                                                           "scenes_on_error": "skip"}, "-n"), check=False)  # fmt: skip
    assert f"rasterscale: warning: scene m_3008501_ne_16_060 is left out (scenes_on_error: skip), as its " \
        f"tile-manifest job found: {told.removeprefix('rasterscale: ')}" in skip.stderr  # fmt: skip
    report(f"a disagreeing STAC item: its tile-manifest job and a dry run: {time.perf_counter() - start:.1f} s")


def test_a_broken_scene_is_skipped_and_the_others_run_as_without_it(model, tmp_path):
    write_raster(tmp_path / "s0.tif", WIDTH, HEIGHT, transform=transform(0))
    (tmp_path / "broken.tif").write_bytes(b"II*\0not quite a tiff")
    config = predict_config(model, scenes={"s0": {"path": "s0.tif"}, "broken": {"path": "broken.tif"}})
    config["scenes_on_error"] = "skip"
    run = run_dir(tmp_path, config | {"model": {"file": str(model.model_file)}})
    merged, page = (str((run / name).relative_to(tmp_path)) for name in ("batches/merge-0.json", "report/run.html"))
    start = time.perf_counter()
    result = run_workflow(tmp_path, config, merged, page)  # the layers and the run's page (no scores, no maps)
    seconds = time.perf_counter() - start
    assert re.findall(r"^rasterscale: warning: scene (\w+) is left out .*$", result.stderr, flags=re.M) == ["broken"]
    assert "broken.tif: not a readable raster" in (run / "report/run.html").read_text()  # the report lists it
    assert not (run / "broken").exists()
    layer = gpd.read_file(run / "s0/detections.gpkg")
    assert len(layer) > 0 and layer.crs.to_epsg() == 32617
    # The config without the broken scene finds every layer up to date (its jobs' files are the same): its run would
    # write the same layers; only the report's run page, which lists the skipped scene, is made again.
    del config["scenes"]["broken"], config["scenes_on_error"]
    assert jobs_planned(tmp_path, config, merged, page) == {"report_run_page": 1}
    report(f"scenes_on_error: skip, a broken scene beside a good one (a real run): {seconds:.1f} s")


def test_a_collection_is_read_one_item_at_a_time_as_json_reads_it_whole(tmp_path):
    items = [item(f"i{k}", f"r{k}.tif", k) for k in range(3)]
    layouts = {
        "compact.json": json.dumps({"type": "FeatureCollection", "features": items}, separators=(",", ":")),
        "indented.json": json.dumps({"features": items, "links": [], "type": "FeatureCollection"}, indent=2),
        "empty.json": ' { "type" : "FeatureCollection" , "features" : [ ] } \n',
        "one.json": json.dumps(items[0], indent=1),
    }
    for name, text in layouts.items():
        (tmp_path / name).write_text(text)
        assert read_items(str(tmp_path / name)) == json.loads(text).get("features", [json.loads(text)]), name
    bad = {
        "cut.json": json.dumps({"type": "FeatureCollection", "features": items})[:-30],
        "list.json": json.dumps(items),
        "typed.json": json.dumps({"type": "Catalog", "features": items}),
        "extra.json": json.dumps({"type": "Feature", **items[0]}) + "{}",
    }
    told = {"cut.json": "is not JSON (", "list.json": "type is None", "typed.json": "type is 'Catalog'"}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(InputError) as err:
            read_items(str(tmp_path / name))
        assert told.get(name, "is not JSON (Extra data") in str(err.value) and "\n" not in str(err.value), name
