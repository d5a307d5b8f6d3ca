"""What a Hugging Face model folder holds, and which adapter serves it.

A folder saved with ``save_pretrained`` has a ``config.json`` naming its ``model_type``
(``"bert"``, ``"vit"``, ``"clip"``) and its ``architectures`` (the class that saved it:
``"ViTForImageClassification"``). :func:`inspect_folder` reads it (no weights, no torch) and
says which family of adapter serves it:

=================  =====================================================  =============
family             the folder                                              modality
=================  =====================================================  =============
``text``           an encoder ``AutoModel`` (``model_type`` with a masked  text
                   LM head in transformers: BERT, RoBERTa, XLM-R, MPNet,
                   DistilBERT...; not encoder-decoder)
``image-labels``   ``*ForImageClassification`` (``id2label`` labels)      image
``image``          any other vision ``AutoModel`` (embeddings only)       image
``xmodal``         ``CLIPModel``, ``SiglipModel``,                        xmodal
                   ``VisionTextDualEncoderModel``
=================  =====================================================  =============

Anything else (a decoder-only language model, an encoder-decoder, a detector, a folder
without ``config.json``) is refused with :class:`UnsupportedFolder`: what the folder holds
and what is supported. The refusal is a load error: the worker refuses to start with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ModelError

FAMILIES = ("text", "image-labels", "image", "xmodal")
FAMILY_MODALITY = {"text": "text", "image-labels": "image", "image": "image", "xmodal": "xmodal"}
FAMILY_KIND = {"text": "hf-text", "image-labels": "hf-image", "image": "hf-image",
               "xmodal": "hf-xmodal"}  # fmt: skip
XMODAL_TYPES = {
    "clip": "CLIPModel",
    "siglip": "SiglipModel",
    "vision-text-dual-encoder": "VisionTextDualEncoderModel",
}
SUPPORTED = (
    "text: an encoder AutoModel with its tokenizer (BERT, RoBERTa, XLM-RoBERTa, MPNet, "
    "DistilBERT, ... model types with a masked-LM head); image: an "
    "AutoModelForImageClassification or a vision AutoModel with its preprocessor_config.json; "
    "xmodal: a CLIPModel, SiglipModel or VisionTextDualEncoderModel"
)


class UnsupportedFolder(ModelError):
    """A model folder no adapter can serve (or serve on this modality). A load error: never
    a request's result, so not one of :mod:`shared.errors`' stored codes."""

    code = "MODEL_UNSUPPORTED"


@dataclass(frozen=True, slots=True)
class HFFolder:
    """A model folder's facts, read from its ``config.json``.

    Attributes:
        path: the folder.
        config: ``config.json`` as read.
        model_type: ``config["model_type"]``.
        architectures: ``config["architectures"]`` (may be empty).
        family: one of :data:`FAMILIES`.
    """

    path: Path
    config: dict[str, Any]
    model_type: str
    architectures: tuple[str, ...]
    family: str

    @property
    def modality(self) -> str:
        """The modality this folder's family serves."""
        return FAMILY_MODALITY[self.family]

    @property
    def found(self) -> str:
        """What the folder is, for messages: ``model_type 'vit', ViTForImageClassification``."""
        arch = ", ".join(self.architectures) or "no architectures"
        return f"model_type {self.model_type!r}, {arch}"


def read_config(path: str | Path, name: str) -> tuple[Path, dict[str, Any]]:
    """The folder and its ``config.json``.

    Raises:
        UnsupportedFolder: not a folder, or no readable ``config.json`` object in it.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UnsupportedFolder(f"model {name!r}: checkpoint {str(path)!r} is not a folder")
    cfg_file = folder / "config.json"
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UnsupportedFolder(
            f"model {name!r}: {str(folder)!r} has no config.json (a save_pretrained folder "
            f"is expected); supported: {SUPPORTED}"
        ) from None
    except (OSError, ValueError) as e:
        raise UnsupportedFolder(f"model {name!r}: cannot read {cfg_file}: {e}") from e
    if not isinstance(config, dict):
        raise UnsupportedFolder(f"model {name!r}: {cfg_file} is not a JSON object")
    return folder, config


def _family(model_type: str, architectures: tuple[str, ...], config: dict[str, Any]) -> str | None:
    """The family serving this config, ``None`` if none does."""
    from transformers.models.auto import modeling_auto as auto

    if model_type in XMODAL_TYPES:
        return "xmodal"
    if any(a.endswith("ForImageClassification") for a in architectures):
        return (
            "image-labels"
            if model_type in auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
            else None
        )
    if config.get("is_encoder_decoder"):
        return None
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "text"
    vision = auto.MODEL_FOR_IMAGE_MAPPING_NAMES
    if model_type in vision or model_type in auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return "image"
    return None


def inspect_folder(path: str | Path, name: str) -> HFFolder:
    """Read a model folder's ``config.json`` and pick the family that serves it.

    Args:
        path: the ``checkpoint`` folder.
        name: the ``[models.<name>]`` key, for messages.

    Raises:
        UnsupportedFolder: no such folder or ``config.json``, or a model no adapter serves
            (the message names what was found and what is supported).
    """
    folder, config = read_config(path, name)
    model_type = str(config.get("model_type") or "")
    archs = config.get("architectures") or []
    architectures = tuple(str(a) for a in archs) if isinstance(archs, list) else ()
    family = _family(model_type, architectures, config) if model_type else None
    if family is None:
        what = "model_type missing" if not model_type else f"model_type {model_type!r}"
        arch = ", ".join(architectures) or "no architectures"
        raise UnsupportedFolder(
            f"model {name!r}: {str(folder)!r} holds {what}, {arch}: no adapter serves it; "
            f"supported: {SUPPORTED}"
        )
    return HFFolder(folder, config, model_type, architectures, family)


def require_family(folder: HFFolder, name: str, families: tuple[str, ...], kind: str) -> None:
    """Refuse a folder of another family than ``kind`` serves.

    Raises:
        UnsupportedFolder: ``folder.family`` not in ``families``.
    """
    if folder.family not in families:
        raise UnsupportedFolder(
            f"model {name!r}: kind {kind!r} serves {' or '.join(families)} folders; "
            f"{str(folder.path)!r} holds {folder.found} ({folder.family}: kind "
            f"{FAMILY_KIND[folder.family]!r} on the {folder.modality} modality, or kind 'hf')"
        )
