"""Numeric precision per device: what ``precision: auto`` resolves to on the device a rank runs on, which explicit
values that device only emulates, and the one value every rank of a job uses.

``auto`` (the default of ``train.precision`` and ``predict.precision``) picks, on each rank's own device:

- CUDA with native bf16 (compute capability 8.0 or more: A100, H100, L4, ...): ``bf16-mixed``;
- older CUDA (V100, T4, P100): ``16-mixed`` (training with a gradient scaler);
- a CPU that oneDNN says runs bf16 natively (AVX512-BF16 or AMX, and not capped below them by
  ``ONEDNN_MAX_CPU_ISA``): ``bf16-mixed``;
- any other CPU: ``32-true`` (there bf16 autocast is emulated: a RetinaNet trains 27x and predicts 70x slower).

Under autocast the models' output convolutions (a detector's box deltas and class logits, a segmenter's class
logits) still compute in fp32 (:class:`Float32Conv2d`, built so by the tasks' model builders), in training as in
inference: in bf16 their 8-bit mantissa moves boxes by pixels and coarsens the loss the models learn from
(docs/performance.md gives the figures).

An explicit value is obeyed; one this device emulates (bf16 without native bf16, fp16 on a CPU, which autocasts to
bf16 there as Lightning does) gets one warning line naming the key and ``auto``. The decision (:func:`choose`,
:func:`emulation`, :func:`agree`) works on a :class:`Capability`, so each rule is testable without its device;
:func:`probe` measures the capability of this rank's device.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, cast

import torch

# a value a rank runs at (resolved, never "auto"): what Lightning's Trainer and precision plugins take
PrecisionValue = Literal["32-true", "bf16-mixed", "16-mixed"]
# a value of train.precision / predict.precision
PrecisionSetting = Literal["auto", "32-true", "bf16-mixed", "16-mixed"]

AUTO: Final = "auto"
FP32: Final = "32-true"
BF16: Final = "bf16-mixed"
FP16: Final = "16-mixed"
CHOICES: tuple[PrecisionSetting, ...] = (AUTO, FP32, BF16, FP16)
# from least to most demanding of the device: the value a whole job can agree on is the least of its ranks'
AGREEMENT_ORDER: tuple[PrecisionValue, ...] = (FP32, FP16, BF16)

CUDA_BF16_MAJOR = 8  # compute capability from which CUDA runs bf16 natively (Ampere)
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo flags of x86 CPUs with bf16 arithmetic
ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
# oneDNN ISA names (ONEDNN_MAX_CPU_ISA) below avx512_core_bf16: capped there, oneDNN emulates bf16
ISAS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX10_1_256"}
)


@dataclass(frozen=True)
class Capability:
    """What a rank's device can do in reduced precision: ``device`` "cpu" or "cuda", its name, whether it runs
    bf16 natively, and the facts that decided it (for the log)."""

    device: str
    name: str
    bf16: bool
    detail: str

    def __str__(self) -> str:
        return f"{self.device} {self.name} ({self.detail})"


@dataclass(frozen=True)
class Resolution:
    """The precision a rank runs at: the setting's ``key`` and requested value, the value used, its device's
    capability, and the warning line where the device emulates the value used."""

    key: str
    requested: str
    value: PrecisionValue
    capability: Capability
    warning: str | None = None

    def describe(self) -> str:
        how = "auto" if self.requested == AUTO else f"set to {self.requested}"
        return f"{self.key} {self.value} ({how}) on {self.capability}"


class Float32Conv2d(torch.nn.Conv2d):
    """A convolution that computes in fp32 even under autocast: a model's output layer, whose values need fp32
    accuracy. Cheap (a few output channels); its parameters are named as a Conv2d's, so model files are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return super().forward(x.float())


def float32_conv(conv: torch.nn.Conv2d) -> Float32Conv2d:
    """``conv`` as a :class:`Float32Conv2d` with the same parameters (shared, not copied)."""
    # torch types a convolution's geometry as any tuple (_ConvNd's); a Conv2d's are pairs (padding: or a string)
    layer = Float32Conv2d(
        conv.in_channels,
        conv.out_channels,
        cast("tuple[int, int]", conv.kernel_size),
        stride=cast("tuple[int, int]", conv.stride),
        padding=cast("str | tuple[int, int]", conv.padding),
        dilation=cast("tuple[int, int]", conv.dilation),
        groups=conv.groups,
        bias=conv.bias is not None,
        padding_mode=conv.padding_mode,
        device="meta",
    )
    layer.weight, layer.bias = conv.weight, conv.bias
    return layer


class Float32Linear(torch.nn.Linear):
    """A linear layer that computes in fp32 even under autocast (a detector's box regressions and class scores:
    decoded boxes take the dtype of their regressions); named as a Linear's, so model files are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return super().forward(x.float())


def float32_linear(linear: torch.nn.Linear) -> Float32Linear:
    """``linear`` as a :class:`Float32Linear` with the same parameters (shared, not copied)."""
    layer = Float32Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    layer.weight, layer.bias = linear.weight, linear.bias
    return layer


def choose(capability: Capability) -> PrecisionValue:
    """What ``auto`` picks on a device (module docstring)."""
    if capability.bf16:
        return BF16
    return FP16 if capability.device == "cuda" else FP32


def emulation(precision: str, capability: Capability) -> str | None:
    """Why ``precision`` runs emulated (slower than fp32) on this device, or None where it runs natively."""
    if precision == FP16 and capability.device == "cpu":
        native = "natively" if capability.bf16 else "emulated"
        return f"a CPU has no fp16 autocast: it runs as {BF16}, {native} on {capability.name}"
    if precision == BF16 and not capability.bf16:
        return f"bf16 is emulated on {capability.name} ({capability.detail})"
    return None


def resolve(key: str, requested: str, capability: Capability) -> Resolution:
    """The value a rank uses for the setting ``key`` (``train.precision``, ``predict.precision``)."""
    if requested not in CHOICES:
        raise ValueError(f"{key}: unknown precision {requested!r} (one of {', '.join(CHOICES)})")
    if requested == AUTO:
        return Resolution(key, requested, choose(capability), capability)
    value = BF16 if requested == FP16 and capability.device == "cpu" else requested
    reason = emulation(requested, capability)
    warning = None
    if reason is not None:
        warning = (
            f"{key} '{requested}': {reason}, slower than fp32; "
            f"'{key}: {AUTO}' picks {choose(capability)} on this device"
        )
    return Resolution(key, requested, value, capability, warning)


def agree(values: Sequence[PrecisionValue]) -> PrecisionValue:
    """The one value for a job whose ranks resolved ``values``: the least demanding (a rank without native bf16
    makes the whole job use what it runs natively: no job trains half in fp16)."""
    return min(values, key=AGREEMENT_ORDER.index)


def isa_cap_allows_bf16(environ: os._Environ[str] | dict[str, str] | None = None) -> tuple[bool, str]:
    """Whether oneDNN's ISA cap (``ONEDNN_MAX_CPU_ISA``) leaves bf16 instructions in reach, and the cap's text."""
    environ = os.environ if environ is None else environ
    for name in ISA_CAP_VARIABLES:
        cap = environ.get(name, "").strip().upper()
        if cap:
            return cap not in ISAS_WITHOUT_BF16, f"{name}={cap}"
    return True, ""


def cpu_info() -> tuple[str, frozenset[str]]:
    """This CPU's model name and flags (Linux' /proc/cpuinfo; elsewhere the platform's name and no flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), frozenset()
    name, flags = "", frozenset[str]()
    for line in text.splitlines():
        field, _, value = line.partition(":")
        field = field.strip()
        if field == "model name" and not name:
            name = value.strip()
        elif field in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return name or platform.machine(), flags


def cpu_capability(onednn_bf16: bool, flags: frozenset[str], name: str, isa_cap: tuple[bool, str]) -> Capability:
    """A CPU's capability from oneDNN's own query (``torch.ops.mkldnn._is_mkldnn_bf16_supported``: an effective
    ISA of avx512_core or more, which honours ``ONEDNN_MAX_CPU_ISA``), its flags and the ISA cap. On x86 oneDNN
    also says yes for AVX-512 without bf16 arithmetic, which it emulates: the flags tell those apart."""
    allowed, cap = isa_cap
    x86 = bool(flags & {"avx2", "avx", "sse4_2"})
    hardware = bool(flags & CPU_BF16_FLAGS) if x86 else onednn_bf16
    native = onednn_bf16 and hardware and allowed
    facts = [f"oneDNN bf16 {'yes' if onednn_bf16 else 'no'}"]
    if x86:
        facts.append(", ".join(sorted(flags & CPU_BF16_FLAGS)) or "no avx512_bf16/amx_bf16")
    if cap:
        facts.append(cap)
    return Capability("cpu", name, native, "; ".join(facts))


def cuda_capability(major: int, minor: int, name: str) -> Capability:
    """A CUDA device's capability from its compute capability."""
    return Capability("cuda", name, major >= CUDA_BF16_MAJOR, f"compute capability {major}.{minor}")


def probe(accelerator: str, device_index: int = 0) -> Capability:
    """The capability of this rank's device: the CPU, or CUDA device ``device_index``."""
    if accelerator == "gpu":
        major, minor = torch.cuda.get_device_capability(device_index)
        return cuda_capability(major, minor, torch.cuda.get_device_name(device_index))
    name, flags = cpu_info()
    onednn = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return cpu_capability(onednn, flags, name, isa_cap_allows_bf16())


def local_device_index() -> int:
    """The index of this rank's device on its node: its local rank (Lightning's launcher, or srun's)."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0
