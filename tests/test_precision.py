"""precision: auto, one rule per device kind (decided on capability values where this machine lacks the device),
the explicit values a device emulates, one value per job, and what this machine's own CPU resolves to."""

import json
import logging
import os
import subprocess
import sys

import lightning as L
import pytest
import torch

from rasterscale.config.schema import validate_config
from rasterscale.runtime.precision import (
    BF16,
    FP16,
    FP32,
    Capability,
    agree,
    choose,
    cpu_capability,
    cpu_info,
    cuda_capability,
    isa_cap_allows_bf16,
    probe,
    resolve,
)
from rasterscale.runtime.ranks import AgreedPrecision, RankLayout, rank_layout, start_rank
from rasterscale.settings import settings_of

AVX2_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512_vnni"}
SAPPHIRE_RAPIDS_FLAGS = AVX512_FLAGS | {"avx512_bf16", "amx_bf16", "amx_tile"}
NO_CAP = (True, "")


def test_cuda_with_native_bf16_picks_bf16():
    for major, minor, name in [(8, 0, "A100"), (8, 9, "L4"), (9, 0, "H100")]:
        assert choose(cuda_capability(major, minor, name)) == BF16


def test_older_cuda_picks_fp16_mixed():
    for major, minor, name in [(7, 0, "V100"), (7, 5, "T4"), (6, 0, "P100")]:
        assert choose(cuda_capability(major, minor, name)) == FP16


def test_a_cpu_with_native_bf16_picks_bf16():
    capability = cpu_capability(True, SAPPHIRE_RAPIDS_FLAGS, "Xeon 8480", NO_CAP)
    assert capability.bf16 and choose(capability) == BF16


def test_a_cpu_without_native_bf16_picks_fp32():
    # AVX2 only: oneDNN says no
    assert choose(cpu_capability(False, AVX2_FLAGS, "EPYC", NO_CAP)) == FP32
    # AVX-512 without bf16 arithmetic: oneDNN says yes (it emulates bf16 there), the flags say no
    assert choose(cpu_capability(True, AVX512_FLAGS, "Xeon 6148", NO_CAP)) == FP32


def test_the_onednn_isa_cap_below_bf16_picks_fp32():
    assert isa_cap_allows_bf16({"ONEDNN_MAX_CPU_ISA": "avx2"}) == (False, "ONEDNN_MAX_CPU_ISA=AVX2")
    assert isa_cap_allows_bf16({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"})[0]
    assert isa_cap_allows_bf16({}) == NO_CAP
    # capped at AVX-512 on a bf16 CPU, oneDNN still says yes (avx512_core) but runs no bf16 instruction
    capped = cpu_capability(
        True, SAPPHIRE_RAPIDS_FLAGS, "Xeon 8480", isa_cap_allows_bf16({"DNNL_MAX_CPU_ISA": "AVX512_CORE"})
    )
    assert not capped.bf16 and choose(capped) == FP32 and "DNNL_MAX_CPU_ISA=AVX512_CORE" in capped.detail


def test_an_arm_cpu_follows_onednn():
    assert choose(cpu_capability(True, frozenset({"fp", "asimd", "bf16"}), "Neoverse-V1", NO_CAP)) == BF16
    assert choose(cpu_capability(False, frozenset({"fp", "asimd"}), "Neoverse-N1", NO_CAP)) == FP32


def cpu(bf16: bool) -> Capability:
    return Capability("cpu", "a CPU", bf16, "test")


def test_an_explicit_value_is_obeyed_and_warned_where_it_is_emulated():
    native = resolve("train.precision", FP32, cpu(bf16=True))
    assert native.value == FP32 and native.warning is None
    emulated = resolve("train.precision", BF16, cpu(bf16=False))
    assert emulated.value == BF16
    assert (
        "train.precision 'bf16-mixed'" in emulated.warning
        and "'train.precision: auto' picks 32-true" in emulated.warning
    )
    # fp16 on a CPU autocasts to bf16 (as Lightning does), with a warning even where bf16 is native
    fp16_on_cpu = resolve("predict.precision", FP16, cpu(bf16=True))
    assert fp16_on_cpu.value == BF16 and "no fp16 autocast" in fp16_on_cpu.warning
    assert "'predict.precision: auto' picks bf16-mixed" in fp16_on_cpu.warning
    v100 = cuda_capability(7, 0, "V100")
    assert resolve("train.precision", BF16, v100).warning is not None
    assert resolve("train.precision", FP16, v100).warning is None
    assert resolve("train.precision", "auto", v100).value == FP16
    with pytest.raises(ValueError, match=r"train\.precision: unknown precision 'fp8'"):
        resolve("train.precision", "fp8", v100)


def test_the_ranks_of_a_job_agree_on_the_least_demanding_value():
    assert agree([BF16, BF16]) == BF16
    assert agree([BF16, FP16, BF16]) == FP16  # an A100 node and a V100 node: all train in fp16
    assert agree([BF16, FP32]) == FP32  # a bf16 CPU and one without
    assert agree([FP16, FP32]) == FP32


def test_a_rank_switches_its_trainer_to_the_agreed_value():
    spec = RankLayout("cpu", 1, 1, BF16, "train", resolve("train.precision", "auto", cpu(bf16=True)))
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=BF16, logger=False, enable_progress_bar=False)
    AgreedPrecision(spec).switch(trainer, FP32)
    assert trainer.precision == FP32
    AgreedPrecision(spec).switch(trainer, BF16)
    assert trainer.precision == BF16


def this_cpu_has_bf16_arithmetic() -> bool:
    return bool(cpu_info()[1] & {"avx512_bf16", "amx_bf16"})


def test_this_cpu_resolves_auto_from_onednn_and_its_flags():
    """On this machine's real CPU: auto is bf16 exactly where the CPU has bf16 arithmetic (lscpu's flags) and
    oneDNN reaches it."""
    capability = probe("cpu")
    onednn = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert capability.bf16 == (this_cpu_has_bf16_arithmetic() and onednn)
    assert choose(capability) == (BF16 if capability.bf16 else FP32)
    assert f"oneDNN bf16 {'yes' if onednn else 'no'}" in capability.detail


def test_a_cpu_capped_at_avx2_through_onednn_resolves_to_fp32():
    """A real process with oneDNN's ISA capped at AVX2 (as on a CPU without bf16): oneDNN's own query says no,
    whatever this CPU has."""
    code = (
        "import json, torch; from rasterscale.runtime.precision import probe, choose; c = probe('cpu'); "
        "print(json.dumps([torch.ops.mkldnn._is_mkldnn_bf16_supported(), c.bf16, choose(c), c.detail]))"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    onednn, native, chosen, detail = json.loads(out)
    assert onednn is False and native is False and chosen == FP32 and "ONEDNN_MAX_CPU_ISA=AVX2" in detail


def test_every_rank_logs_its_precision_and_rank_zero_warns_once_of_an_emulated_value(tmp_path, caplog):
    # 16-mixed is emulated on every CPU (it autocasts to bf16 there)
    config = validate_config({"scenes": {"a": {"path": "a.tif"}}, "train": {"accelerator": "cpu", "precision": FP16}})
    spec = rank_layout(settings_of(config), "train")
    assert spec.precision == BF16 and spec.resolution is not None
    start_rank(spec, tmp_path, "rasterscale.test_precision")
    text = (tmp_path / "rank-0.log").read_text()
    assert "precision: train.precision bf16-mixed (set to 16-mixed) on cpu" in text
    warnings = [line for line in text.splitlines() if "WARNING" in line]
    assert len(warnings) == 1
    assert "train.precision '16-mixed'" in warnings[0] and "'train.precision: auto' picks" in warnings[0]
    logging.getLogger("rasterscale.test_precision").handlers.clear()


def output_dtypes(model: torch.nn.Module, layers: dict[str, torch.nn.Module], run) -> dict[str, torch.dtype]:
    """The dtype of each named layer's output while ``run`` runs the model under bf16 autocast."""
    seen: dict[str, torch.dtype] = {}

    def record(name: str):
        def hook(_module, _inputs, output) -> None:
            seen.setdefault(name, output.dtype)

        return hook

    hooks = [layer.register_forward_hook(record(name)) for name, layer in layers.items()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run(model)
    for hook in hooks:
        hook.remove()
    return seen


def test_the_models_output_layers_compute_in_fp32_under_bf16_autocast_with_their_parameter_names():
    """Training and prediction alike: under bf16 autocast the detector's box deltas and class logits, and the
    segmenter's class logits, come out in fp32 while the backbone runs in bf16 (tiny inputs: bf16 may be
    emulated here); the parameters keep a plain Conv2d's names, so model files do not change."""
    from rasterscale.tasks.detection.model import DetectorConfig, build_detector
    from rasterscale.tasks.segmentation.model import build_segmenter
    from rasterscale.tasks.segmentation.modelfiles import SegmenterConfig

    torch.manual_seed(0)
    detector = build_detector(DetectorConfig(backbone="resnet18", patch_size=64, fpn_channels=16))
    head = detector.head
    layers = {
        "stem": detector.backbone.body.conv1,
        "deltas": head.regression_head.bbox_reg,
        "logits": head.classification_head.cls_logits,
    }
    images = [torch.rand(3, 64, 64)]
    targets = [{"boxes": torch.tensor([[8.0, 8.0, 30.0, 30.0]]), "labels": torch.tensor([0])}]
    for mode, run in [("train", lambda m: m(images, targets)), ("eval", lambda m: m(images))]:
        detector.train(mode == "train")
        dtypes = output_dtypes(detector, layers, run)
        assert dtypes == {"stem": torch.bfloat16, "deltas": torch.float32, "logits": torch.float32}, mode
    names = set(detector.state_dict())
    assert {"head.regression_head.bbox_reg.weight", "head.classification_head.cls_logits.bias"} <= names
    assert not [name for name in names if ".layer." in name]

    segmenter = build_segmenter(SegmenterConfig(labels=("background", "tree"), patch_size=64)).eval()
    layers = {"stem": segmenter.net.encoder.conv1, "logits": segmenter.net.segmentation_head[0]}
    dtypes = output_dtypes(segmenter, layers, lambda m: m(torch.rand(1, 3, 64, 64)))
    assert dtypes == {"stem": torch.bfloat16, "logits": torch.float32}
    assert "net.segmentation_head.0.weight" in segmenter.state_dict()
