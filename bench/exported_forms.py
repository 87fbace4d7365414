"""One U-Net's pure forward in each form a user may bring: eager, TorchScript, torch.export and ONNX Runtime, in
tiles/s, at fp32 and at the device's low precision (bf16 where it runs, else fp16 on CUDA). Each form's classes
are compared with eager fp32's (agreement of the argmax). Standalone: torch, segmentation-models-pytorch and,
where installed, onnxruntime; writes a JSON and prints a table.

    python bench/exported_forms.py --device cuda --out results/exported-forms.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

Forward = Callable[[torch.Tensor], torch.Tensor]


def build_unet(encoder: str, bands: int, classes: int) -> torch.nn.Module:
    import segmentation_models_pytorch as smp

    return smp.Unet(encoder_name=encoder, encoder_weights=None, in_channels=bands, classes=classes).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
    else:
        with torch.autocast(device.type, dtype=dtype):
            yield


def rate(forward: Forward, batches: list[torch.Tensor], device: torch.device, rounds: int) -> float:
    """Median tiles/s over ``rounds`` passes over ``batches`` (after one warm-up pass)."""
    with torch.inference_mode():
        for batch in batches[:2]:
            forward(batch)
        synchronize(device)
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            for batch in batches:
                forward(batch)
            synchronize(device)
            times.append(time.perf_counter() - started)
    tiles = sum(len(b) for b in batches)
    return tiles / statistics.median(times)


def classes_of(forward: Forward, batch: torch.Tensor) -> np.ndarray:
    with torch.inference_mode():
        return forward(batch).float().argmax(1).cpu().numpy()


def onnx_session(path: Path, device: torch.device) -> Any:
    import onnxruntime as ort

    providers = ["CPUExecutionProvider"]
    if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        providers = [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=providers)


def onnx_forward(session: Any, device: torch.device, dtype: torch.dtype) -> Forward:
    """Run the session on device tensors through IO binding (no host round trip on CUDA)."""
    name = session.get_inputs()[0].name
    output = session.get_outputs()[0].name
    on_cuda = "CUDAExecutionProvider" in session.get_providers()

    def forward(batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(dtype).contiguous()
        if not on_cuda:
            return torch.from_numpy(session.run([output], {name: batch.cpu().numpy()})[0])
        binding = session.io_binding()
        np_type = np.float16 if dtype == torch.float16 else np.float32
        binding.bind_input(name, "cuda", device.index or 0, np_type, tuple(batch.shape), batch.data_ptr())
        binding.bind_output(output, "cuda", device.index or 0)
        session.run_with_iobinding(binding)
        return torch.from_numpy(binding.copy_outputs_to_cpu()[0])

    return forward


def export_onnx(model: torch.nn.Module, example: torch.Tensor, path: Path) -> str:
    try:
        torch.onnx.export(
            model,
            (example,),
            str(path),
            input_names=["image"],
            output_names=["logits"],
            dynamo=True,
            dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
        )
        return "dynamo"
    except Exception:
        torch.onnx.export(
            model,
            (example,),
            str(path),
            input_names=["image"],
            output_names=["logits"],
            dynamo=False,
            dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=17,
        )
        return "torchscript"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    low = torch.bfloat16 if (device.type == "cpu" or torch.cuda.is_bf16_supported()) else torch.float16
    torch.manual_seed(0)
    model = build_unet(args.encoder, args.bands, args.classes).to(device)
    batches = [torch.rand(args.batch, args.bands, args.tile, args.tile, device=device) for _ in range(args.batches)]
    example = batches[0]
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "encoder": args.encoder,
        "tile": args.tile,
        "batch": args.batch,
        "low": str(low).split(".")[-1],
        "forms": {},
    }
    with torch.inference_mode():
        reference = classes_of(model, example)
    work = Path(tempfile.mkdtemp(prefix="forms-"))

    def record(form: str, precision: str, build: Callable[[], Forward]) -> None:
        key = f"{form} {precision}"
        try:
            forward = build()
            tiles_s = rate(forward, batches, device, args.rounds)
            agree = float((classes_of(forward, example) == reference).mean())
            result["forms"][key] = {"tiles_s": round(tiles_s, 1), "agreement": round(agree, 5)}
        except Exception as err:
            result["forms"][key] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            traceback.print_exc()
        print(key, result["forms"][key], flush=True)

    def casted(forward: Forward, dtype: torch.dtype | None) -> Forward:
        def run(batch: torch.Tensor) -> torch.Tensor:
            with autocast(device, dtype):
                return forward(batch)

        return run

    for precision, dtype in (("fp32", None), (result["low"], low)):
        record("eager", precision, lambda dtype=dtype: casted(model, dtype))

    def scripted() -> Forward:
        path = work / "model.torchscript.pt"
        with torch.inference_mode(False), torch.no_grad():
            torch.jit.save(torch.jit.trace(model, example[:1]), str(path))
        return torch.jit.load(str(path), map_location=device)

    def exported() -> Forward:
        path = work / "model.pt2"
        with torch.inference_mode(False), torch.no_grad():
            program = torch.export.export(
                model, (example[:2].clone(),), dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1, max=1024)}}
            )
        torch.export.save(program, str(path))
        return torch.export.load(str(path)).module()

    loaded: dict[str, Forward] = {}
    for form, build in (("torchscript", scripted), ("torch.export", exported)):
        for precision, dtype in (("fp32", None), (result["low"], low)):

            def make(form: str = form, build: Callable[[], Forward] = build, dtype: Any = dtype) -> Forward:
                if form not in loaded:
                    loaded[form] = build()
                return casted(loaded[form], dtype)

            record(form, precision, make)

    try:
        import onnxruntime as ort

        result["onnxruntime"] = {"version": ort.__version__, "providers": ort.get_available_providers()}
        path = work / "model.onnx"
        with torch.inference_mode(False), torch.no_grad():
            result["onnx_exporter"] = export_onnx(model, example[:2].clone(), path)
        record("onnxruntime", "fp32", lambda: onnx_forward(onnx_session(path, device), device, torch.float32))
        if device.type == "cuda":

            def half() -> Forward:
                import onnx
                from onnxruntime.transformers.float16 import convert_float_to_float16

                half_path = work / "model.fp16.onnx"
                onnx.save(convert_float_to_float16(onnx.load(str(path)), keep_io_types=False), str(half_path))
                return onnx_forward(onnx_session(half_path, device), device, torch.float16)

            record("onnxruntime", "fp16", half)
    except ImportError as err:
        result["onnxruntime"] = {"error": str(err)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--encoder", default="resnet18")
    parser.add_argument("--bands", type=int, default=3)
    parser.add_argument("--classes", type=int, default=3)
    parser.add_argument("--tile", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/exported-forms.json"))
    args = parser.parse_args()
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'form':<26}{'tiles/s':>10}{'agreement':>11}")
    for key, row in result["forms"].items():
        print(f"{key:<26}{row.get('tiles_s', '-'):>10}{row.get('agreement', row.get('error', '')):>11}")


if __name__ == "__main__":
    main()
