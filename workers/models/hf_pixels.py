"""A folder's image processor as the fleet's decoding parameters: side and normalisation.

Images are decoded by :func:`workers.models.imaging.decode_image` (its header checks,
limits and error codes, EXIF orientation, alpha on white, the centre square resized to the
model's side), not by the processor's own code: what is taken from the folder's
``preprocessor_config.json`` (read with ``AutoImageProcessor``) is the side (``crop_size``
when it centre-crops, else ``size``: ``shortest_edge`` or a square ``height``/``width``) and
the normalisation (``rescale_factor``, ``image_mean``, ``image_std``). A processor that
resizes to a non-square shape is refused. Processors that squash the whole image to a square
(ViT's, SigLIP's) see the centre square here: the same pixels for a square photo.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workers.models.hf_folder import UnsupportedFolder
from workers.models.imaging import PixelNorm


@dataclass(frozen=True, slots=True)
class Pixels:
    """How a folder's images are prepared.

    Attributes:
        size: the square side in pixels.
        norm: 0..255 pixels -> the model's input values.
        processor: the processor's class name (for ``describe``).
    """

    size: int
    norm: PixelNorm
    processor: str


def _side(value: Any) -> int | None:
    """A processor's size entry as one square side (``None``: not square / not given)."""
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        if value.get("shortest_edge"):
            return int(value["shortest_edge"])
        h, w = value.get("height"), value.get("width")
        if h and h == w:
            return int(h)
        return None
    for attr in ("shortest_edge", "height"):
        v = getattr(value, attr, None)
        if v:
            w = getattr(value, "width", None)
            if attr == "height" and w and w != v:
                return None
            return int(v)
    return None


def image_pixels(folder: Path, name: str) -> Pixels:
    """The side and normalisation of the folder's ``AutoImageProcessor``.

    Raises:
        UnsupportedFolder: no image processor in the folder, or one whose target is not a
            square.
    """
    from transformers import AutoImageProcessor

    try:
        proc = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    except Exception as e:
        raise UnsupportedFolder(
            f"model {name!r}: {str(folder)!r} has no image processor AutoImageProcessor can "
            f"load (preprocessor_config.json): {e}"
        ) from e
    crop = getattr(proc, "crop_size", None) if getattr(proc, "do_center_crop", False) else None
    raw = crop if crop else getattr(proc, "size", None)
    side = _side(raw)
    if side is None:
        raise UnsupportedFolder(
            f"model {name!r}: {type(proc).__name__} resizes to {raw!r}; only a square side "
            "(shortest_edge, or height == width) is supported"
        )
    scale = (
        float(getattr(proc, "rescale_factor", 1 / 255))
        if getattr(proc, "do_rescale", True)
        else 1.0
    )
    if getattr(proc, "do_normalize", True):
        mean = np.asarray(getattr(proc, "image_mean", None) or (0.0, 0.0, 0.0), dtype=np.float64)
        std = np.asarray(getattr(proc, "image_std", None) or (1.0, 1.0, 1.0), dtype=np.float64)
    else:
        mean, std = np.zeros(3), np.ones(3)
    mean, std = np.broadcast_to(mean, (3,)), np.broadcast_to(std, (3,))
    # (x * scale - mean) / std == x * (scale / std) - mean / std
    norm = PixelNorm((scale / std).astype(np.float32), (-mean / std).astype(np.float32))
    return Pixels(side, norm, type(proc).__name__)
