"""Exported model files as torch modules: each form loaded without running Python code from the file, checked
against its card, and wrapped (:class:`ExportedDense`) behind the card's normalization so that the dense tasks
run it as they run their own networks (batching, DDP ranks, blending, merges unchanged).

- **TorchScript** (``torch.jit.save``): ``torch.jit.load``, TorchScript's own interpreter (no pickled Python).
- **torch.export** (``torch.export.save``, ``.pt2``): never ``torch.export.load``, which trusts its file: the
  archive is vetted as a zip and the program loaded from its vetted records (:mod:`.pt2`: a graph of ATen operators
  and raw weights; pickles, native code and anything torch would turn into Python source are refused, and a program
  whose serialization schema is another major version than this torch's, first).
- **ONNX**: an ONNX Runtime session per device (CUDA's provider where the rank's device is a GPU and the provider
  is installed, else the CPU's), its threads those of the rank.

A file whose batch dimension is fixed gets its batches cut to that size, the last one padded.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rasterscale.errors import InputError
from rasterscale.tasks.exported.card import ModelCard
from rasterscale.tasks.exported.pt2 import load_program
from rasterscale.tasks.inputlayer import Normalize

ONNX_TYPES = {"tensor(float)": (np.float32, torch.float32), "tensor(float16)": (np.float16, torch.float16)}


def file_error(card: ModelCard, problem: str) -> InputError:
    return InputError(f"{card.path}: {problem}")


@dataclass(frozen=True)
class LoadedNet:
    """A loaded exported network: the module, its fixed batch size (None: any) and the input shape it declares
    (ints, or None where a dimension is dynamic; None when the form declares none)."""

    module: torch.nn.Module
    fixed_batch: int | None
    input_shape: tuple[int | None, ...] | None
    program: Any = None  # a torch.export program (its module is for the CPU: moved by ExportedDense)


def archive_names(card: ModelCard) -> list[str]:
    try:
        with zipfile.ZipFile(card.path) as archive:
            return archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return []


def load_torchscript(card: ModelCard) -> LoadedNet:
    names = archive_names(card)
    if not any("/code/" in name for name in names):
        what = "a torch.save file (a state dict or a pickled model?)" if names else "not a zip archive"
        raise file_error(
            card,
            f"not a TorchScript file: {what}; save the model with torch.jit.save(torch.jit.script(model) or "
            "torch.jit.trace(model, example)), or export it to .pt2 or .onnx",
        )
    try:
        module = torch.jit.load(card.path, map_location="cpu")
    except RuntimeError as err:
        raise file_error(card, f"TorchScript cannot load it ({first_line(err)})") from None
    return LoadedNet(module.eval(), None, None)


def load_torch_export(card: ModelCard) -> LoadedNet:
    program = load_program(card.path)
    shape = export_input_shape(program)
    return LoadedNet(program.module(), shape[0] if shape else None, shape, program)


def export_input_shape(program: Any) -> tuple[int | None, ...] | None:
    """The user input's shape of an exported program: ints where static, None where dynamic."""
    user = set(program.graph_signature.user_inputs)
    inputs = [node for node in program.graph.nodes if node.op == "placeholder" and node.name in user]
    if len(inputs) != 1 or "val" not in inputs[0].meta:
        return None
    return tuple(d if isinstance(d, int) else None for d in inputs[0].meta["val"].shape)


class OnnxNet(torch.nn.Module):
    """An ONNX file run by ONNX Runtime: one session per device, made at its first batch there."""

    def __init__(self, path: str, threads: int) -> None:
        super().__init__()
        self.path, self.threads = path, threads
        self.sessions: dict[str, Any] = {}
        self.probe = self.session(torch.device("cpu"))
        meta = self.probe.get_inputs()[0]
        self.input_name, self.output_name = meta.name, self.probe.get_outputs()[0].name
        self.np_type, self.torch_type = ONNX_TYPES.get(meta.type, (np.float32, torch.float32))
        # on a GPU, each input shape's output (shape, NumPy and torch dtypes), from its first batch: later batches
        # bind a torch tensor on the device for ONNX Runtime to write into, with no round trip through the host
        self.outputs: dict[tuple[int, ...], tuple[tuple[int, ...], np.dtype, torch.dtype]] = {}

    def session(self, device: torch.device) -> Any:
        import onnxruntime as ort

        key = str(device)
        if key not in self.sessions:
            options = ort.SessionOptions()
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
            providers: list[Any] = ["CPUExecutionProvider"]
            if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
                providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0}))
            self.sessions[key] = ort.InferenceSession(self.path, options, providers=providers)
        return self.sessions[key]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        session = self.session(images.device)
        batch = images.to(self.torch_type).contiguous()
        if "CUDAExecutionProvider" not in session.get_providers():
            out = session.run([self.output_name], {self.input_name: batch.cpu().numpy()})[0]
            return torch.from_numpy(np.asarray(out)).to(images.device)
        binding = session.io_binding()
        index = images.device.index or 0
        binding.bind_input(self.input_name, "cuda", index, self.np_type, tuple(batch.shape), batch.data_ptr())
        known = self.outputs.get(tuple(batch.shape))
        out = None
        if known is None:  # the shape's first batch: ONNX Runtime allocates the output, which is read once
            binding.bind_output(self.output_name, "cuda", index)
        else:
            shape, element, dtype = known
            out = torch.empty(shape, dtype=dtype, device=images.device)
            binding.bind_output(self.output_name, "cuda", index, element, shape, out.data_ptr())
        # ONNX Runtime's CUDA provider runs on a stream of its own that does not wait for torch's, and a bound
        # pointer gives it none to wait on: the kernels that made ``batch`` (the input copy, the scaling, the cast)
        # must be done before it reads it (and its run ends synchronized: ``out`` is written when it returns)
        torch.cuda.current_stream(images.device).synchronize()
        session.run_with_iobinding(binding)
        if out is not None:
            return out
        host = binding.copy_outputs_to_cpu()[0]
        result = torch.from_numpy(host)
        self.outputs[tuple(batch.shape)] = (tuple(host.shape), host.dtype, result.dtype)
        return result.to(images.device)


def load_onnx(card: ModelCard) -> LoadedNet:
    try:
        net = OnnxNet(card.path, torch.get_num_threads())
    except ImportError:
        raise file_error(card, "ONNX files need onnxruntime (envs/requirements.txt pins it)") from None
    except Exception as err:  # onnxruntime's own exception types (InvalidProtobuf, Fail, ...)
        raise file_error(card, f"not a readable ONNX model ({first_line(err)})") from None
    inputs, outputs = net.probe.get_inputs(), net.probe.get_outputs()
    if len(inputs) != 1:
        raise file_error(card, f"the file takes {len(inputs)} inputs ({', '.join(i.name for i in inputs)}); one image")
    shape = tuple(d if isinstance(d, int) else None for d in inputs[0].shape)
    out = outputs[0].shape
    if len(out) != 4 or not isinstance(out[1], int):
        raise file_error(
            card,
            f"output '{outputs[0].name}' has a dynamic shape {list(out)} the card cannot resolve: a dense model's "
            f"output is (batch, {card.outputs} {card.output}, height, width) with a fixed channel count",
        )
    return LoadedNet(net, shape[0] if shape else None, shape)


LOADERS = {"onnx": load_onnx, "torch.export": load_torch_export, "torchscript": load_torchscript}


def first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:200]


def check_input_shape(card: ModelCard, shape: Sequence[int | None] | None) -> None:
    """A declared input shape against the card: 4 dimensions, the card's band count, its tile size."""
    if shape is None:
        return
    expected = f"(batch, {card.input.count}, {card.patch_size}, {card.patch_size})"
    if len(shape) != 4:
        raise file_error(card, f"the file takes input of shape {list(shape)}, the card {expected}")
    channels, height, width = shape[1:]
    if channels is not None and channels != card.input.count:
        raise file_error(
            card,
            f"the file takes {channels} bands (input {shape_text(shape)}) but the card names {card.input.count} "
            f"({', '.join(card.input.names)}): {expected}",
        )
    for side in (height, width):
        if side is not None and side != card.patch_size:
            raise file_error(card, f"the file takes tiles of shape {shape_text(shape)}, the card {expected}")


def shape_text(shape: Sequence[int | None]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def load_net(card: ModelCard) -> LoadedNet:
    """The card's file loaded on the CPU and its declared input checked against the card (one line naming the
    file otherwise)."""
    loaded = LOADERS[card.form](card)
    check_input_shape(card, loaded.input_shape)
    return loaded


def run_in_batches(module: torch.nn.Module, images: torch.Tensor, fixed: int | None) -> torch.Tensor:
    """``module(images)``; for a file of fixed batch size, in slices of that size (the last one zero-padded)."""
    if fixed is None or len(images) == fixed:
        return module(images)
    outputs = []
    for start in range(0, len(images), fixed):
        part = images[start : start + fixed]
        pad = fixed - len(part)
        if pad:
            part = torch.cat([part, part.new_zeros((pad, *part.shape[1:]))])
        outputs.append(module(part)[: fixed - pad])
    return torch.cat(outputs)


def check_output(card: ModelCard, loaded: LoadedNet) -> tuple[int, ...]:
    """One tile of the card's shape (zeros: no data) through the file; its output shape must be the card's."""
    batch = loaded.fixed_batch or 1
    size = card.patch_size
    dummy = torch.zeros(batch, card.input.count, size, size)
    try:
        with torch.inference_mode():
            out = loaded.module(dummy)
    except Exception as err:  # whatever the file's own code raises
        raise file_error(
            card, f"the file fails on a tile of the card's shape {shape_text(dummy.shape)} ({first_line(err)})"
        ) from None
    got = tuple(out.shape) if isinstance(out, torch.Tensor) else ()
    expected = card.expected_output(batch, size, size)
    if got != expected:
        raise file_error(
            card,
            f"the card promises output {shape_text(expected)} ({card.outputs} {card.output} at stride "
            f"{card.output_stride}) for input {shape_text(dummy.shape)}, but the file gives "
            f"{shape_text(got) if got else type(out).__name__}",
        )
    return got


def keeps_output_channels_last(net: torch.nn.Module, card: ModelCard, fixed_batch: int | None) -> bool:
    """Whether the file gives one random tile of the card's shape the same output (within float rounding: another
    kernel's order of sums) from a channels_last input as from a contiguous one: a network whose own code reshapes
    its input with ``view`` fails on it, and keeps contiguous inputs."""
    generator = torch.Generator().manual_seed(0)
    tile = torch.rand(fixed_batch or 1, card.input.count, card.patch_size, card.patch_size, generator=generator)
    try:
        with torch.inference_mode():
            plain = net(tile)
            strided = net(tile.contiguous(memory_format=torch.channels_last))
    except Exception:  # whatever the file's own code raises on strides it did not expect
        return False
    if not (isinstance(plain, torch.Tensor) and isinstance(strided, torch.Tensor)) or plain.shape != strided.shape:
        return False
    scale = float(plain.float().abs().max()) or 1.0
    return bool(torch.allclose(plain.float(), strided.float(), rtol=1e-4, atol=1e-5 * scale))


class ExportedDense(torch.nn.Module):
    """An exported dense network behind its card: float tiles (N, B, H, W) in [0, 1] (scaled) or raw values,
    normalized by the card, run in the file's batch size, brought back to the tiles' size (``output_stride``)
    and returned as the dense tasks' networks return them: logits (probabilities as their logarithm, which
    softmax maps back to themselves) or values."""

    def __init__(self, card: ModelCard, loaded: LoadedNet) -> None:
        super().__init__()
        self.card = card
        self.net = loaded.module
        self.fixed_batch = loaded.fixed_batch
        self.normalize = Normalize(card.input)
        self.program, self.program_device = loaded.program, torch.device("cpu")
        self.channels_last = False  # inputs made channels_last (:meth:`prepare`)

    def prepare(self, channels_last: bool) -> ExportedDense:
        """Eval mode, and (when asked, ``predict.channels_last``) channels_last input batches where the file keeps
        its output with them (:func:`keeps_output_channels_last`): a TorchScript or torch.export network's
        convolutions run faster so on CPUs and GPUs (the null model's 1x1 convolution 10x on an AVX2 CPU, a U-Net
        10-25%). ONNX Runtime takes contiguous arrays and lays them out itself."""
        strided = channels_last and self.card.form != "onnx"
        self.channels_last = strided and keeps_output_channels_last(self.net, self.card, self.fixed_batch)
        return self.eval()

    def on_device_of(self, images: torch.Tensor) -> None:
        """A torch.export program asserts the device it was loaded on: moved (its graph rewritten by
        ``move_to_device_pass``, not only its tensors) to the device of the first batch on another."""
        if self.program is None or images.device == self.program_device:
            return
        from torch.export.passes import move_to_device_pass

        self.net = move_to_device_pass(self.program, images.device).module()
        self.program_device = images.device

    def train(self, mode: bool = True) -> ExportedDense:
        """Only this wrapper's flag: an exported network's mode was fixed when it was exported (a torch.export
        module refuses ``train()``/``eval()``)."""
        self.training = mode
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if self.card.form == "torch.export":  # its graph asserts the dtypes it was exported with: no autocast
            self.on_device_of(images)
            with torch.autocast(images.device.type, enabled=False):
                out = run_in_batches(self.net, self.normalize(images), self.fixed_batch)
        else:
            out = run_in_batches(self.net, self.normalize(images), self.fixed_batch)
        if self.card.output_stride != 1:
            out = F.interpolate(out.float(), size=images.shape[-2:], mode="bilinear", align_corners=False)
        if self.card.output == "probabilities":
            out = torch.log(out.float().clamp_min(1e-12))
        elif self.card.output == "heatmap":  # a point model's heatmap: its logits, which a sigmoid maps back
            out = torch.logit(out.float(), eps=1e-6)
        # the dense tasks' layout (a softmax over a few classes, and the blend's reads per tile, are slower strided)
        return out.contiguous()


def load_exported(card: ModelCard) -> ExportedDense:
    """The card's file, loaded and checked, ready to predict (eval mode; moved to a rank's device by Lightning)."""
    loaded = load_net(card)
    check_output(card, loaded)
    return ExportedDense(card, loaded).eval()


def check_exported(card: ModelCard) -> tuple[int, ...]:
    """The dry run's check of a card against its file: the file loads in its form, its declared input is the
    card's, and one dummy tile's output has the card's shape. The output shape."""
    return check_output(card, load_net(card))
