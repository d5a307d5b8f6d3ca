"""Reduced precision per model: ``[models.<name>] precision = "fp32" | "int8" | "fp16" | "bf16"``.

- ``fp32`` (default): the model as loaded.
- ``int8`` (CPU): dynamic quantization of the ``nn.Linear`` layers (weights int8 per output
  channel, activations quantized per tensor at run time; ``torch.ao.quantization``), but
  those an adapter keeps fp32 (a pattern of module names; the text model keeps its FFN
  output projections, whose post-GELU inputs lose most under int8). Given
  calibration batches, the Linear inputs are smoothed first (SmoothQuant, Xiao et al. 2023):
  each input channel ``j`` is divided by ``s_j = max|X_j|^alpha / max|W_:,j|^(1-alpha)`` and
  the weight column multiplied by it, which leaves the fp32 function unchanged but moves
  activation outliers into the weights, where per-channel int8 absorbs them. Without it a
  transformer's per-tensor activation quantization loses most of its accuracy to a few
  outlier channels.
- ``fp16`` / ``bf16`` (CUDA only): the model's parameters cast to that dtype.

Applied once at load, before TorchScript tracing and warmup; the worker's facts report it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shared.model_kinds import INT8_SMOOTH_ALPHA, PRECISIONS

DEFAULT_SMOOTH_ALPHA = INT8_SMOOTH_ALPHA  # the options default (shared.model_kinds)


# CPU features with int8 dot-product instructions, which oneDNN's int8 kernels use and
# fbgemm's dynamic Linear (torch's default "x86" engine picks it) does not.
_INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def resolve_int8_engine(choice: str, cpu_flags: Iterable[str] | None = None) -> str:
    """The quantized engine int8 runs on: ``choice`` (``"auto"``, or one of
    ``torch.backends.quantized.supported_engines``).

    ``auto``: ``onednn`` where torch has it and the CPU has int8 dot-product instructions
    (``_INT8_DOT_FLAGS``, read from ``/proc/cpuinfo``), else torch's default engine. Measured
    on the development host (AVX-512 VNNI and AMX): the int8 text model's in-process
    throughput is about a sixth higher on ``onednn`` than on ``x86``/``fbgemm``
    (``docs/models.md``, *Reduced precision*; runs in ``docs/measurements/``).

    Raises:
        ValueError: ``choice`` is not an engine of this torch build.
    """
    supported = list(torch.backends.quantized.supported_engines)
    if choice != "auto":
        if choice not in supported:
            raise ValueError(f"int8 engine {choice!r} is not one of this torch's: {supported}")
        return choice
    flags = set(cpu_flags if cpu_flags is not None else _cpu_flags())
    if "onednn" in supported and flags & set(_INT8_DOT_FLAGS):
        return "onednn"
    return str(torch.backends.quantized.engine)


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].split()
    except OSError:  # not Linux: torch's default engine
        pass
    return []


def use_int8_engine(engine: str) -> None:
    """Make ``engine`` the process's quantized engine (int8 weights are packed for, and run
    on, the engine current when they are quantized; a worker holds one model)."""
    torch.backends.quantized.engine = engine


def parse_precision(value: Any, device: torch.device) -> str:
    """The precision a model config asks for, checked against the device.

    Raises:
        ValueError: an unknown name, ``int8`` on CUDA (dynamic quantization runs on CPU
            kernels only), or ``fp16``/``bf16`` on CPU (no fast kernels there).
    """
    name = str(value or "fp32").strip().lower()
    if name not in PRECISIONS:
        raise ValueError(f"model config 'precision' must be one of {PRECISIONS}, got {value!r}")
    if name == "int8" and device.type != "cpu":
        raise ValueError("precision 'int8' is CPU dynamic quantization; on CUDA use fp16 or bf16")
    if name in ("fp16", "bf16") and device.type != "cuda":
        raise ValueError(f"precision {name!r} needs a CUDA device; on CPU use fp32 or int8")
    return name


class _Smoothed(torch.nn.Module):
    """``linear(x * inv_scale)``: a Linear whose weight columns were multiplied by the scale."""

    def __init__(self, inv_scale: torch.Tensor, linear: torch.nn.Module) -> None:
        super().__init__()
        self.register_buffer("inv_scale", inv_scale)
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * self.inv_scale)


def input_absmax(
    model: torch.nn.Module, batches: Iterable[Callable[[torch.nn.Module], Any]]
) -> dict[str, torch.Tensor]:
    """Per Linear (by module name), the max ``|x|`` of each input channel over ``batches``.

    Args:
        batches: callables that run one calibration batch through the model given to them.
    """
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):

            def hook(_m: Any, inp: tuple[torch.Tensor, ...], _out: Any, name: str = name) -> None:
                x = inp[0].detach().abs().reshape(-1, inp[0].shape[-1]).amax(0).float()
                amax[name] = torch.maximum(amax[name], x) if name in amax else x

            hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            for run in batches:
                run(model)
    finally:
        for h in hooks:
            h.remove()
    return amax


def smooth(
    model: torch.nn.Module, amax: dict[str, torch.Tensor], alpha: float = DEFAULT_SMOOTH_ALPHA
) -> torch.nn.Module:
    """A copy of ``model`` with each calibrated Linear wrapped as ``_Smoothed`` (same function
    in fp32, up to rounding). ``alpha`` in (0, 1]: how much of the outliers moves to weights."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"smoothing alpha must be in (0, 1], got {alpha}")
    out = copy.deepcopy(model)
    for parent_name, parent in list(out.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if not isinstance(child, torch.nn.Linear) or full not in amax:
                continue
            w_max = child.weight.detach().abs().amax(0).float().clamp(min=1e-5)
            s = (amax[full].clamp(min=1e-5) ** alpha / w_max ** (1.0 - alpha)).clamp(min=1e-5)
            linear = torch.nn.Linear(child.in_features, child.out_features, child.bias is not None)
            linear.weight.data = child.weight.detach() * s.to(child.weight.dtype)
            if child.bias is not None:
                linear.bias.data = child.bias.detach().clone()
            setattr(parent, child_name, _Smoothed((1.0 / s).to(child.weight.dtype), linear))
    return out.eval().requires_grad_(False)


def quantize_int8(
    model: torch.nn.Module,
    calibration: Iterable[Callable[[torch.nn.Module], Any]] | None = None,
    alpha: float = DEFAULT_SMOOTH_ALPHA,
    keep_fp32: str | None = None,
) -> torch.nn.Module:
    """``model`` with its Linear layers dynamically quantized to int8 (per-channel weights),
    smoothed first when ``calibration`` batches are given. CPU only.

    Args:
        keep_fp32: a regular expression; Linear layers whose module name matches it in full
            stay fp32 (neither smoothed nor quantized): the layers whose inputs int8 cannot
            hold, e.g. a transformer's FFN output projection after GELU.

    Raises:
        ValueError: ``keep_fp32`` is not a valid regular expression, or matches every Linear.
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    try:
        keep = re.compile(keep_fp32) if keep_fp32 else None
    except re.error as exc:
        raise ValueError(f"int8 keep_fp32 pattern {keep_fp32!r}: {exc}") from None
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    chosen = [n for n in names if keep is None or not keep.fullmatch(n)]
    if names and not chosen:
        raise ValueError(f"int8 keep_fp32 pattern {keep_fp32!r} keeps every Linear layer fp32")
    if calibration is not None:
        amax = input_absmax(model, calibration)
        model = smooth(model, {n: a for n, a in amax.items() if n in chosen}, alpha)
        chosen = [f"{n}.linear" if n in amax else n for n in chosen]  # inside _Smoothed now
    spec = {n: per_channel_dynamic_qconfig for n in chosen}
    return quantize_dynamic(model, spec, dtype=torch.qint8).eval().requires_grad_(False)


def apply_precision(
    model: torch.nn.Module,
    precision: str,
    calibration: Iterable[Callable[[torch.nn.Module], Any]] | None = None,
    alpha: float = DEFAULT_SMOOTH_ALPHA,
    keep_fp32: str | None = None,
) -> torch.nn.Module:
    """``model`` in ``precision`` (already checked by :func:`parse_precision`); ``int8``'s
    options as in :func:`quantize_int8`."""
    if precision == "int8":
        return quantize_int8(model, calibration, alpha, keep_fp32)
    if precision == "fp16":
        return model.half()
    if precision == "bf16":
        return model.to(torch.bfloat16)
    return model
