"""ImageNet-1k class names and the top-k labels of a classifier's probabilities.

The names ship with the package (``workers/models/labels/imagenet_classes.txt``, from
torchvision's ``_IMAGENET_CATEGORIES``; ``labels/SOURCES.md``): line ``i`` names output
index ``i`` of an ImageNet-1k classifier (281 "tabby", 967 "espresso").

A request asks for ``top_k`` labels (``0`` for none); a label is
``{"label": "tabby", "index": 281, "probability": 0.26}``, best first.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from shared.errors import InvalidInput

TOP_K_KEY = "top_k"
CLASSES_FILE = "labels/imagenet_classes.txt"


@cache
def imagenet_classes() -> tuple[str, ...]:
    """The 1,000 class names, in output-index order (read once from the package)."""
    text = resources.files("workers.models").joinpath(CLASSES_FILE).read_text(encoding="utf-8")
    names = tuple(line for line in text.splitlines() if line)
    if len(names) != 1000:
        raise RuntimeError(f"{CLASSES_FILE} has {len(names)} class names, expected 1000")
    return names


def parse_top_k(inputs: dict[str, Any], default: int, classes: int) -> int:
    """A request's ``top_k`` (``default`` when absent).

    Raises:
        InvalidInput: not an integer (``true`` and ``2.0`` are refused), or outside
            ``0..classes``.
    """
    if TOP_K_KEY not in inputs:
        return default
    k = inputs[TOP_K_KEY]
    if isinstance(k, bool) or not isinstance(k, int):
        raise InvalidInput(f"{TOP_K_KEY!r} must be an integer, got {type(k).__name__}")
    if not 0 <= k <= classes:
        raise InvalidInput(f"{TOP_K_KEY!r} must be between 0 and {classes}, got {k}")
    return k


def top_labels(probs: np.ndarray, k: int, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The ``k`` most probable classes of one probability vector ``(classes,)``, best first
    (ties: the lower index first)."""
    if k <= 0:
        return []
    order = np.argsort(-probs, kind="stable")[:k]
    return [
        {"label": names[int(i)], "index": int(i), "probability": float(probs[i])} for i in order
    ]
