"""Shared fixtures: small real rasters written with rasterio."""

from __future__ import annotations

import os

# The suite's 2 workers share 2 cores: OpenMP threads that spin while they wait (the default policy) take the core
# the other worker's process needs, which slows a rank or job several times over; waiting passively keeps a busy
# machine's torch processes (in process, ranks, jobs: they inherit it) near their speed alone. Before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rasterio
from affine import Affine
from rasterio.enums import ColorInterp

REPO = Path(__file__).resolve().parents[1]
UTM17N = "EPSG:32617"


def write_raster(
    path: Path,
    width: int,
    height: int,
    count: int = 3,
    crs: str | None = UTM17N,
    transform: Affine | None = None,
    nodata: float | None = None,
    data: np.ndarray | None = None,
    tiled: bool = True,
    alpha: bool = False,
) -> Path:
    """A GeoTIFF of ``data`` (its dtype; default random uint8); ``alpha``: the last band is an alpha band."""
    transform = transform if transform is not None else Affine(0.1, 0, 404000.0, 0, -0.1, 3285000.0)
    if data is None:
        data = np.random.default_rng(0).integers(0, 255, size=(count, height, width), dtype=np.uint8)
    profile = {
        "driver": "GTiff",
        "width": width,
        "height": height,
        "count": count,
        "dtype": data.dtype.name,
        "transform": transform,
        "nodata": nodata,
    }
    if crs is not None:
        profile["crs"] = crs
    if tiled:
        profile.update(tiled=True, blockxsize=128, blockysize=128)
    with rasterio.open(path, "w", **profile) as dst:
        dst.write(data)
        if alpha:
            colours = [ColorInterp.red, ColorInterp.green, ColorInterp.blue][: count - 1]
            dst.colorinterp = [*colours, *[ColorInterp.gray] * (count - 1 - len(colours)), ColorInterp.alpha]
    return path


def schema_keys(prefix: str, node: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every key below a schema node, at every depth: properties, free names ({name}), object oneOfs."""
    children = dict(node.get("properties", {}))
    if isinstance(node.get("additionalProperties"), Mapping):
        children["{name}"] = node["additionalProperties"]
    for alternative in node.get("oneOf", []):
        children.update(alternative.get("properties", {}))
    for name, child in children.items():
        path = f"{prefix}.{name}" if prefix else name
        yield path, child
        yield from schema_keys(path, child)


def write_rgba(path: Path, data: np.ndarray, **kwargs) -> Path:
    """An orthomosaic as OpenDroneMap writes it: RGB and an alpha band (alpha 0: no data)."""
    return write_raster(path, data.shape[2], data.shape[1], count=data.shape[0], data=data, alpha=True, **kwargs)


def damage_block(path: Path, x: int, y: int, truncate: bool = False) -> None:
    """Overwrite block (x, y) of a GeoTIFF with noise (its header stays right), or cut the file there."""
    with rasterio.open(path) as src:
        offset = int(src.get_tag_item(f"BLOCK_OFFSET_{x}_{y}", "TIFF", bidx=1))
        size = int(src.get_tag_item(f"BLOCK_SIZE_{x}_{y}", "TIFF", bidx=1))
    raw = bytearray(path.read_bytes())
    if truncate:
        del raw[offset:]
    else:
        raw[offset : offset + size] = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A throwaway 2-node Slurm cluster on loopback for one test module (skipped, with the reason, where it
    cannot run: not root, no apt)."""
    from slurm_cluster import slurm_cluster_or_skip

    cluster = slurm_cluster_or_skip(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def s3_server():
    """One S3 server for the test session (moto's, in a process of its own, with AWS's request signing and an IAM
    user's policy enforced: tests/remote_servers.py), shared by the test modules that read from S3: each puts its
    objects into a bucket of its own."""
    from remote_servers import S3Server

    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture
def raster_factory(tmp_path: Path):
    def make(name: str = "scene.tif", **kwargs) -> Path:
        return write_raster(tmp_path / name, **kwargs)

    return make


EVIDENCE: list[str] = []


def report(text: str) -> None:
    """Evidence a test wants in CI's output (job ids, nodes, ranks): printed in the terminal summary."""
    EVIDENCE.append(text.strip("\n"))


# The test files that run longest here (minutes: real workflows, a Slurm cluster, servers), slowest first. CI runs
# the suite on 2 workers a file at a time, handing out files in collection order: these go first, so that no
# worker is left running a long file alone at the end.
SLOWEST_FIRST = (  # by their time in the suite (the first two start together, one on each worker)
    "test_slurm_workflow.py",
    "test_segmentation_workflow.py",
    "test_project_borders.py",
    "test_workflow.py",
    "test_faults_predict.py",
    "test_instances_workflow.py",
    "test_project_workflow.py",
    "test_train_faults.py",
    "test_predict_resume.py",
    "test_remote.py",
    "test_scenes.py",
    "test_deepforest_workflow.py",
    "test_bench_gpu.py",
    "test_imagery_workflow.py",
    "test_regression_workflow.py",
    "test_cog.py",
    "test_hostile_inputs.py",
)


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: k for k, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


def pytest_terminal_summary(terminalreporter) -> None:
    if EVIDENCE:
        terminalreporter.section("evidence")
        for text in EVIDENCE:
            terminalreporter.write_line(text)


def write_vrt(path: Path, sources: list[Path]) -> Path:
    """A GDAL VRT mosaic of GeoTIFF tiles on one pixel grid (what `gdalbuildvrt` writes, for machines without
    GDAL's command line tools): one SimpleSource per tile and band, paths relative to the VRT."""
    import rasterio

    infos = []
    for source in sources:
        with rasterio.open(source) as src:
            infos.append((source, src.transform, src.width, src.height, src.count, src.crs, src.dtypes[0]))
    px, py = infos[0][1].a, infos[0][1].e
    left = min(t.c for _, t, *_ in infos)
    top = max(t.f for _, t, *_ in infos)
    right = max(t.c + w * px for _, t, w, *_ in infos)
    bottom = min(t.f + h * py for _, t, _, h, *_ in infos)
    width, height = round((right - left) / px), round((bottom - top) / py)
    count, crs, dtype = infos[0][4], infos[0][5], infos[0][6]
    gdal_type = {"uint8": "Byte", "uint16": "UInt16", "float32": "Float32"}[dtype]
    bands = []
    for band in range(1, count + 1):
        simple = "".join(
            f'<SimpleSource><SourceFilename relativeToVRT="1">{Path(source).relative_to(path.parent)}'
            f"</SourceFilename><SourceBand>{band}</SourceBand>"
            f'<SrcRect xOff="0" yOff="0" xSize="{w}" ySize="{h}"/>'
            f'<DstRect xOff="{round((t.c - left) / px)}" yOff="{round((t.f - top) / py)}" xSize="{w}" ySize="{h}"/>'
            "</SimpleSource>"
            for source, t, w, h, *_ in infos
        )
        bands.append(f'<VRTRasterBand dataType="{gdal_type}" band="{band}">{simple}</VRTRasterBand>')
    path.write_text(
        f'<VRTDataset rasterXSize="{width}" rasterYSize="{height}"><SRS>{crs.to_wkt()}</SRS>'
        f"<GeoTransform>{left}, {px}, 0, {top}, 0, {py}</GeoTransform>{''.join(bands)}</VRTDataset>\n"
    )
    return path


def project_sources(entries: list[dict[str, Any]]) -> tuple[Any, ...]:
    """Project sources (rasterscale.scene.ProjectSource) from their job-file entries (name, CRS, bounds or core,
    layers by key)."""
    from rasterscale.scene import ProjectSource

    return tuple(ProjectSource.from_dict(entry) for entry in entries)
