"""Hostile model files, made by the tests themselves: each runs a command (it creates its marker file) when it is
loaded the unsafe way, and :func:`armed` proves that it does, in a subprocess, before a test shows that rasterscale
does not run it.

- ``.pt2`` (torch.export) archives, each from a real export of a small network, with one of the code paths that
  ``torch.export.load`` follows: pickled sample inputs, a weight stored ``use_pickle``, an opaque-object constant, an
  AOTInductor shared library, a symbolic shape expression (``sympy.sympify`` is ``eval``), a guard (``exec``-ed by
  ``ExportedProgram.module()``).
- ``.pt``/``.pth`` files of ``torch.save`` whose pickle runs the command: a model file, a ``train.init``
  checkpoint, encoder weights, and the same dressed as TorchScript.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch


class Payload:
    """Pickled, it is a call of ``os.system`` that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def command(marker: Path) -> str:
    """A Python expression that creates ``marker`` when evaluated."""
    return f"__import__('os').system('touch {marker}')"


def saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def pt2_records(path: Path) -> dict[str, bytes]:
    """A .pt2's records by name below its top folder."""
    with zipfile.ZipFile(path) as archive:
        top = archive.namelist()[0].split("/", 1)[0] + "/"
        return {name[len(top) :]: archive.read(name) for name in archive.namelist()}


def write_pt2(records: Mapping[str, bytes], path: Path) -> Path:
    """Records written back as a .pt2 by torch's own writer (its layout and alignment)."""
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    with PT2ArchiveWriter(str(path)) as writer:
        for name, data in records.items():
            if name not in (".data/version", ".data/serialization_id"):  # the writer's own
                writer.write_bytes(name, data)
    return path


def edited_pt2(source: Path, path: Path, edit: Callable[[dict[str, bytes]], None]) -> Path:
    records = pt2_records(source)
    edit(records)
    return write_pt2(records, path)


def edit_json(records: dict[str, bytes], name: str, edit: Callable[[dict], None]) -> None:
    data = json.loads(records[name])
    edit(data)
    records[name] = json.dumps(data).encode()


def pt2_sample_inputs(source: Path, path: Path, marker: Path) -> Path:
    """Sample inputs that fail torch's restricted load: torch loads them again without restriction."""

    def edit(records: dict[str, bytes]) -> None:
        records["data/sample_inputs/model.pt"] = saved(((Payload(marker),), {}))

    return edited_pt2(source, path, edit)


def pt2_pickled_weight(source: Path, path: Path, marker: Path) -> Path:
    """A weight marked ``use_pickle``: torch.load(weights_only=False) of its record."""

    def edit(records: dict[str, bytes]) -> None:
        config_name = "data/weights/model_weights_config.json"
        config = json.loads(records[config_name])
        entry = next(iter(config["config"].values()))
        entry["use_pickle"] = True
        records[f"data/weights/{entry['path_name']}"] = saved(Payload(marker))
        records[config_name] = json.dumps(config).encode()

    return edited_pt2(source, path, edit)


def pt2_opaque_constant(source: Path, path: Path, marker: Path) -> Path:
    """A constant stored as an opaque Python object: pickle.loads of its record."""

    def edit(records: dict[str, bytes]) -> None:
        edit_json(
            records,
            "data/constants/model_constants_config.json",
            lambda config: config["config"].update(
                {"hidden": {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}}
            ),
        )
        import pickle

        records["data/constants/opaque_obj_0"] = pickle.dumps(Payload(marker))

    return edited_pt2(source, path, edit)


AOTI_LIBRARY = """
#include <stdio.h>
__attribute__((constructor)) static void armed(void) {
    FILE *marker = fopen(MARKER, "w");
    if (marker) { fputs("ran", marker); fclose(marker); }
}
"""


def pt2_aotinductor(source: Path, path: Path, marker: Path) -> Path:
    """An AOTInductor package inside the archive: torch dlopens its shared library, whose constructor runs."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler, "a C compiler builds the crafted AOTInductor library (gcc: the machine's, CI's)"
    build = path.with_suffix(".aoti")
    build.mkdir(exist_ok=True)
    (build / "model.c").write_text(AOTI_LIBRARY)
    subprocess.run(
        [compiler, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", build / "model.so", build / "model.c"], check=True
    )

    def edit(records: dict[str, bytes]) -> None:
        folder = "data/aotinductor/model/"
        records[folder + "model.so"] = (build / "model.so").read_bytes()
        records[folder + "model.cpp"] = b""
        metadata = json.dumps({"AOTI_DEVICE_KEY": "cpu"}).encode()
        records[folder + "model_metadata.json"] = metadata
        records[folder + "model.wrapper_metadata.json"] = metadata

    return edited_pt2(source, path, edit)


def pt2_symbolic_expression(source: Path, path: Path, marker: Path) -> Path:
    """A symbolic size whose expression is a command: the deserializer hands it to sympy.sympify (eval). The
    source must have a dynamic dimension."""

    def replace(value: object) -> int:
        count = 0
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "expr_str":
                    value[key] = command(marker)
                    count += 1
                else:
                    count += replace(item)
        elif isinstance(value, list):
            count += sum(replace(item) for item in value)
        return count

    def edit(records: dict[str, bytes]) -> None:
        program = json.loads(records["models/model.json"])
        assert replace(program) > 0, "the source program has no symbolic size"
        records["models/model.json"] = json.dumps(program).encode()

    return edited_pt2(source, path, edit)


def pt2_guard(source: Path, path: Path, marker: Path) -> Path:
    """A guard that is a command: ExportedProgram.module() turns guards into Python source and runs them."""

    def edit(records: dict[str, bytes]) -> None:
        edit_json(records, "models/model.json", lambda p: p.update(guards_code=[f"{command(marker)} == 0"]))

    return edited_pt2(source, path, edit)


def renamed(value: object, old: str, new: str) -> object:
    """A JSON value with every string (keys too) equal to ``old`` replaced by ``new``."""
    if isinstance(value, dict):
        return {renamed(key, old, new): renamed(item, old, new) for key, item in value.items()}
    if isinstance(value, list):
        return [renamed(item, old, new) for item in value]
    return new if value == old else value


def pt2_parameter_name(source: Path, path: Path, marker: Path) -> Path:
    """A weight whose name is code: FX writes a name part that is not an identifier into the generated source of
    ExportedProgram.module() as ``getattr(self, "<part>")``, unescaped. (The name holds no dot, so ``marker``'s
    path must not either.)"""
    assert "." not in str(marker), "the payload is one part of a dotted name"
    escape = f'x") if 0 else getattr(__import__("os"), "system")("touch {marker}") if 1 else getattr(self, "x'

    def edit(records: dict[str, bytes]) -> None:
        config = json.loads(records["data/weights/model_weights_config.json"])
        old = next(iter(config["config"]))
        new = f"{old.rsplit('.', 1)[0]}.{escape}"
        for name in ("models/model.json", "data/weights/model_weights_config.json"):
            records[name] = json.dumps(renamed(json.loads(records[name]), old, new)).encode()

    return edited_pt2(source, path, edit)


PT2_FILES: dict[str, Callable[[Path, Path, Path], Path]] = {
    "sample inputs": pt2_sample_inputs,
    "a pickled weight": pt2_pickled_weight,
    "an opaque constant": pt2_opaque_constant,
    "an AOTInductor library": pt2_aotinductor,
    "a symbolic expression": pt2_symbolic_expression,
    "a guard": pt2_guard,
    "a parameter name": pt2_parameter_name,
}


def pickled_state(path: Path, state: Mapping[str, object], marker: Path) -> Path:
    """A torch.save file of ``state`` with a payload beside the tensors (as a key of its own)."""
    torch.save({**state, "payload": Payload(marker)}, path)
    return path


def dressed_as_torchscript(path: Path, marker: Path) -> Path:
    """A plain torch.save pickle named and carded as a TorchScript file."""
    torch.save({"model": Payload(marker)}, path)
    return path


UNSAFE_LOADS = {
    "torch.export": "torch.export.load(path).module()(torch.zeros(1, *shape))",
    "torch.load": "torch.load(path, weights_only=False)",
}
ARMING = """
import json, sys, torch
for name, path, how, shape in json.loads(sys.argv[1]):
    try:
        exec(LOADS[how], {"torch": torch, "path": path, "shape": shape})
    except Exception:
        pass  # a payload may break the load after it ran
"""


def armed_all(cases: list[tuple[str, Path, Path, str, tuple[int, ...]]]) -> set[str]:
    """The names of the cases (name, file, marker, how, a tile's shape) whose file creates its marker when loaded
    the unsafe way (``how``: a key of :data:`UNSAFE_LOADS`), all in one subprocess; the markers are removed."""
    for _, _, marker, _, _ in cases:
        marker.unlink(missing_ok=True)
    listed = json.dumps([(name, str(path), how, list(shape)) for name, path, _, how, shape in cases])
    script = f"LOADS = {UNSAFE_LOADS!r}\n{ARMING}"
    with tempfile.TemporaryDirectory(prefix="armed-") as scratch:  # torch unpacks an AOTInductor package there
        environment = {**os.environ, "TMPDIR": scratch}
        subprocess.run([sys.executable, "-c", script, listed], capture_output=True, timeout=300, env=environment)
    proven = {name for name, _, marker, _, _ in cases if marker.exists()}
    for _, _, marker, _, _ in cases:
        marker.unlink(missing_ok=True)
    return proven


PYTHON_VRT = """<VRTDataset rasterXSize="64" rasterYSize="64">
  <SRS>EPSG:32617</SRS>
  <GeoTransform>404000.0, 0.1, 0.0, 3285000.0, 0.0, -0.1</GeoTransform>
{bands}
</VRTDataset>
"""
PYTHON_BAND = """  <VRTRasterBand dataType="Byte" band="{band}" subClass="VRTDerivedRasterBand">
    <PixelFunctionType>armed</PixelFunctionType>
    <PixelFunctionLanguage>Python</PixelFunctionLanguage>
    <PixelFunctionCode><![CDATA[
def armed(in_ar, out_ar, *args, **kwargs):
    open({marker!r}, "w").write("ran")
    out_ar[:] = 1
]]></PixelFunctionCode>
  </VRTRasterBand>"""


def python_vrt(path: Path, marker: Path, bands: int = 4) -> Path:
    """A georeferenced VRT whose bands are Python pixel functions (GDAL runs them where GDAL_VRT_ENABLE_PYTHON is
    YES)."""
    text = "\n".join(PYTHON_BAND.format(band=b, marker=str(marker)) for b in range(1, bands + 1))
    path.write_text(PYTHON_VRT.format(bands=text))
    return path
