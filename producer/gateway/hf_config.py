"""What a Hugging Face model folder's ``config.json`` says about its tensors, for the metadata
of a model of kind ``hf``, ``hf-text``, ``hf-image`` or ``hf-xmodal``.

Read once at gateway start, as JSON: the gateway imports neither torch nor transformers, and
the worker that loads the folder is the one that decides (it refuses a folder it cannot serve,
``workers.models.hf_folder``). What is read, per modality:

========  ==================================================================================
text      the embedding size: ``hidden_size`` (``dim`` for DistilBERT, ``d_model``)
image     the embedding size: the input of a classifier's head or a vision ``AutoModel``'s
          pooled output: ``neck_hidden_sizes[-1]`` (MobileViT), ``hidden_dim``
          (EfficientNet), ``hidden_sizes[-1]`` (ResNet, ConvNeXt, RegNet, LeViT...),
          ``pooler_output_size`` (a ``ViTModel``'s pooler), ``hidden_size`` (ViT, DeiT,
          BEiT, Swin; twice it for a DINOv2 classifier);
          labels when ``architectures`` names a ``*ForImageClassification``: their count
          is ``id2label``'s (2, transformers' default, when it is absent)
xmodal    the shared space's size: ``projection_dim`` (CLIP, dual encoder), the vision
          tower's ``hidden_size`` (SigLIP)
========  ==================================================================================

A size the config does not give, or a folder the gateway cannot read (it may run on another
host than the workers), is ``-1``: OIP's unknown dimension. An unreadable image folder is
assumed to be a classifier with an unknown label count (the worker decides: labels, or a
refused ``top_k``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["UNKNOWN", "HFFacts", "hf_facts"]

UNKNOWN = -1  # OIP's variable-size (here: unknown) dimension

# The per-modality kind a folder is served by, as workers.models.hf_auto picks it for "hf"
# (a folder of another modality is refused by the worker at load).
MODALITY_KIND = {"text": "hf-text", "image": "hf-image", "xmodal": "hf-xmodal"}


@dataclass(frozen=True, slots=True)
class HFFacts:
    """A model folder's facts, as far as its ``config.json`` tells them.

    Attributes:
        readable: the gateway read the folder's ``config.json``.
        model_type: ``config["model_type"]`` ("" if unknown).
        architectures: ``config["architectures"]`` joined with ``", "`` ("" if none).
        dim: the embedding size, :data:`UNKNOWN` if not given.
        labels: the image model classifies (its results carry labels).
        label_count: how many labels it has; ``None`` if unknown (or no labels).
    """

    readable: bool
    model_type: str = ""
    architectures: str = ""
    dim: int = UNKNOWN
    labels: bool = False
    label_count: int | None = None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _last(value: Any) -> int | None:
    return _int(value[-1]) if isinstance(value, list) and value else None


def _text_dim(cfg: dict[str, Any]) -> int | None:
    return _int(cfg.get("hidden_size")) or _int(cfg.get("dim")) or _int(cfg.get("d_model"))


def _image_dim(cfg: dict[str, Any], classifier: bool) -> int | None:
    if cfg.get("model_type") == "dinov2" and classifier:
        hidden = _int(cfg.get("hidden_size"))  # its head reads the class token + patch mean
        return None if hidden is None else 2 * hidden
    return (
        _last(cfg.get("neck_hidden_sizes"))
        or _int(cfg.get("hidden_dim"))
        or _last(cfg.get("hidden_sizes"))
        or (None if classifier else _int(cfg.get("pooler_output_size")))  # ViTModel's pooler
        or _int(cfg.get("hidden_size"))
    )


def _xmodal_dim(cfg: dict[str, Any]) -> int | None:
    dim = _int(cfg.get("projection_dim"))
    if dim is None and cfg.get("model_type") == "siglip":
        vision = cfg.get("vision_config")
        dim = _int(vision.get("hidden_size")) if isinstance(vision, dict) else None
    return dim


def read_config(folder: str) -> dict[str, Any] | None:
    """``<folder>/config.json`` as a JSON object; ``None`` when it cannot be read."""
    try:
        cfg = json.loads((Path(folder).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def hf_facts(folder: str, modality: str) -> HFFacts:
    """The facts of the folder ``folder`` served on ``modality`` (text, image or xmodal)."""
    cfg = read_config(folder)
    if cfg is None:
        # unknown: an image folder may classify; the worker refuses top_k if it does not
        return HFFacts(readable=False, labels=modality == "image")
    archs = cfg.get("architectures")
    names = [str(a) for a in archs] if isinstance(archs, list) else []
    classifier = modality == "image" and any(a.endswith("ForImageClassification") for a in names)
    if modality == "text":
        dim = _text_dim(cfg)
    elif modality == "image":
        dim = _image_dim(cfg, classifier)
    elif modality == "xmodal":
        dim = _xmodal_dim(cfg)
    else:  # no hf kind serves another modality: the worker refuses it at load
        dim = None
    count = None
    if classifier:
        id2label = cfg.get("id2label")
        count = len(id2label) if isinstance(id2label, dict) and id2label else 2
    return HFFacts(
        readable=True,
        model_type=str(cfg.get("model_type") or ""),
        architectures=", ".join(names),
        dim=UNKNOWN if dim is None else dim,
        labels=classifier,
        label_count=count,
    )
