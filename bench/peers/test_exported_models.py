"""A TorchGeo segmentation model exported as TorchScript, a ``torch.export`` program and ONNX predicts a raster through
rasterscale's workflow as TorchGeo's model does on each tile.

The model is built with TorchGeo's own API (``SemanticSegmentationTask(model="unet", backbone="resnet18",
weights=None, ...).model``: an smp U-Net on a ResNet-18, random weights, eval mode), exported three ways (dynamic
batch dimension) and given to rasterscale as ``model.file`` with its model card ``<file>.yaml`` beside it: RGB
tiles scaled to [0, 1], ImageNet's mean and std applied by rasterscale before the file, logits out. The workflow
runs in rasterscale's own environment (``.venv/bin/snakemake``, 2 CPU ranks over gloo, fp32) on a 640 x 576 px
GeoTIFF cut into 3 x 3 tiles of 256 px overlapping by 64 px (the last row and column flush with the raster's edge).

The reference is plain PyTorch: this file's own loop reads each tile window with rasterio, scales and normalizes it
as the card says, runs the TorchGeo model (eager) and takes the softmax.

- Where one tile alone covers a pixel (computed from the tile windows, which must equal the workflow's manifest),
  rasterscale's class is that tile's argmax: identical, except at near-ties (the two classes' probabilities within
  :data:`NEAR_TIE`), where the forms' float rounding (ONNX Runtime's kernels against PyTorch's) may pick the
  other class; every differing pixel must be such a near-tie.
- Where tiles overlap, rasterscale blends the tiles' probabilities with weights that fall as sin² over ``overlap`` px
  towards a tile's inner edges (floored at 1e-3; docs of ``rasterscale.tasks.blending``): the reference blends its
  own tiles so, and the classes agree on at least 99.9 % of those pixels.
- ``probabilities.tif`` (round(p * 255)) is within 1 of the reference's probability everywhere.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import geopandas as gpd
import numpy as np
import onnx
import onnxruntime
import pytest
import rasterio
import torch
import yaml
from rasterio.windows import Window
from torchgeo.trainers import SemanticSegmentationTask

from conftest import RASTERSCALE_BIN, REPO, report, write_scene

WIDTH, HEIGHT = 640, 576
PATCH, OVERLAP = 256, 64
LABELS = ["background", "tree"]
BANDS = ["red", "green", "blue"]
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # ImageNet's, as smp's and TorchGeo's RGB encoders take
NEAR_TIE = 1e-4  # |p(tree) - p(background)| below this: the class is a float rounding away from the other
PREDICT = {"scenes": "all", "devices": 2, "accelerator": "cpu", "batch_size": 3, "workers": 0}
PREDICT |= {"precision": "32-true", "probabilities": True}
FORMS = {"torchscript": "unet.pt", "torch.export": "unet.pt2", "onnx": "unet.onnx"}  # a .pt with a card: TorchScript

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def torchgeo_unet() -> torch.nn.Module:
    torch.manual_seed(0)
    task = SemanticSegmentationTask(model="unet", backbone="resnet18", weights=None, in_channels=3, num_classes=2)
    return task.model.eval()


CARD = {  # the model card of each export: what the file does not say itself
    "task": "segmentation",
    "labels": LABELS,
    "bands": BANDS,
    "input": "scaled",
    "normalize": {"mean": MEAN, "std": STD},
    "tile_size": PATCH,
    "output": "logits",
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, torchgeo_unet: torch.nn.Module) -> dict[str, Path]:
    """The TorchGeo U-Net as each form, its card beside it (``<file>.yaml``); the batch dimension dynamic."""
    folder = tmp_path_factory.mktemp("models")
    example = (torch.rand(2, 3, PATCH, PATCH),)
    batch = torch.export.Dim("batch", min=1, max=64)
    files = {form: folder / name for form, name in FORMS.items()}
    with torch.no_grad():
        torch.jit.save(torch.jit.trace(torchgeo_unet, example), files["torchscript"])
    torch.export.save(torch.export.export(torchgeo_unet, example, dynamic_shapes=({0: batch},)), files["torch.export"])
    torch.onnx.export(
        torchgeo_unet,
        example,
        files["onnx"],
        input_names=["image"],
        output_names=["logits"],
        dynamic_shapes=({0: batch},),
        dynamo=True,
    )
    for path in files.values():
        Path(f"{path}.yaml").write_text(yaml.safe_dump(CARD, sort_keys=False))
    return files


def test_each_export_gives_the_torchgeo_models_logits(
    exported: dict[str, Path], torchgeo_unet: torch.nn.Module
) -> None:
    """Each file, loaded by its own runtime, on a batch of another size than the one it was exported with: the
    eager model's logits (PyTorch's forms bit for bit; ONNX Runtime within float rounding)."""
    images = torch.rand(3, 3, PATCH, PATCH)
    with torch.inference_mode():
        expected = torchgeo_unet(images).numpy()
        outputs = {
            "torchscript": torch.jit.load(exported["torchscript"])(images).numpy(),
            "torch.export": torch.export.load(exported["torch.export"]).module()(images).numpy(),
        }
    graph = onnx.load(exported["onnx"]).graph
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param, "the ONNX file's batch dimension is not dynamic"
    session = onnxruntime.InferenceSession(exported["onnx"], providers=["CPUExecutionProvider"])
    outputs["onnx"] = session.run(None, {"image": images.numpy()})[0]
    for form, output in outputs.items():
        assert output.shape == (3, len(LABELS), PATCH, PATCH), form
        error = float(np.abs(output - expected).max())
        report(f"[{form}] max |logit - TorchGeo eager logit| on a batch of 3: {error:.2e}")
        assert error <= (1e-4 if form == "onnx" else 1e-5), form


def tile_offsets(length: int) -> list[int]:
    """Tile starts along one axis: stride patch - overlap, the last tile flush with the raster's edge (rasterscale's
    documented grid, recomputed here)."""
    starts = list(range(0, length - PATCH, PATCH - OVERLAP))
    return [*starts, length - PATCH]


def tile_windows() -> list[Window]:
    return [Window(c, r, PATCH, PATCH) for r in tile_offsets(HEIGHT) for c in tile_offsets(WIDTH)]


def taper(offset: int, length: int) -> np.ndarray:
    """A tile's blending weights along one axis: sin² over ``OVERLAP`` px from each edge that is not the raster's."""
    weights = np.ones(PATCH)
    ramp = np.sin(np.pi / 2 * (np.arange(OVERLAP) + 0.5) / OVERLAP) ** 2
    if offset > 0:
        weights[:OVERLAP] *= ramp
    if offset + PATCH < length:
        weights[PATCH - OVERLAP :] *= ramp[::-1]
    return weights


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scene(tmp_path_factory.mktemp("scene") / "scene.tif", WIDTH, HEIGHT, seed=3)


@pytest.fixture(scope="module")
def reference(scene: Path, torchgeo_unet: torch.nn.Module) -> dict[str, np.ndarray]:
    return reference_maps(scene, torchgeo_unet)


def reference_maps(scene: Path, torchgeo_unet: torch.nn.Module) -> dict[str, np.ndarray]:
    """The TorchGeo model run by plain PyTorch code on each tile window: ``cover`` (tiles covering each pixel),
    ``single`` (the probabilities of the one tile covering a pixel, NaN elsewhere) and ``blended`` (the tiles'
    probabilities blended with the taper weights), each (2, H, W) but cover."""
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (MEAN, STD))
    cover = np.zeros((HEIGHT, WIDTH), dtype=np.int64)
    sums = np.zeros((2, HEIGHT, WIDTH))
    weights = np.zeros((HEIGHT, WIDTH))
    single = np.full((2, HEIGHT, WIDTH), np.nan, dtype=np.float32)
    with rasterio.open(scene) as src, torch.inference_mode():
        for window in tile_windows():
            tile = torch.from_numpy(src.read(window=window)).float().unsqueeze(0) / 255
            probabilities = torch.softmax(torchgeo_unet((tile - mean) / std), dim=1)[0].numpy()
            rows, cols = window.toslices()
            cover[rows, cols] += 1
            single[:, rows, cols] = probabilities
            weight = np.maximum(np.outer(taper(window.row_off, HEIGHT), taper(window.col_off, WIDTH)), 1e-3)
            sums[:, rows, cols] += weight * probabilities
            weights[rows, cols] += weight
    single[:, cover != 1] = np.nan
    return {"cover": cover, "single": single, "blended": (sums / weights).astype(np.float32)}


def run_workflow(workdir: Path, config: dict, *targets: str) -> float:
    """The real workflow in rasterscale's own environment on 2 cores; its wall time. A failure raises with the
    tails of every log."""
    workdir.mkdir(parents=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    command = [str(RASTERSCALE_BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile")]
    command += ["--directory", str(workdir), "--configfile", str(workdir / "config.yaml"), "--cores", "2", *targets]
    env = {**os.environ, "PATH": f"{RASTERSCALE_BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VIRTUAL_ENV", None)
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, check=False)
    if result.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(workdir.glob("logs/**/*.log")))
        raise AssertionError(f"workflow failed ({result.returncode}):\n{result.stderr[-4000:]}\n{logs}")
    return time.perf_counter() - start


@pytest.mark.parametrize("form", FORMS)
def test_the_workflow_predicts_the_raster_as_torchgeo_on_each_tile(
    form: str, exported: dict[str, Path], scene: Path, reference: dict[str, np.ndarray], tmp_path: Path
) -> None:
    config = {
        "task": "segmentation",
        "tiling": {"patch_size": PATCH, "overlap": OVERLAP},
        "model": {"file": str(exported[form])},
        "scenes": {"scene": {"path": str(scene)}},
        "predict": PREDICT,
    }
    run = "results/unet"  # the run: the model file's stem (no model.name), unet for every form
    results = tmp_path / "run" / run / "scene"
    wall = run_workflow(tmp_path / "run", config, f"{run}/scene/classes.tif", f"{run}/scene/probabilities.tif")

    # the same tile windows as the reference's
    manifest = gpd.read_parquet(results / "tiles.parquet")
    windows = sorted(zip(manifest.col_off, manifest.row_off, manifest.width, manifest.height, strict=True))
    assert windows == sorted((w.col_off, w.row_off, w.width, w.height) for w in tile_windows())
    ranks = list((tmp_path / "run" / run / "predict").glob("batch-*/shard-*/scene/rank-*.tif"))
    assert len(ranks) == PREDICT["devices"], "two ranks each wrote their part"
    logs = "".join(p.read_text() for p in (tmp_path / "run/logs/predict").glob("**/*.log"))
    assert f"exported {form} file, segmentation: logits of [background, tree]" in logs, "the file itself predicted"

    with rasterio.open(results / "classes.tif") as out, rasterio.open(scene) as src:
        assert (out.crs, out.transform, out.shape) == (src.crs, src.transform, src.shape)
        classes = out.read(1)
    with rasterio.open(results / "probabilities.tif") as out:
        tree_255 = out.read(2).astype(np.int16)
    cover, single, blended = reference["cover"], reference["single"], reference["blended"]
    tree_fraction = float((classes == 1).mean())
    assert 0.05 < tree_fraction < 0.95, "a class map worth comparing: both classes present"

    # pixels one tile covers: that tile's argmax, every difference a near-tie
    alone = cover == 1
    expected = np.argmax(single, axis=0)
    margin = np.abs(single[1] - single[0])
    differ = alone & (classes != expected)
    ties = alone & (margin < NEAR_TIE)
    assert not (differ & ~ties).any(), f"{int((differ & ~ties).sum())} pixels of one tile differ beyond near-ties"
    # pixels tiles overlap on: the blend of the tiles' probabilities
    overlapped = cover > 1
    agreement = float((classes == np.argmax(blended, axis=0))[overlapped].mean())
    assert agreement >= 0.999
    # the probabilities, round(p * 255), within 1 of the reference's everywhere
    probability = np.where(alone, single[1], blended[1])
    worst = int(np.abs(tree_255 - np.rint(probability * 255)).max())
    assert worst <= 1
    report(
        f"[{form}] workflow {wall:.0f} s, 2 ranks, tree {tree_fraction:.1%}: one tile's pixels "
        f"{int(alone.sum())}, equal {1 - differ.sum() / alone.sum():.4%} ({int(differ.sum())} differ, "
        f"{int(ties.sum())} near-ties); overlapped pixels {int(overlapped.sum())}, classes agree {agreement:.4%}; "
        f"probabilities.tif max |diff| {worst}/255"
    )
