"""No code from a file the user hands over (docs/security.md): every crafted file here first proves that it is armed
(loaded the unsafe way, in a subprocess, it creates its marker), then the dry run (`snakemake -n`) and the
prediction job's own loading refuse it in one line naming the file, or never read the armed part, and the marker
never appears."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import crafted
import snakemake_forks
from rasterscale.errors import InputError
from rasterscale.settings import job_settings
from rasterscale.tasks.exported.card import card_path
from rasterscale.tasks.registry import task_spec
from test_exported_models import BANDS, MEAN, PATCH, STD, card, export, make_net, predict_config, smooth_raster
from workflow import REPO, run_dir, run_paths, run_workflow, workflow_command

ADVICE = "; export it to ONNX or TorchScript, or again with torch.export"
# crafted .pt2 -> the problem its one line names (None: the armed part is never read, the file predicts)
PT2_REFUSALS = {
    "sample inputs": None,
    "a pickled weight": r"'features\.0\.weight' is stored pickled \(use_pickle in "
    r"data/weights/model_weights_config\.json\)",
    "an opaque constant": r"constant 'hidden' is an opaque Python object, which torch unpickles",
    "an AOTInductor library": r"holds an AOTInductor package \(data/aotinductor/model/[\w.]+\): compiled native code",
    "a symbolic expression": r"symbolic expression \"__import__\('os'\)\.system\(.* is not a plain arithmetic "
    r"expression",
    "a guard": r"guard \"__import__\('os'\)\.system\(.* is not a comparison of input sizes",
    "a parameter name": r"names an attribute 'features\.0\.x\"\) if 0 else .* in the program's signature "
    r"that is not a path of identifiers",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """The scene, a real export (net.pt2, dynamic batch) and every crafted file with its marker, each proven armed
    in one subprocess."""
    folder = tmp_path_factory.mktemp("crafted")
    smooth_raster(folder / "scene.tif")
    source = export(make_net(), folder / "net.pt2", "torch.export", card())
    cases: dict[str, tuple[Path, Path, str]] = {}
    for name, make in crafted.PT2_FILES.items():
        stem = name.replace(" ", "_")
        marker = folder / f"{stem}_marker"
        path = make(source, folder / f"{stem}.pt2", marker)
        card_path(path).write_text(yaml.safe_dump(card()))
        cases[name] = (path, marker, "torch.export")
    cases.update(pickled_model_files(folder))
    proven = crafted.armed_all(
        [(name, path, marker, how, (len(BANDS), PATCH, PATCH)) for name, (path, marker, how) in cases.items()]
    )
    return {"folder": folder, "cases": cases, "armed": proven}


def pickled_model_files(folder: Path) -> dict[str, tuple[Path, Path, str]]:
    """torch.save files with a payload, one for each place a .pt or .pth is read: a rasterscale model file
    (model.file, and train.init), encoder weights (model.encoder_weights), a pickle dressed as TorchScript, a
    DeepForest Lightning checkpoint (detection's model.file), an instances model file."""
    from rasterscale.raster.bands import InputBands
    from rasterscale.tasks.segmentation.model import build_segmenter, save_segmenter
    from rasterscale.tasks.segmentation.modelfiles import SegmenterConfig

    torch.manual_seed(0)
    bands = InputBands(tuple(BANDS), tuple(MEAN), tuple(STD), raw=True)
    config = SegmenterConfig(("background", "tree"), patch_size=PATCH, input=bands)
    model = build_segmenter(config)
    save_segmenter(model, config, folder / "plain.pt")
    cases = {}
    model_file = folder / "segmenter.pt"
    crafted.pickled_state(model_file, torch.load(folder / "plain.pt", weights_only=True), folder / "pt.marker")
    cases["a model file"] = (model_file, folder / "pt.marker", "torch.load")
    encoder = crafted.pickled_state(folder / "encoder.pth", model.net.encoder.state_dict(), folder / "pth.marker")
    cases["encoder weights"] = (encoder, folder / "pth.marker", "torch.load")
    script = crafted.dressed_as_torchscript(folder / "script.pt", folder / "script.marker")
    card_path(script).write_text(yaml.safe_dump(card()))
    cases["a pickle dressed as TorchScript"] = (script, folder / "script.marker", "torch.load")
    for name, file_name in (("a DeepForest checkpoint", "deepforest.ckpt"), ("an instances model file", "crowns.pt")):
        marker = folder / f"{file_name}.marker"
        state = {"state_dict": {"model.head.weight": torch.zeros(2, 2)}, "label_dict": {"Tree": 0}}
        cases[name] = (crafted.pickled_state(folder / file_name, state, marker), marker, "torch.load")
    return cases


def dry_run(workdir: Path, config: dict) -> subprocess.CompletedProcess:
    return snakemake_forks.run(workflow_command(workdir, config, "-n"), timeout=300)


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("rasterscale:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("name", list(PT2_REFUSALS))
def test_a_crafted_pt2_runs_nothing_at_the_dry_run_nor_in_the_job(files, name, tmp_path):
    """Each of torch.export.load's paths to code: armed (it runs when torch.export loads the file and its module
    runs a tile), then `snakemake -n` stops in one line naming the file and what was found (or, for sample inputs
    rasterscale never reads, plans the run), and the prediction job's loading (every rank's) does the same."""
    path, marker, _ = files["cases"][name]
    assert name in files["armed"], f"the crafted file ({name}) must run its payload when loaded the unsafe way"
    config = predict_config(files["folder"], path, 2)
    result = dry_run(tmp_path / "run", config)
    problem = PT2_REFUSALS[name]
    if problem is None:
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        expected = f"rasterscale: {re.escape(str(path))}: {problem}{re.escape(ADVICE)}"
        assert re.fullmatch(expected, one_line(result)), one_line(result)
    assert not marker.exists()
    load = task_spec("segmentation").load().load_model
    if problem is None:
        model, _ = load(path, job_settings(config))
        with torch.inference_mode():
            assert model(torch.zeros(2, len(BANDS), PATCH, PATCH)).shape == (2, 2, PATCH, PATCH)
    else:
        with pytest.raises(InputError) as raised:
            load(path, job_settings(config))
        assert re.fullmatch(expected.removeprefix("rasterscale: "), str(raised.value)), str(raised.value)
    assert not marker.exists()


SEGMENTER = r"{path}: not a rasterscale segmenter \(a \.pt file of format rasterscale-segmenter/1\)"
PICKLE_REFUSALS = {
    "a model file": ("model.file", SEGMENTER),
    "train.init": ("train.init", SEGMENTER),
    "encoder weights": ("model.encoder_weights", r"{path}: not a torch-saved state dict \(model\.encoder_weights\)"),
    "a pickle dressed as TorchScript": ("model.file", r"{path}: not a TorchScript file: a torch\.save file .*"),
    "a DeepForest checkpoint": ("detection", r"{path}: not a model file rasterscale reads \(a rasterscale \.pt .*"),
    "an instances model file": ("instances", r"{path}: not an instance segmentation model file rasterscale reads .*"),
}


@pytest.mark.parametrize("name", list(PICKLE_REFUSALS))
def test_a_pickle_in_a_pt_or_pth_runs_nothing(files, name, tmp_path):
    """A payload in each place a .pt or .pth is read, armed (torch.load without weights_only runs it): the dry run
    stops in one line naming the file, the job's own loading of it fails, and the marker never appears."""
    key, problem = PICKLE_REFUSALS[name]
    path, marker, _ = files["cases"]["a model file" if name == "train.init" else name]
    assert ("a model file" if name == "train.init" else name) in files["armed"]
    config = pickle_config(files["folder"], key, path)
    line = one_line(dry_run(tmp_path / "run", config))
    assert re.fullmatch("rasterscale: " + problem.format(path=re.escape(str(path))), line), line
    assert not marker.exists()
    with pytest.raises(InputError, match=f"^{re.escape(str(path))}: "):  # the job's: prediction's, training's
        job_loads(key, path, config)
    assert not marker.exists()


def job_loads(key: str, path: Path, config: dict) -> None:
    """What a job does with the file of ``key``: prediction loads its model (every rank), training starts its
    network from train.init or its encoder from model.encoder_weights."""
    from rasterscale.raster.bands import InputBands
    from rasterscale.tasks.segmentation.model import build_segmenter
    from rasterscale.tasks.segmentation.modelfiles import SegmenterConfig
    from rasterscale.tasks.smpnet import load_encoder_weights

    task = task_spec(config["task"]).load()
    if key not in ("train.init", "model.encoder_weights"):
        task.load_model(path, job_settings(config))
        return
    bands = InputBands(tuple(BANDS), tuple(MEAN), tuple(STD), raw=True)
    model_cfg = SegmenterConfig(("background", "tree"), patch_size=PATCH, input=bands)
    model = build_segmenter(model_cfg)
    if key == "train.init":
        task.initial_weights(model, model_cfg, job_settings(config))
    else:
        load_encoder_weights(model.net.encoder, path, "resnet18")


def pickle_config(folder: Path, key: str, path: Path) -> dict:
    base = {
        "task": "segmentation",
        "scenes": {"scene": {"path": str(folder / "scene.tif"), "bands": [1, 2, 3, 4]}},
        "tiling": {"patch_size": PATCH, "overlap": 16},
        "train": {"scenes": []},
        "predict": {"scenes": ["scene"], "devices": 1, "workers": 0},
    }
    if key in ("detection", "instances"):
        base["task"] = key
        base["model"] = {"file": str(path)}
        base["scenes"]["scene"]["bands"] = [1, 2, 3]
    elif key == "model.file":
        base["model"] = {"file": str(path)}
    elif key == "train.init":
        base["scenes"]["scene"]["annotations"] = str(crowns(folder))
        base["train"] = {"scenes": ["scene"], "init": str(path)}
        base["predict"]["scenes"] = []
        base["model"] = {"labels": ["background", "tree"]}
    else:
        base["scenes"]["scene"]["annotations"] = str(crowns(folder))
        base["train"] = {"scenes": ["scene"]}
        base["predict"]["scenes"] = []
        base["model"] = {"encoder": "resnet18", "encoder_weights": str(path), "labels": ["background", "tree"]}
    return base


def crowns(folder: Path) -> Path:
    """Two crown polygons inside the scene (training needs ground truth)."""
    import geopandas as gpd
    from shapely.geometry import Point

    path = folder / "crowns.gpkg"
    if not path.exists():
        shapes = [Point(404005.0, 3284992.0).buffer(2.0), Point(404015.0, 3284995.0).buffer(1.5)]
        gpd.GeoDataFrame({"label": ["tree", "tree"]}, geometry=shapes, crs="EPSG:32617").to_file(path)
    return path


def test_the_prediction_job_reads_no_sample_inputs_and_every_rank_refuses_a_pickled_weight(files, tmp_path):
    """The real workflow with the crafted sample inputs on 2 ranks predicts its class map and never runs them (the
    payload of the issue: a run that went on as if nothing had happened). Then the same path holds the file with
    a pickled weight, and the prediction job itself (its entry, as the rule runs it, after a dry run that passed):
    it fails, each rank's log ends with the file's one line, and no marker appears."""
    path, marker, _ = files["cases"]["sample inputs"]
    model = tmp_path / "net.pt2"
    model.write_bytes(path.read_bytes())
    card_path(model).write_text(card_path(path).read_text())
    config = predict_config(files["folder"], model, 2)
    run_workflow(tmp_path, config, run_paths(config).scene_file("scene", "classes.tif"))
    assert (run_dir(tmp_path, config) / "scene/classes.tif").exists() and not marker.exists()

    pickled, pickled_marker, _ = files["cases"]["a pickled weight"]
    model.write_bytes(pickled.read_bytes())
    job = run_dir(tmp_path, config) / "jobs/predict/batch-0.json"
    out, logs = tmp_path / "again", tmp_path / "again-logs"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/predict.py"), "--job", str(job), "--out-dir", str(out)]
        + ["--log-dir", str(logs)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0 and not pickled_marker.exists()
    line = f"{model}: 'features.0.weight' is stored pickled (use_pickle in data/weights/model_weights_config.json)"
    rank_logs = sorted(logs.glob("*.log"))
    assert len(rank_logs) == 2, (sorted(logs.iterdir()) if logs.exists() else None, result.stderr[-2000:])
    for log in rank_logs:
        assert line in log.read_text(), log.read_text()[-2000:]


# The package's load paths that could run code and are vetted (docs/security.md says why each is safe):
# (module below scripts/rasterscale, the call) -> why
VETTED_LOADS = {
    ("tasks/exported/pt2.py", "load_pt2"): "the vetted records of a .pt2 only, from a new in-memory archive",
    ("tasks/exported/runtime.py", "torch.jit.load"): "TorchScript's own interpreter: registered operators, no Python",
    ("runtime/lifetime.py", "ctypes.CDLL"): "the C library already in the process (prctl), no file named",
    ("runtime/allocator.py", "ctypes.CDLL"): "the C library already in the process (mallopt), no file named",
    ("raster/vsi.py", "ctypes.CDLL"): "rasterio's own GDAL library (its wheel's, or the one mapped), never a user's",
    ("tasks/spec.py", "importlib.import_module"): "a task's module named in the package's registry, not by a file",
}
PICKLE_CALLS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads"}
NEVER = {
    "marshal.load", "marshal.loads", "dill.load", "dill.loads", "cloudpickle.load", "cloudpickle.loads",
    "joblib.load", "shelve.open", "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all",
    "torch.export.load", "torch.ops.load_library", "torch.classes.load_library", "torch.serialization.add_safe_globals",
    "eval", "exec", "compile", "__import__",
}  # fmt: skip
NATIVE = ("ctypes.CDLL", "ctypes.PyDLL", "ctypes.cdll.LoadLibrary", "ctypes.pydll.LoadLibrary", "dlopen")


def load_path_findings(source: str) -> list[tuple[int, str]]:
    """Every call in ``source`` that can run code from a file, and is not the restricted form: (line, call)."""
    import ast

    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            unpickler = any(ast.unparse(base) in ("pickle.Unpickler", "Unpickler") for base in node.bases)
            methods = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
            if unpickler and "find_class" not in methods:
                found.append((node.lineno, f"class {node.name}(pickle.Unpickler) without find_class"))
        if isinstance(node, ast.ImportFrom):  # a load imported under its bare name escapes the calls' checks
            for alias in node.names:
                imported = f"{node.module}.{alias.name}"
                if imported in PICKLE_CALLS | NEVER | {"torch.load", "yaml.load"} or alias.name == "load_pt2":
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
        short = name.rsplit(".", 1)[-1]
        if name.endswith("torch.load") and keywords.get("weights_only") != "True":
            found.append((node.lineno, "torch.load without weights_only=True"))
        elif name in PICKLE_CALLS or name.endswith("read_pickle"):
            found.append((node.lineno, name))
        elif name in ("yaml.load", "yaml.load_all") and keywords.get("Loader") not in (
            "yaml.SafeLoader",
            "yaml.CSafeLoader",
        ):
            found.append((node.lineno, f"{name} without a safe Loader"))
        elif (
            name in NEVER
            or name.endswith(NATIVE)
            or short in ("register_custom_ops_library", "load_from_checkpoint")
            or short == "load_pt2"
            or name in ("torch.jit.load", "importlib.import_module")
        ):
            found.append((node.lineno, name))
        elif name in ("np.load", "numpy.load") and keywords.get("allow_pickle") == "True":
            found.append((node.lineno, f"{name} with allow_pickle=True"))
        elif "ckpt_path" in keywords and keywords.get("weights_only") != "True":
            found.append((node.lineno, f"{name}(ckpt_path=...) without weights_only=True"))
    return found


def test_the_scan_finds_every_kind_of_unsafe_load():
    """The scan below can fail: each unsafe form in a snippet is found, each restricted form is not."""
    unsafe = {
        "torch.load(path)": "torch.load without weights_only=True",
        "torch.load(path, weights_only=False)": "torch.load without weights_only=True",
        "pickle.loads(data)": "pickle.loads",
        "pickle.Unpickler(handle).load()": "pickle.Unpickler",
        "class Open(pickle.Unpickler):\n    pass": "class Open(pickle.Unpickler) without find_class",
        "yaml.load(text, Loader=yaml.Loader)": "yaml.load without a safe Loader",
        "yaml.unsafe_load(text)": "yaml.unsafe_load",
        "torch.export.load(path)": "torch.export.load",
        "ctypes.CDLL(path)": "ctypes.CDLL",
        "os.dlopen(path)": "os.dlopen",
        "options.register_custom_ops_library(path)": "options.register_custom_ops_library",
        "np.load(path, allow_pickle=True)": "np.load with allow_pickle=True",
        "pd.read_pickle(path)": "pd.read_pickle",
        "trainer.fit(module, ckpt_path=path)": "trainer.fit(ckpt_path=...) without weights_only=True",
        "exec(text)": "exec",
        "torch.ops.load_library(path)": "torch.ops.load_library",
        "from pickle import loads": "from pickle import loads",
        "from torch.export import load": "from torch.export import load",
        "from torch.export.pt2_archive._package import load_pt2": "from torch.export.pt2_archive._package "
        "import load_pt2",
    }
    for snippet, finding in unsafe.items():
        assert [f for _, f in load_path_findings(snippet)] == [finding], snippet
    safe = (
        "torch.load(path, weights_only=True)",
        "yaml.safe_load(text)",
        "np.load(path, allow_pickle=False)",
        "trainer.fit(module, ckpt_path=path, weights_only=True)",
        "class Plain(pickle.Unpickler):\n    def find_class(self, module, name):\n        raise Exception",
    )
    for snippet in safe:
        assert load_path_findings(snippet) == [], snippet


def test_no_load_path_in_the_package_can_run_code_but_the_vetted_ones():
    """The whole package scanned: every call that could run code from a file is the restricted form
    (``weights_only=True``, ``yaml.safe_load``, a restricted unpickler, ...) or one of the vetted load paths, and
    each vetted path is still there (the list says nothing stale)."""
    package = REPO / "scripts/rasterscale"
    findings, seen = [], set()
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        for line, call in load_path_findings(path.read_text()):
            matches = [v for v in VETTED_LOADS if v[0] == module and call.endswith(v[1])]
            if matches:
                seen.update(matches)
            else:
                findings.append(f"{module}:{line}: {call}")
    assert findings == [], "load paths that can run code:\n" + "\n".join(findings)
    assert seen == set(VETTED_LOADS), f"vetted paths no longer in the package: {set(VETTED_LOADS) - seen}"


READ_VRT = """
import sys
if sys.argv[2] == "rasterscale":
    from rasterscale.raster.remote import open_raster as open_raster
else:
    from rasterio import open as open_raster
try:
    with open_raster(sys.argv[1]) as src:
        src.read(1)
except Exception as err:
    print(err)
"""


def test_a_vrt_with_a_python_pixel_function_runs_nothing(files, tmp_path):
    """A VRT whose pixel function is Python: armed (GDAL runs it on a read where GDAL_VRT_ENABLE_PYTHON=YES); the
    dry run refuses it in one line, and a read through rasterscale with the same environment runs nothing."""
    marker = tmp_path / "vrt.marker"
    vrt = crafted.python_vrt(tmp_path / "scene.vrt", marker)
    environment = {**os.environ, "GDAL_VRT_ENABLE_PYTHON": "YES", "PYTHONPATH": str(REPO / "scripts")}
    subprocess.run([sys.executable, "-c", READ_VRT, str(vrt), "rasterio"], env=environment, timeout=120, check=True)
    assert marker.exists(), "the crafted VRT must run its pixel function when GDAL is allowed to"
    marker.unlink()
    config = predict_config(files["folder"], files["cases"]["sample inputs"][0], 1)
    config["scenes"]["scene"]["path"] = str(vrt)
    line = one_line(dry_run(tmp_path / "run", config))
    assert line == f"rasterscale: {vrt}: a VRT with a Python pixel function: rasterscale runs no code from a file"
    read = subprocess.run(
        [sys.executable, "-c", READ_VRT, str(vrt), "rasterscale"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert read.returncode == 0 and "Read failed" in read.stdout and not marker.exists(), read.stdout + read.stderr


def test_the_pt2_vetting_refuses_what_torch_would_turn_into_source(files):
    """The rules with no crafted file of their own (their code paths need a matching program around them): the
    program JSON of a real export, each edit refused with its reason, and the export itself kept."""
    from rasterscale.tasks.exported.pt2 import UnsafeArchive, is_plain_expression, vetted_program

    program = json.loads(crafted.pt2_records(files["folder"] / "net.pt2")["models/model.json"])
    vetted_program(json.loads(json.dumps(program)))  # the real export passes

    def edited(edit) -> str:
        copy = json.loads(json.dumps(program))
        edit(copy)
        with pytest.raises(UnsafeArchive) as raised:
            vetted_program(copy)
        return str(raised.value)

    signature = lambda p: p["graph_module"]["module_call_graph"][0]["signature"]  # noqa: E731
    assert edited(lambda p: signature(p).update(forward_arg_names=["x=__import__('os')"])) == (
        "argument name \"x=__import__('os')\" is not a Python identifier"
    )
    spec = '[1, {"type": "builtins.dict", "context": "[\\"a\'\\"]", "children_spec": []}]'
    assert edited(lambda p: signature(p).update(in_spec=spec)) == 'keyword "a\'" is not a Python identifier'
    node = lambda p: p["graph_module"]["graph"]["nodes"][0]  # noqa: E731
    assert edited(lambda p: node(p).update(target="torch.ops.profiler._record_function_enter.default")).startswith(
        "calls 'torch.ops.profiler._record_function_enter.default': a .pt2 runs ATen operators"
    )
    assert edited(lambda p: node(p).update(target="torch.ops.higher_order.call_torchbind")).startswith("calls")
    assert edited(lambda p: p.update(guards_code=["L['x'].size()[0].__class__ == 1"])).startswith("guard")
    assert is_plain_expression("Mul(Integer(2), Symbol('s39', positive=True, integer=True))")
    assert is_plain_expression("FloorDiv(s0, 2) + Max(1, s1)")
    for text in ("Symbol('x').__class__", "open('f')", "Symbol('s0', evil=__import__('os'))", "lambda: 0"):
        assert not is_plain_expression(text), text
