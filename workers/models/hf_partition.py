"""Does a model folder's weights fit the worker's memory partition? Checked before loading.

The weights' size is read from the folder's ``*.safetensors`` headers (every tensor's dtype
and shape; no tensor data is read), or from the size of its ``*.bin`` files, and counted at
the precision the model will run in (4 bytes a parameter in fp32, 2 in fp16/bf16).

The partition is the worker's ``[modalities.<m>.device] memory_fraction``: of the GPU's
memory on CUDA (the limit ``torch.cuda.set_per_process_memory_fraction`` enforces, see
:mod:`workers.models.runtime`); of the host's memory on the CPU (the cgroup's limit when
lower), which is what a CPU worker shares with the fleet's other workers. A model whose
weights alone exceed it is refused with :class:`ModelTooLarge` naming both sizes: it would
fail (or push other workers out) at its first batch anyway.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from shared.errors import DeviceError

if TYPE_CHECKING:
    from workers.models.runtime import DeviceRuntime

_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


class ModelTooLarge(DeviceError):
    """A model's weights do not fit the worker's memory partition. A load error: never a
    request's result, so not one of :mod:`shared.errors`' stored codes."""

    code = "MODEL_TOO_LARGE"


def _safetensors_params(path: Path) -> int:
    """Parameters in one ``.safetensors`` file, from its header (8-byte length + JSON)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        count = 1
        for d in meta["shape"]:
            count *= int(d)
        total += count
    return total


def weight_params(folder: Path) -> int:
    """Parameters the folder's weights hold (safetensors headers; else ``.bin`` bytes / 4).

    Raises:
        DeviceError: no weights file in the folder (``*.safetensors`` or ``*.bin``).
    """
    st = sorted(folder.glob("*.safetensors"))
    if st:
        return sum(_safetensors_params(p) for p in st)
    bins = sorted(folder.glob("*.bin"))
    if bins:
        return sum(p.stat().st_size for p in bins) // 4
    raise DeviceError(f"{str(folder)!r} holds no weights (*.safetensors or *.bin)")


def host_memory_bytes() -> int:
    """This process's memory: physical memory, or the cgroup (v2) limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:
        pass
    return total


def partition_bytes(
    device_type: str, memory_fraction: float, device_index: int = 0
) -> tuple[int, str]:
    """``(bytes, description)`` of a worker's memory partition.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        memory_fraction: ``[modalities.<m>.device] memory_fraction``.
        device_index: the CUDA device.
    """
    if device_type == "cuda":
        import torch

        total = int(torch.cuda.get_device_properties(device_index).total_memory)
        where = f"cuda:{device_index}"
    else:
        total = host_memory_bytes()
        where = "the host (cpu)"
    part = int(total * memory_fraction)
    return part, f"memory_fraction {memory_fraction:g} of {_mib(total)} on {where}"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_fits(name: str, params: int, precision: str, partition: int, where: str) -> int:
    """The weights' bytes, if they fit ``partition``.

    Raises:
        ModelTooLarge: ``params`` at ``precision`` need more than ``partition`` bytes.
    """
    need = params * _DTYPE_BYTES.get(precision, 4)
    if need > partition:
        raise ModelTooLarge(
            f"model {name!r}: its weights need {need:,} bytes ({_mib(need)}: {params:,} "
            f"parameters in {precision}), above the worker's memory partition of "
            f"{partition:,} bytes ({_mib(partition)}: {where})"
        )
    return need


def check_runtime_fits(name: str, folder: Path, precision: str, runtime: DeviceRuntime) -> int:
    """:func:`check_fits` of ``folder``'s weights against ``runtime``'s partition (its
    device and ``memory_fraction``); the weights' bytes.

    Raises:
        ModelTooLarge: they do not fit.
        DeviceError: the folder holds no weights.
    """
    dev = runtime.device
    part, where = partition_bytes(dev.type, runtime.cfg.memory_fraction, dev.index or 0)
    return check_fits(name, weight_params(folder), precision, part, where)
