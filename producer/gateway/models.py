"""The models the gateway serves: OIP metadata, inputs -> fleet inputs, results -> outputs.

A model is one configured ``[models.<name>]`` that a modality serves (``[modalities.<m>]
model = "<name>"``); requests for it become that modality's tasks. One request is one task
(batch dimension 1): the fleet batches across requests.

============ ======================================== =========================================
model of     inputs                                   outputs (all FP32)
============ ======================================== =========================================
text         ``text`` BYTES [1]: UTF-8 text           ``embedding`` [1, 384]
image        ``image`` BYTES [1]: the encoded file    ``embedding`` [1, 1280],
             (or UINT8 [n]: the file's bytes)         ``labels`` BYTES [k], ``probabilities``
                                                      [k] (a ``resnet`` kind model: only
                                                      ``embedding`` [1, 512])
video        ``video`` BYTES [1] (or UINT8 [n])       ``clip_embedding`` [1, 1280],
                                                      ``frame_embeddings`` [frames, 1280],
                                                      ``timestamps_s`` [frames], ``labels``
                                                      BYTES [k], ``probabilities`` [k]
xmodal       ``image`` BYTES [1] (or UINT8 [n]) and   ``scores``, ``logits``, ``probs`` [k],
             ``texts`` BYTES [k], 1 <= k <= 16        ``image_embedding`` [1, d],
                                                      ``text_embeddings`` [k, d] (d: 384 for
                                                      the ``conse`` kind, else its
                                                      ``projection_dim``, 512)
============ ======================================== =========================================

``labels`` are the ImageNet class names of the image's (the clip's) ``k`` most probable
classes, best first, ``probabilities`` theirs; ``k`` is the request's ``parameters.top_k``
(0 to 1000), else the model's ``top_k`` (5).

Encoded media in a JSON request (``data``, strings) is base64 of the file; as binary data
(``binary_data_size``) it is the raw file bytes. No adapter takes pre-decoded pixel tensors,
so other numeric datatypes are refused (400). Scalar facts of a result (``tokens``,
``truncated``, ``frames``, ``partial``, ...) travel in the response's ``parameters``.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np

from producer.gateway.codec import InputTensor, OutputTensor
from shared.errors import InvalidInput
from shared.settings import Settings

PLATFORM = "mmfleet_celery"
VERSION = "1"  # one version per model; /versions/1/ is accepted, any other is unknown


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A served model: its name, the modality serving it, its OIP tensors."""

    name: str
    modality: str
    kind: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]

    def metadata(self) -> dict[str, Any]:
        """OIP's model metadata response object."""
        return {
            "name": self.name,
            "versions": [VERSION],
            "platform": PLATFORM,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
        }


TEXT_DIM = 384  # all-MiniLM-L6-v2's hidden size
VISION_DIM = 512  # the ResNet-18 config's last stage (workers.models.image.resnet18_config)
# The embedding size of each image/video model kind: EfficientNet-Lite0's pooled features
# (workers.models.efficientnet.FEATURE_DIM; the video kind runs the same model).
KIND_DIMS = {"resnet": VISION_DIM, "efficientnet": 1280, "video": 1280, "conse": TEXT_DIM}
LABELLED_KINDS = ("efficientnet", "video")  # kinds whose results carry ImageNet labels
MAX_TOP_K = 1000  # ImageNet-1k's classes


def model_specs(settings: Settings) -> dict[str, ModelSpec]:
    """Every served model by name (a configured model no modality names is not served)."""
    out: dict[str, ModelSpec] = {}
    for modality, cfg in settings.modalities.items():
        mcfg = settings.models.get(cfg.model)
        if mcfg is None:
            continue
        out[cfg.model] = _spec(cfg.model, modality, mcfg.kind, mcfg.model_dump())
    return out


def _spec(name: str, modality: str, kind: str, cfg: dict[str, Any]) -> ModelSpec:
    t = TensorSpec
    if modality == "text":
        ins = (t("text", "BYTES", (1,)),)
        outs = (t("embedding", "FP32", (1, TEXT_DIM)),)
    elif modality == "image":
        ins = (t("image", "BYTES", (1,)),)
        outs = (t("embedding", "FP32", (1, KIND_DIMS.get(kind, VISION_DIM))),)
        if kind in LABELLED_KINDS:
            outs += (t("labels", "BYTES", (-1,)), t("probabilities", "FP32", (-1,)))
    elif modality == "video":
        dim = KIND_DIMS.get(kind, VISION_DIM)
        ins = (t("video", "BYTES", (1,)),)
        outs = (
            t("clip_embedding", "FP32", (1, dim)),
            t("frame_embeddings", "FP32", (-1, dim)),
            t("timestamps_s", "FP32", (-1,)),
        )
        if kind in LABELLED_KINDS:
            outs += (t("labels", "BYTES", (-1,)), t("probabilities", "FP32", (-1,)))
    else:  # xmodal
        dim = int(cfg.get("projection_dim", KIND_DIMS.get(kind, VISION_DIM)))
        ins = (t("image", "BYTES", (1,)), t("texts", "BYTES", (-1,)))
        outs = (
            t("scores", "FP32", (-1,)),
            t("logits", "FP32", (-1,)),
            t("probs", "FP32", (-1,)),
            t("image_embedding", "FP32", (1, dim)),
            t("text_embeddings", "FP32", (-1, dim)),
        )
    return ModelSpec(name, modality, kind, ins, outs)


# -- requests ------------------------------------------------------------------------------
def _by_name(spec: ModelSpec, tensors: list[InputTensor]) -> dict[str, InputTensor]:
    wanted = {i.name for i in spec.inputs}
    got = {t.name: t for t in tensors}
    unknown = sorted(set(got) - wanted)
    missing = sorted(wanted - set(got))
    if unknown or missing:
        raise InvalidInput(
            f"model {spec.name!r} takes inputs {sorted(wanted)}"
            + (f"; unknown: {unknown}" if unknown else "")
            + (f"; missing: {missing}" if missing else "")
        )
    return got


def _media_bytes(t: InputTensor) -> bytes:
    """The encoded file of an image/video input (BYTES [1] or UINT8 [n])."""
    if t.datatype == "UINT8":
        if len(t.shape) != 1:
            raise InvalidInput(f"input {t.name!r}: a UINT8 file must have shape [n]")
        data = np.ascontiguousarray(t.data).tobytes()
    elif t.datatype == "BYTES":
        if len(t.data) != 1:
            raise InvalidInput(f"input {t.name!r} takes one element (one file per request)")
        data = t.data[0]
        if "binary_data_size" not in t.parameters:  # JSON: base64 text of the file
            try:
                data = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidInput(
                    f"input {t.name!r}: in JSON a file is base64 text (send raw bytes as "
                    "binary data)"
                ) from None
    else:
        raise InvalidInput(f"input {t.name!r} must be BYTES (or UINT8), not {t.datatype}")
    if not data:
        raise InvalidInput(f"input {t.name!r} is empty")
    return data


def _texts(t: InputTensor, one: bool) -> list[str]:
    if t.datatype != "BYTES":
        raise InvalidInput(f"input {t.name!r} must be BYTES (UTF-8 text), not {t.datatype}")
    if one and len(t.data) != 1:
        raise InvalidInput(f"input {t.name!r} takes one text per request, got {len(t.data)}")
    try:
        return [e.decode("utf-8") for e in t.data]
    except UnicodeDecodeError:
        raise InvalidInput(f"input {t.name!r} is not valid UTF-8") from None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def top_k_option(spec: ModelSpec, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """``{"top_k": k}`` from a request's ``parameters.top_k`` for a labelled model; ``{}``
    when absent (the model's default applies).

    Raises:
        InvalidInput: ``top_k`` on a model without labels, or not an integer in 0..1000.
    """
    if not parameters or "top_k" not in parameters:
        return {}
    k = parameters["top_k"]
    if "labels" not in spec.output_names:
        raise InvalidInput(f"model {spec.name!r} has no labels: parameters.top_k does not apply")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_K:
        raise InvalidInput(f"parameters.top_k must be an integer from 0 to {MAX_TOP_K}, got {k!r}")
    return {"top_k": k}


def fleet_inputs(
    spec: ModelSpec, tensors: list[InputTensor], parameters: dict[str, Any] | None = None
) -> tuple[dict[str, Any], bytes | None]:
    """The fleet's inputs for a request, and the video file's bytes (``None`` unless video:
    those go through :meth:`FleetClient.video_inputs`, /dev/shm above 32 KiB; the returned
    inputs then hold only the options, to merge with the video's).

    Raises:
        InvalidInput: wrong input names, datatypes, element counts, encodings, a bad
            ``parameters.top_k``.
    """
    got = _by_name(spec, tensors)
    if spec.modality == "text":
        return {"text": _texts(got["text"], one=True)[0]}, None
    if spec.modality == "image":
        options = top_k_option(spec, parameters)
        return {"image_b64": b64(_media_bytes(got["image"])), **options}, None
    if spec.modality == "video":
        return top_k_option(spec, parameters), _media_bytes(got["video"])
    texts = _texts(got["texts"], one=False)
    return {"image_b64": b64(_media_bytes(got["image"])), "texts": texts}, None


# -- results -------------------------------------------------------------------------------
_PARAM_KEYS: dict[str, tuple[str, ...]] = {
    "text": ("tokens", "truncated", "dim"),
    "image": ("dim",),
    "video": (
        "frames",
        "partial",
        "partial_reason",
        "capped",
        "duration_s",
        "decoded_until_s",
        "fps",
        "sample_fps",
        "width",
        "height",
        "codec",
        "container",
        "dim",
    ),
    "xmodal": ("texts", "logit_scale", "dim"),
}


def _f32(value: Any) -> np.ndarray:
    return np.asarray(value, dtype=np.float32)


def outputs_from_result(spec: ModelSpec, result: dict[str, Any]) -> list[OutputTensor]:
    """The model's outputs from a worker's (resolved) result, in metadata order.

    ``result``'s tensor wire objects must be resolved to arrays already
    (:meth:`FleetClient.resolve`).

    Raises:
        KeyError / ValueError: the result does not have this model's shape (a fleet fault).
    """
    m = spec.modality
    if m == "text":
        return [OutputTensor("embedding", _f32(result["embedding"]).reshape(1, -1))]
    if m == "image":
        return [
            OutputTensor("embedding", _f32(result["embedding"]).reshape(1, -1)),
            *_label_outputs(spec, result),
        ]
    if m == "video":
        frames = _f32(result["frame_embeddings"])
        return [
            OutputTensor("clip_embedding", _f32(result["clip_embedding"]).reshape(1, -1)),
            OutputTensor("frame_embeddings", frames.reshape(len(frames), -1)),
            OutputTensor("timestamps_s", _f32(result.get("timestamps_s") or []).reshape(-1)),
            *_label_outputs(spec, result),
        ]
    texts = _f32(result["text_embeddings"])
    return [
        OutputTensor("scores", _f32(result["scores"]).reshape(-1)),
        OutputTensor("logits", _f32(result["logits"]).reshape(-1)),
        OutputTensor("probs", _f32(result["probs"]).reshape(-1)),
        OutputTensor("image_embedding", _f32(result["image_embedding"]).reshape(1, -1)),
        OutputTensor("text_embeddings", texts.reshape(len(texts), -1)),
    ]


def _label_outputs(spec: ModelSpec, result: dict[str, Any]) -> list[OutputTensor]:
    """``labels`` (BYTES, the class names) and ``probabilities`` (FP32), best first, for a
    model whose metadata lists them."""
    if "labels" not in spec.output_names:
        return []
    labels = result["labels"]
    return [
        OutputTensor("labels", [str(lab["label"]).encode() for lab in labels], "BYTES"),
        OutputTensor("probabilities", _f32([lab["probability"] for lab in labels]).reshape(-1)),
    ]


def result_parameters(spec: ModelSpec, result: dict[str, Any]) -> dict[str, Any]:
    """Scalar facts of a result as OIP parameters (bool, number or string; nulls left out)."""
    out: dict[str, Any] = {}
    for k in _PARAM_KEYS.get(spec.modality, ()):
        v = result.get(k)
        if isinstance(v, bool | int | float | str):
            out[k] = v
    return out
