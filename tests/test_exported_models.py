"""A model from the user's own code, brought as an exported file (TorchScript, torch.export, ONNX) with its model
card: the real workflow predicts with each form on 1 and 2 CPU ranks, and each layer is what the plain PyTorch
module gives tile by tile; a regression file's values and a coarser output are brought back to the tiles; and
every bad file or card stops the dry run with one line naming the file and both shapes."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import rasterio
import torch
import yaml
from rasterio.windows import Window
from scipy import ndimage

import snakemake_forks
from pointblobs import HeatmapNet, blob_centres, blob_scene
from rasterscale.errors import InputError
from rasterscale.settings import job_settings
from rasterscale.tasks.exported.card import ModelCard, card_path
from rasterscale.tasks.exported.runtime import load_exported
from rasterscale.tasks.regression.spec import CARD as REGRESSION_CARD
from rasterscale.tasks.regression.spec import regression_model
from rasterscale.workflow.checks import build_plan
from workflow import rank_stems, run_dir, run_paths, run_workflow, workflow_command

PATCH, OVERLAP = 64, 16
WIDTH, HEIGHT = 224, 160
BANDS = ["red", "green", "blue", "nir"]
MEAN, STD = [110.0, 100.0, 90.0, 120.0], [40.0, 35.0, 30.0, 45.0]


class OwnNet(torch.nn.Module):
    """A dense network as a user's own code writes it: normalized bands in, a channel per class (or value) out."""

    def __init__(self, bands: int = 4, outputs: int = 2, stride: int = 1) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(bands, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 5, padding=2, stride=stride),
            torch.nn.ReLU(),
        )
        self.head = torch.nn.Conv2d(8, outputs, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def make_net(seed: int = 0, **kwargs: int) -> OwnNet:
    torch.manual_seed(seed)
    net = OwnNet(**kwargs).eval()
    with torch.no_grad():
        net.head.bias.copy_(torch.linspace(-0.2, 0.2, net.head.out_channels))
    return net


def smooth_raster(path: Path, count: int = 4) -> Path:
    """Smooth 4-band imagery (red, green, blue, near infrared; blobs a few tiles wide): class maps of a random
    network with real regions."""
    coarse = np.random.default_rng(3).uniform(20, 230, size=(count, HEIGHT // 16, WIDTH // 16))
    data = np.clip(ndimage.zoom(coarse, (1, 16, 16), order=3), 0, 255).astype(np.uint8)
    profile = {"driver": "GTiff", "width": WIDTH, "height": HEIGHT, "count": count, "dtype": "uint8"}
    profile.update(crs="EPSG:32617", transform=rasterio.Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0))
    with rasterio.open(path, "w", photometric="MINISBLACK", **profile) as dst:
        dst.write(data)
    return path


def card(**overrides: object) -> dict:
    base = {
        "task": "segmentation",
        "labels": ["background", "tree"],
        "bands": BANDS,
        "input": "raw",
        "normalize": {"mean": MEAN, "std": STD},
        "tile_size": PATCH,
        "output": "logits",
    }
    return {**base, **overrides}


def export(net: torch.nn.Module, path: Path, form: str, card_keys: dict | None = None, batch: int = 2) -> Path:
    example = torch.rand(batch, net.features[0].in_channels, PATCH, PATCH)
    with torch.no_grad():
        if form == "torchscript":
            torch.jit.save(torch.jit.trace(net, example), str(path))
        elif form == "torch.export":
            dynamic = {"x": {0: torch.export.Dim("batch", min=1, max=1024)}}
            torch.export.save(torch.export.export(net, (example,), dynamic_shapes=dynamic), str(path))
        else:
            torch.onnx.export(
                net,
                (example,),
                str(path),
                input_names=["image"],
                output_names=["logits"],
                dynamo=True,
                external_data=False,
                dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
            )
    if card_keys is not None:
        card_path(path).write_text(yaml.safe_dump(card_keys))
    return path


FILES = {"torchscript": "net.torchscript.pt", "torch.export": "net.pt2", "onnx": "net.onnx"}


def normalized(pixels: torch.Tensor) -> torch.Tensor:
    return (pixels - torch.tensor(MEAN).view(1, 4, 1, 1)) / torch.tensor(STD).view(1, 4, 1, 1)


def balanced_net(raster: Path) -> OwnNet:
    """The seeded network, its tree logit shifted so that half the scene's pixels are trees."""
    net = make_net()
    with rasterio.open(raster) as src, torch.no_grad():
        logits = net(normalized(torch.from_numpy(src.read().astype(np.float32))[None]))
        net.head.bias[1] -= (logits[0, 1] - logits[0, 0]).median()
    return net


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The scene, the user's network (its weights in net.state.pt) and its three exported files with cards."""
    folder = tmp_path_factory.mktemp("exported")
    net = balanced_net(smooth_raster(folder / "scene.tif"))
    torch.save(net.state_dict(), folder / "net.state.pt")
    for form, name in FILES.items():
        export(net, folder / name, form, card())
    return folder


def reference_classes(raster: Path, manifest: Path) -> tuple[np.ndarray, np.ndarray]:
    """The plain module's classes tile by tile (the test's own loop: raw values, the card's normalization), kept
    where exactly one tile covers a pixel; and that mask."""
    import geopandas as gpd

    net = make_net()
    net.load_state_dict(torch.load(raster.parent / "net.state.pt"))
    tiles = gpd.read_parquet(manifest)
    classes = np.zeros((HEIGHT, WIDTH), np.uint8)
    cover = np.zeros((HEIGHT, WIDTH), np.int32)
    with rasterio.open(raster) as src, torch.inference_mode():
        for tile in tiles.itertuples():
            window = Window(tile.col_off, tile.row_off, tile.width, tile.height)
            pixels = src.read(window=window, boundless=True, fill_value=0).astype(np.float32)
            logits = net(normalized(torch.from_numpy(pixels)[None]))
            rows = slice(tile.row_off, tile.row_off + tile.height)
            cols = slice(tile.col_off, tile.col_off + tile.width)
            inside = (slice(0, min(HEIGHT, rows.stop) - rows.start), slice(0, min(WIDTH, cols.stop) - cols.start))
            classes[rows, cols] = logits.argmax(1)[0].numpy()[inside]
            cover[rows, cols] += 1
    return classes, cover == 1


def predict_config(data: Path, model_file: Path, devices: int, **model: object) -> dict:
    return {
        "task": "segmentation",
        "scenes": {"scene": {"path": str(data / "scene.tif"), "bands": [1, 2, 3, 4]}},
        "tiling": {"patch_size": PATCH, "overlap": OVERLAP},
        "model": {"file": str(model_file), **model},
        "train": {"scenes": []},
        "predict": {"scenes": ["scene"], "devices": devices, "batch_size": 3, "workers": 0, "precision": "32-true"},
    }


def classes_of(run: Path) -> np.ndarray:
    """The class map of a run (its folder, results/{run}/)."""
    with rasterio.open(run / "scene/classes.tif") as src:
        return src.read(1)


# form -> the rank counts the real workflow predicts it with
RUNS = {"torchscript": (1,), "torch.export": (2,), "onnx": (2,)}
# form -> its run (no model.name: the file's stem, as a scene name)
RUN_NAMES = {"torchscript": "net_torchscript", "torch.export": "net", "onnx": "net"}


def test_each_form_predicts_the_plain_modules_classes_on_1_and_2_ranks(data, tmp_path):
    """Every form, through the real workflow (the card checked at dry run, ranks over gloo, blending, merge): the
    same class map whatever the form and the rank count, and where one tile covers a pixel, exactly the class the
    plain module gives that tile."""
    maps = {}
    for form, ranks in RUNS.items():
        for devices in ranks:
            workdir = tmp_path / f"{form}-{devices}"
            config = predict_config(data, data / FILES[form], devices)
            run = run_dir(workdir, config)
            assert run == workdir / "results" / RUN_NAMES[form]
            run_workflow(workdir, config, run_paths(config).scene_file("scene", "classes.tif"))
            maps[form, devices] = classes_of(run)
            assert len(rank_stems(run, "scene", ".tif")) == devices
            log = "".join(path.read_text() for path in (workdir / "logs/predict").glob("**/*.log"))
            assert f"exported {form} file, segmentation: logits of [background, tree], {PATCH} px tiles" in log
    reference, single = reference_classes(data / "scene.tif", run / "scene/tiles.parquet")
    assert 0.3 < single.mean() < 0.7 and 0.2 < reference[single].mean() < 0.8  # both classes, both kinds of pixel
    first = maps["onnx", 2]
    for key, classes in maps.items():
        assert np.array_equal(classes[single], reference[single]), key
        agreement = float((classes == first).mean())
        print(f"\n{key}: {agreement:.5%} of pixels equal to ONNX on 2 ranks")
        assert agreement >= 0.999, key  # overlaps blend probabilities: float32 rounding of ONNX Runtime vs torch


def test_a_regression_file_gives_its_values_and_a_coarser_output_is_brought_to_the_tiles(data, tmp_path):
    """A regression card (values), checked at dry run through the task's spec; a file whose output is at half
    resolution (output_stride 2) is upsampled back to the tile (bilinear), as its card says."""
    net = make_net(seed=1, outputs=1, stride=2)
    path = export(net, tmp_path / "height.onnx", "onnx")
    keys = card(task="regression", labels=["height"], output="values", output_stride=2)
    config = {"task": "regression", "model": {"file": str(path), "card": keys}, "tiling": {"patch_size": PATCH}}
    model_card = regression_model(job_settings(config))
    assert isinstance(model_card, ModelCard) and model_card.source == "model.card" and model_card.outputs == 1
    model = load_exported(model_card)
    tiles = torch.rand(5, 4, PATCH, PATCH) * 255  # 5 tiles: the file's batch is dynamic
    with torch.inference_mode():
        values = model(tiles)
        plain = net(normalized(tiles))
    assert values.shape == (5, 1, PATCH, PATCH) and plain.shape == (5, 1, PATCH // 2, PATCH // 2)
    expected = torch.nn.functional.interpolate(plain, size=(PATCH, PATCH), mode="bilinear", align_corners=False)
    assert torch.allclose(values, expected, atol=1e-4)
    with pytest.raises(InputError, match=re.escape("key 'output' is 'logits'; a regression model gives values")):
        regression_model(job_settings({**config, "model": {**config["model"], "card": {**keys, "output": "logits"}}}))
    assert REGRESSION_CARD.outputs == ("values",)


def test_a_file_of_fixed_batch_size_gets_its_batches_cut_and_padded(data, tmp_path):
    """An ONNX file exported with a fixed batch of 2 predicts 5 tiles: 2 + 2 + 1 (padded), the same values."""
    net = make_net()
    path = tmp_path / "fixed.onnx"
    with torch.no_grad():
        torch.onnx.export(net, (torch.rand(2, 4, PATCH, PATCH),), str(path), dynamo=True, external_data=False)
    config = predict_config(data, path, 1, card=card())
    model = load_exported(regression_or_segmentation_card(config))
    assert model.fixed_batch == 2
    tiles = torch.rand(5, 4, PATCH, PATCH) * 255
    with torch.inference_mode():
        got = model(tiles)
        plain = net(normalized(tiles))
    assert torch.allclose(got, plain, atol=1e-4)


class FlatteningNet(OwnNet):
    """A user's network whose own code reshapes its input with ``view`` (as attention blocks do): channels_last input
    makes it raise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(x.shape[0], -1)
        return self.head(self.features(flat.view(x.shape)))


class StridesNet(OwnNet):
    """A network whose output depends on its input's strides (a contiguous copy where it is not contiguous)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.features(x))
        return out + 1.0 if not x.is_contiguous() else out


def test_an_exported_file_takes_channels_last_batches_only_where_its_output_stays_the_same(data, tmp_path):
    """predict.channels_last takes effect for TorchScript and torch.export files (their input batches made
    channels_last, the same logits), not for ONNX (its runtime lays out its input itself), and not for a file whose
    code fails on such strides or answers them otherwise (contiguous batches, the same logits as the plain module)."""
    tiles = torch.rand(3, 4, PATCH, PATCH) * 255
    net = make_net()
    net.load_state_dict(torch.load(data / "net.state.pt", weights_only=True))  # the files' network
    own: dict[str, torch.nn.Module] = {}
    for name, kind in (("view", FlatteningNet), ("strides", StridesNet)):
        own[name] = kind().eval()
        own[name].load_state_dict(net.state_dict())
    scripted = tmp_path / "strides.torchscript.pt"  # scripted, not traced: a trace fixes the branch it took
    torch.jit.save(torch.jit.script(own["strides"]), str(scripted))
    card_path(scripted).write_text(yaml.safe_dump(card()))
    cases = {
        "torchscript": (data / FILES["torchscript"], True),
        "torch.export": (data / FILES["torch.export"], True),
        "onnx": (data / FILES["onnx"], False),
        "view": (export(own["view"], tmp_path / "view.torchscript.pt", "torchscript", card()), False),
        "strides": (scripted, False),
    }
    with torch.inference_mode():
        strided = tiles.contiguous(memory_format=torch.channels_last)
        # armed: those two files do fail on, or answer otherwise to, a channels_last batch
        with pytest.raises(RuntimeError, match="view"):
            torch.jit.load(str(cases["view"][0]))(strided)
        assert not torch.allclose(torch.jit.load(str(scripted))(strided), torch.jit.load(str(scripted))(tiles))
        for name, (path, expected) in cases.items():
            model = load_exported(regression_or_segmentation_card(predict_config(data, path, 1)))
            assert model.prepare(channels_last=False).channels_last is False, name
            assert model.prepare(channels_last=True).channels_last is expected, name
            reference = own.get(name, net)(normalized(tiles))
            assert torch.allclose(model(tiles), reference, atol=1e-4), name


def regression_or_segmentation_card(config: dict) -> ModelCard:
    from rasterscale.tasks.segmentation.spec import segmentation_model

    found = segmentation_model(job_settings({key: config[key] for key in ("task", "model", "tiling", "train")}))
    assert isinstance(found, ModelCard)
    return found


def truncated(source: Path, path: Path) -> Path:
    path.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    return path


def newer_export(source: Path, path: Path) -> Path:
    """The same .pt2 as a newer torch writes it: its serialization schema one major version up."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(path, "w") as new:
        for item in old.infolist():
            content = old.read(item)
            if item.filename.endswith("models/model.json"):
                program = json.loads(content)
                program["schema_version"]["major"] += 1
                program["torch_version"] = "2.99.0"
                content = json.dumps(program).encode()
            new.writestr(item, content)
    return path


def dynamic_output(source: Path, path: Path) -> Path:
    """The same ONNX file whose output is reshaped to a shape computed while it runs: no shape inference can tell
    its dimensions (symbols only), as with data-dependent outputs."""
    import onnx
    from onnx import helper

    model = onnx.load(str(source))
    graph = model.graph
    name = graph.output[0].name
    for node in graph.node:
        node.output[:] = ["computed" if output == name else output for output in node.output]
    graph.node.extend(
        [
            helper.make_node("Shape", ["computed"], ["its_shape"]),
            helper.make_node("Reshape", ["computed", "its_shape"], [name]),
        ]
    )
    dims = graph.output[0].type.tensor_type.shape.dim
    del dims[:]
    for symbol in ("batch", "classes", "height", "width"):
        dims.add().dim_param = symbol
    onnx.save(model, str(path))
    return path


def state_dict_file(path: Path) -> Path:
    torch.save(make_net().state_dict(), path)
    return path


def three_band_card(data: Path, path: Path) -> Path:
    path.write_bytes((data / FILES["onnx"]).read_bytes())
    card_path(path).write_text(yaml.safe_dump(card(bands=BANDS[:3], normalize={"mean": MEAN[:3], "std": STD[:3]})))
    return path


# case -> (make the model file in the data folder D and a scratch folder T, its card (None: one beside it), the line)
BAD_FILES = {
    "a truncated ONNX file": (
        lambda d, t: truncated(d / FILES["onnx"], t / "cut.onnx"),
        card(),
        "T/cut.onnx: not a readable ONNX model \\(.*\\)",
    ),
    "a TorchScript file that is really a state dict": (
        lambda d, t: state_dict_file(t / "weights.pt"),
        card(),
        "T/weights.pt: not a TorchScript file: a torch.save file \\(a state dict or a pickled model\\?\\); save the "
        "model with torch.jit.save\\(torch.jit.script\\(model\\) or torch.jit.trace\\(model, example\\)\\), or export "
        "it to .pt2 or .onnx",
    ),
    "a card that names 3 bands where the file takes 4": (
        lambda d, t: three_band_card(d, t / "rgb.onnx"),
        None,
        "T/rgb.onnx: the file takes 4 bands \\(input \\(\\?, 4, 64, 64\\)\\) but the card names 3 \\(red, green, "
        "blue\\): \\(batch, 3, 64, 64\\)",
    ),
    "an output channel count other than the card's classes": (
        lambda d, t: export(make_net(), t / "two.pt2", "torch.export"),
        card(labels=["background", "tree", "shrub"]),
        "T/two.pt2: the card promises output \\(1, 3, 64, 64\\) \\(3 logits at stride 1\\) for input \\(1, 4, 64, "
        "64\\), but the file gives \\(1, 2, 64, 64\\)",
    ),
    "an ONNX output of a dynamic shape the card cannot resolve": (
        lambda d, t: dynamic_output(d / FILES["onnx"], t / "dynamic.onnx"),
        card(),
        "T/dynamic.onnx: output 'logits' has a dynamic shape \\['batch', 'classes', 'height', 'width'\\] the card "
        "cannot resolve: a dense model's output is \\(batch, 2 logits, height, width\\) with a fixed channel count",
    ),
    "a .pt2 from a newer torch": (
        lambda d, t: newer_export(d / FILES["torch.export"], t / "newer.pt2"),
        card(),
        "T/newer.pt2: a torch.export program from a newer torch \\(2.99.0, schema \\d+.\\d+\\) than this one "
        "\\(2.14.1.*, schema \\d+.\\d+\\): export it again with torch 2.14.1, or to ONNX",
    ),
    "no card": (
        lambda d, t: export(make_net(), t / "bare.pt2", "torch.export"),
        None,
        "T/bare.pt2: an exported torch.export model needs a model card: write bare.pt2.yaml beside it .*",
    ),
    "a key that builds a network, beside an exported file": (
        lambda d, t: d / FILES["onnx"],
        {"__model": {"encoder": "resnet50"}},  # the card beside the file
        "model.encoder: does not apply to an exported model \\(D/net.onnx\\): its card \\(D/net.onnx.yaml\\) says "
        "what it takes and gives; leave the key out",
    ),
    "a card of another task": (
        lambda d, t: export(make_net(), t / "other.pt2", "torch.export"),
        card(task="regression"),
        "model.card: the card is for task 'regression', but the config's task is segmentation",
    ),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_exported_file_stops_the_plan_in_one_line(data, tmp_path, case):
    """What the dry run checks of an exported file against its card (build_plan is what `snakemake -n` runs; the
    test below shows the wiring): one line naming the file, both shapes where shapes differ."""
    make, card_keys, expected = BAD_FILES[case]
    path = make(data, tmp_path)
    card_keys = dict(card_keys) if card_keys is not None else None
    model = card_keys.pop("__model", {}) if card_keys is not None else {}
    if card_keys:
        model["card"] = card_keys
    with pytest.raises(InputError) as raised:
        build_plan(predict_config(data, path, 1, **model), tmp_path / "run")
    pattern = expected.replace("T/", re.escape(str(tmp_path)) + "/").replace("D/", re.escape(str(data)) + "/")
    assert re.fullmatch(pattern, str(raised.value)), str(raised.value)


def test_a_bad_exported_file_stops_snakemake_n_in_one_line(data, tmp_path):

    path = truncated(data / FILES["onnx"], tmp_path / "cut.onnx")
    config = predict_config(data, path, 1, card=card())
    result = snakemake_forks.run(workflow_command(tmp_path / "run", config, "-n"))
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("rasterscale:")]
    assert len(lines) == 1 and lines[0].startswith(f"rasterscale: {path}: not a readable ONNX model ("), result.stderr


def test_an_exported_file_cannot_start_training(data, tmp_path):
    config = predict_config(data, data / FILES["onnx"], 1)
    config["model"] = {"file": ""}
    config["train"] = {"scenes": ["scene"], "init": str(data / FILES["onnx"])}
    config["scenes"]["scene"]["annotations"] = str(data / "none.gpkg")
    with pytest.raises(InputError, match=r"train.init is an exported model: exported files .* predict only"):
        regression_or_segmentation_card(config)


def test_rasterscale_exports_its_own_models_with_their_cards(tmp_path):
    """scripts/export_model.py (rasterscale.tools.export): a segmenter and a point model to ONNX and a regressor to
    torch.export, each with a card that the dry run accepts and with the file's outputs (the exported network
    normalizes its input itself); a file that is no rasterscale model is refused in one line."""
    from rasterscale.raster.bands import InputBands
    from rasterscale.tasks.points.model import build_points_model, save_points_model
    from rasterscale.tasks.points.modelfiles import PointsConfig
    from rasterscale.tasks.points.spec import points_model
    from rasterscale.tasks.registry import task_spec
    from rasterscale.tasks.regression.model import build_regressor, save_regressor
    from rasterscale.tasks.regression.modelfiles import RegressorConfig
    from rasterscale.tasks.segmentation.model import build_segmenter, save_segmenter
    from rasterscale.tasks.segmentation.modelfiles import SegmenterConfig
    from rasterscale.tasks.segmentation.spec import segmentation_model
    from rasterscale.tools.export import export_model

    torch.manual_seed(0)
    bands = InputBands(tuple(BANDS), tuple(MEAN), tuple(STD), raw=True)
    segmenter = SegmenterConfig(("background", "tree"), patch_size=PATCH, input=bands)
    regressor = RegressorConfig(("height",), patch_size=PATCH, input=bands, target_mean=(12.0,), target_std=(4.0,))
    save_segmenter(build_segmenter(segmenter), segmenter, tmp_path / "seg.pt")
    save_regressor(build_regressor(regressor), regressor, tmp_path / "reg.pt")
    points = PointsConfig(("tree",), patch_size=PATCH, input=bands)
    save_points_model(build_points_model(points), points, tmp_path / "points.pt")
    tiles = torch.rand(3, 4, PATCH, PATCH) * 255
    labels = {"segmentation": ["background", "tree"], "regression": ["height"], "points": ["tree"]}
    outputs = {"segmentation": "logits", "regression": "values", "points": "logits"}
    for task, native, exported, find in (
        ("segmentation", "seg.pt", "seg.onnx", segmentation_model),
        ("regression", "reg.pt", "reg.pt2", regression_model),
        ("points", "points.pt", "points.onnx", points_model),
    ):
        card_file = export_model(tmp_path / native, tmp_path / exported)
        assert yaml.safe_load(card_file.read_text()) == {
            "task": task,
            "labels": labels[task],
            "bands": BANDS,
            "input": "raw",
            "tile_size": PATCH,
            "output": outputs[task],
        }
        config = {"task": task, "model": {"file": str(tmp_path / exported)}, "tiling": {"patch_size": PATCH}}
        model_card = find(job_settings(config))  # the dry run's check of the card against the file
        native_model = task_spec(task).load().load_model(tmp_path / native, job_settings({"task": task, "model": {}}))
        reference = native_model[0].eval()
        with torch.inference_mode():
            expected, got = reference(tiles), load_exported(model_card)(tiles)
        assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-3), task
    with pytest.raises(InputError, match="not a rasterscale model file"):
        export_model(tmp_path / "seg.onnx", tmp_path / "again.onnx")


def test_an_onnx_heatmap_file_is_read_through_its_points_card_as_the_logits_of_its_heatmap(tmp_path):
    """A points card (output: heatmap) on an ONNX file, checked at dry run through the task's spec: the file's
    heatmap comes back as its logits (which the task's sigmoid maps back to the heatmap, as it does a point model's
    own logits), peaks at the blobs' centres included; a segmentation card saying heatmap is refused in one line.
    (The same file through the real workflow, across scene borders: tests/test_points_workflow.py.)"""
    from rasterscale.tasks.points.spec import points_model
    from rasterscale.tasks.segmentation.spec import segmentation_model

    centres = blob_centres(WIDTH, HEIGHT)
    with rasterio.open(blob_scene(tmp_path / "blobs.tif", WIDTH, HEIGHT, centres)) as src:
        tiles = torch.from_numpy(src.read(window=Window(0, 0, PATCH, PATCH)).astype(np.float32))[None]
    net = HeatmapNet().eval()
    keys = {**card(task="points", labels=["tree"], output="heatmap", input="scaled"), "normalize": None}
    path = export(net, tmp_path / "tops.onnx", "onnx", {k: v for k, v in keys.items() if v is not None})
    config = {"task": "points", "model": {"file": str(path)}, "tiling": {"patch_size": PATCH}, "train": {}}
    model_card = points_model(job_settings(config))
    assert isinstance(model_card, ModelCard) and model_card.output == "heatmap" and model_card.labels == ("tree",)
    with torch.inference_mode():
        heat, logits = net(tiles / 255), load_exported(model_card)(tiles / 255)  # tiles as the task scales them
    assert logits.shape == heat.shape == (1, 1, PATCH, PATCH)
    assert torch.allclose(torch.sigmoid(logits), heat, atol=1e-5)
    inside = centres[(centres < PATCH - 4).all(axis=1)]  # whole blobs in the tile
    assert len(inside) >= 9 and (heat[0, 0, inside[:, 1], inside[:, 0]] > 0.9).all()  # the blobs' peaks
    bare = tmp_path / "bare.onnx"  # the file without its card beside it
    bare.write_bytes(path.read_bytes())
    wrong = {"task": "segmentation", "model": {"file": str(bare), "card": card(output="heatmap")}}
    with pytest.raises(InputError, match=re.escape("key 'output' is 'heatmap'; a segmentation model gives")):
        segmentation_model(job_settings({**wrong, "tiling": {"patch_size": PATCH}}))
