"""DeepForest models through the real workflow: predict with a DeepForest model folder (model.file), and
fine-tune one (train.init, new labels) into a model that is written again as a DeepForest folder."""

import json

import geopandas as gpd
import pytest

import snakemake_forks
from deepforest_files import torchvision_retinanet, write_folder
from rasterscale.tasks.detection.modelfiles import read_header
from workflow import run_dir, run_paths, run_workflow, tiny_config, workflow_command

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deepforest_folder(tmp_path_factory):
    """A DeepForest-format model (resnet18 to stay quick; rasterscale reads any ResNet depth)."""
    folder = tmp_path_factory.mktemp("deepforest") / "tree"
    return write_folder(folder, torchvision_retinanet(), {"Tree": 0}, score_thresh=0.5, nms_thresh=0.05)


def model_section(**keys):
    """tiny.yaml's model section without its backbone (the model file's) and with the given keys."""
    section = {k: v for k, v in tiny_config()["model"].items() if k != "backbone"}
    return {**section, **keys}


def test_predict_with_a_deepforest_folder(tmp_path, deepforest_folder):
    config = tiny_config(train={"scenes": []}, predict={"devices": 1, "workers": 0})
    # 4 tiles: DeepForest's models resize each 256 px tile to 800 px (about 4 s a tile on 2 CPU cores)
    config["demo"]["scenes"]["tiny_test"] = {"width": 448, "height": 448, "seed": 12}
    config["model"] = model_section(file=str(deepforest_folder), score_threshold=0.005)
    run_workflow(tmp_path, config, run_paths(config).batch_record("score", 0))  # not the report's run pages, map
    run = run_dir(tmp_path, config)
    assert run == tmp_path / "results/tiny"  # model.name tiny (tiny.yaml's), not the folder's name
    detections = gpd.read_parquet(run / "tiny_test/detections.parquet")
    assert len(detections) > 0 and set(detections["label"]) == {"Tree"}
    log = (tmp_path / "logs/predict/batch-0/shard-0.log").read_text()
    # the file's labels, pyramid width (from its weights), nms and scale; the config's score threshold
    assert "labels Tree, FPN 256 channels, resized to min_size 800, max 1333, score 0.005, nms 0.05" in log
    assert json.loads((run / "tiny_test/evaluation.json").read_text())["ground_truth"] > 0


def test_fine_tune_from_a_deepforest_folder_writes_a_deepforest_folder(tmp_path, deepforest_folder):
    # one step of 2 tiles: DeepForest's models train on tiles resized to 800 px (about 25 s a step of 4 on 2 CPU cores)
    train = {"init": str(deepforest_folder), "devices": 1, "max_steps": 1, "batch_size": 2}
    config = tiny_config(train=train, predict={"scenes": []})
    config["demo"]["scenes"]["tiny_train"] = {"width": 512, "height": 512, "seed": 11}  # 9 tiles, 3 validated
    config["model"] = model_section(labels=["crown"])
    run_workflow(tmp_path, config, "results/models/tiny.pt")  # the training alone: not the report's run pages
    log = (tmp_path / "logs/train/tiny.log").read_text()
    assert f"start: weights from {deepforest_folder} (DeepForest folder, resnet18, Tree)" in log
    untrained = "backbone batch norms hold no trained statistics"  # the test's folder is untrained: trains whole
    assert f"except the class head's last layer, new for 1 class(es) crown; {untrained}" in log
    folder = tmp_path / "results/models/tiny"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((folder / "config.json").read_text())["label_dict"] == {"crown": 0}
    header = read_header(folder)
    assert (header.backbone, header.labels, header.resize) == ("resnet18", ("crown",), (800, 1333))
    assert read_header(tmp_path / "results/models/tiny.pt").resize == (800, 1333)
    assert "DeepForest's RetinaNetHub builds resnet50 models with a 256-channel feature pyramid only" in log


def test_a_bad_model_file_or_contradicting_labels_stop_the_dry_run_in_one_line(tmp_path, deepforest_folder):
    (tmp_path / "model.pt").write_text("not a model")
    config = tiny_config(train={"scenes": []})
    cases = {
        str(tmp_path / "model.pt"): ({}, f"rasterscale: {tmp_path / 'model.pt'}: not a model file rasterscale reads"),
        str(deepforest_folder): (
            {"labels": ["oak", "pine"]},
            f"rasterscale: config: key 'model.labels' names 2 classes but {deepforest_folder} has 1: Tree",
        ),
    }
    for model, (keys, message) in cases.items():
        config["model"] = model_section(file=model, **keys)
        result = snakemake_forks.run(workflow_command(tmp_path / "run", config, "-n"))
        assert result.returncode != 0
        assert message in result.stderr and "Traceback" not in result.stderr
