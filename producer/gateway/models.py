"""The models the gateway serves: OIP metadata, inputs -> fleet inputs, results -> outputs.

A model is one configured ``[models.<name>]`` that a modality serves (``[modalities.<m>]
model`` and ``models``); requests for it become that modality's tasks, on its queue
(``shared.model_routes``). A model is reached by its served name (``served_name``, else the
table's name) and version: ``/v2/models/{name}`` is its latest version,
``/v2/models/{name}/versions/{v}`` that one (:meth:`ModelSpec.metadata` lists them). One
request is one task (batch dimension 1): the fleet batches across requests.

======== ====================================== ==============================================
model of inputs                                 outputs (FP32 unless said; ``d`` by kind below)
======== ====================================== ==============================================
text     ``text`` BYTES [1]: UTF-8 text         ``embedding`` [1, d]
image    ``image`` BYTES [1]: the encoded file  ``embedding`` [1, d]; labelled kinds:
         (or UINT8 [n]: the file's bytes)       ``labels`` BYTES [k], ``probabilities`` [k]
video    ``video`` BYTES [1] (or UINT8 [n])     ``clip_embedding`` [1, d], ``frame_embeddings``
                                                [frames, d], ``timestamps_s`` [frames];
                                                ``labels`` BYTES [k], ``probabilities`` [k]
xmodal   ``image`` BYTES [1] (or UINT8 [n]) and ``scores``, ``logits``, ``probs`` [t] (in the
         ``texts`` BYTES [t]: the candidate    order of the texts), ``image_embedding``
         texts, 1 <= t <= ``max_texts``         [1, d], ``text_embeddings`` [t, d]; ``conse``
                                                also ``labels`` BYTES [k], ``probabilities``
                                                [k] (the image's ImageNet classes)
======== ====================================== ==============================================

``d`` by kind: ``minilm`` and ``conse`` 384, ``efficientnet`` and ``video`` 1,280,
``resnet`` 512, ``xmodal`` its ``projection_dim``; the ``hf`` kinds read it from the folder's
``config.json`` at gateway start (:mod:`producer.gateway.hf_config`; -1 when it does not say).
Labelled kinds (:data:`LABELLED_KINDS`, and ``hf``/``hf-image`` folders of a
``*ForImageClassification``) list ``labels``, the class names of the image's (the clip's)
``k`` most probable classes, best first, and ``probabilities`` theirs; ``k`` is the request's
``parameters.top_k`` (0 to the model's class count: 1,000 for ImageNet, ``id2label``'s for a
folder), else the model's ``top_k`` (5); a model without labels refuses ``top_k``.

The metadata's ``parameters`` (as MLServer's OIP metadata has them) name the modality, the
kind, where the weights come from (:mod:`producer.gateway.weights`), ``top_k`` and
``max_top_k`` of a labelled model, ``max_texts`` of an xmodal one, and a folder's
``model_type`` and ``architectures``.

Encoded media in a JSON request (``data``, strings) is base64 of the file; as binary data
(``binary_data_size``) it is the raw file bytes. No adapter takes pre-decoded pixel tensors,
so other numeric datatypes are refused (400). Scalar facts of a result (``tokens``,
``truncated``, ``frames``, ``partial``, ...) travel in the response's ``parameters``.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from producer.gateway.codec import InputTensor, OutputTensor
from producer.gateway.hf_config import MODALITY_KIND, UNKNOWN, hf_facts
from producer.gateway.weights import weights_parameters
from shared import model_routes
from shared.errors import InvalidInput, ModelNotFound
from shared.model_kinds import ModelOptions
from shared.settings import Settings

PLATFORM = "mmfleet_celery"
VERSION = "1"  # a model table's version unless it says (``version``)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A served model: its name, the modality serving it, its OIP tensors, the metadata's
    ``parameters`` and the largest ``top_k`` it takes (``None``: unknown, the worker checks)."""

    name: str
    modality: str
    kind: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    parameters: dict[str, Any] = field(default_factory=dict)
    max_top_k: int | None = None
    table: str = ""  # its [models.<table>] ("" = name)
    version: str = VERSION
    versions: tuple[str, ...] = (VERSION,)  # every version of its name, highest first
    default: bool = True  # its modality's default model (the modality's own queues)

    @property
    def key(self) -> str:
        """Its table: what envelopes, job records and queues name it by."""
        return self.table or self.name

    @property
    def route_model(self) -> str | None:
        """The model part of its queue names (``None``: its modality's own)."""
        return None if self.default else self.key

    @property
    def live_model(self) -> str | None:
        """The liveness set its workers are in (``AsyncFleetClient.live_workers``): the
        modality's (``None``) for the default model, whose queue they consume."""
        return None if self.default else self.key

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]

    @property
    def labelled(self) -> bool:
        return "labels" in self.output_names

    def metadata(self) -> dict[str, Any]:
        """OIP's model metadata response object."""
        return {
            "name": self.name,
            "versions": list(self.versions),
            "platform": PLATFORM,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "parameters": dict(self.parameters),
        }


TEXT_DIM = 384  # all-MiniLM-L6-v2's hidden size
VISION_DIM = 512  # the ResNet-18 config's last stage (workers.models.image.resnet18_config)
# The embedding size of each model kind whose size is fixed: MiniLM's, EfficientNet-Lite0's
# pooled features (workers.models.efficientnet.FEATURE_DIM; the video kind runs the same
# model), ConSE's (MiniLM's space). ``xmodal``: its projection_dim; ``hf*``: the folder's.
KIND_DIMS = {
    "minilm": TEXT_DIM,
    "resnet": VISION_DIM,
    "efficientnet": 1280,
    "video": 1280,
    "conse": TEXT_DIM,
}
LABELLED_KINDS = ("efficientnet", "video", "conse")  # kinds whose results carry ImageNet labels
HF_KINDS = ("hf", "hf-text", "hf-image", "hf-xmodal")
MAX_TOP_K = 1000  # ImageNet-1k's classes


def model_specs(settings: Settings) -> dict[str, ModelSpec]:
    """Every served model by its table (a configured model no modality names is not served;
    ``shared.model_routes.catalog``); an ``hf`` kind's folder is read here, once."""
    out: dict[str, ModelSpec] = {}
    for modality in settings.modalities:
        served = model_routes.catalog(settings, modality)
        by_name = model_routes.served_by_name(served)
        for m in served:
            spec = _spec(m.name, modality, settings.models[m.table], settings)
            versions = tuple(v.version for v in by_name[m.name])
            out[m.table] = replace(
                spec, table=m.table, version=m.version, versions=versions, default=m.default
            )
    return out


def pick_spec(specs: dict[str, ModelSpec], name: str, version: str | None = None) -> ModelSpec:
    """The model ``name`` (a served name, else a table) at ``version`` (``None``: its
    latest) among ``specs`` (:func:`model_specs`).

    Raises:
        ModelNotFound: no such model or version (the message lists what is served).
    """
    named = sorted(
        (s for s in specs.values() if s.name == name), key=lambda s: int(s.version), reverse=True
    )
    if not named and name in specs:
        named = [specs[name]]
    for spec in named:
        if version is None or spec.version == version:
            return spec
    what = f"model {name!r}" + (f" version {version!r}" if version is not None else "")
    served = sorted({f"{s.name} (versions {', '.join(s.versions)})" for s in specs.values()})
    raise ModelNotFound(f"unknown {what}; served: {', '.join(served)}")


def _kind_facts(modality: str, opts: ModelOptions) -> tuple[int, bool, int | None, dict[str, Any]]:
    """The embedding size, whether results carry labels, the largest ``top_k`` and the
    kind's own metadata parameters."""
    kind = opts.kind
    if kind in HF_KINDS:
        facts = hf_facts(str(getattr(opts, "checkpoint", "")), modality)
        params: dict[str, Any] = {}
        if kind == "hf":
            params["served_as"] = MODALITY_KIND.get(modality, kind)
        if facts.readable:
            params |= {"model_type": facts.model_type, "architectures": facts.architectures}
        else:
            params["config"] = "unreadable from the gateway: sizes unknown (-1)"
        return facts.dim, facts.labels, facts.label_count, params
    if kind == "xmodal":
        return int(getattr(opts, "projection_dim", UNKNOWN)), False, None, {}
    return KIND_DIMS.get(kind, UNKNOWN), kind in LABELLED_KINDS, MAX_TOP_K, {}


def _default_top_k(opts: ModelOptions, settings: Settings, max_top_k: int | None) -> int:
    """A labelled model's ``top_k`` when a request gives none (ConSE: its image model's)."""
    source: Any = opts
    if opts.kind == "conse":
        source = settings.models.get(str(getattr(opts, "image_model", ""))) or opts
    k = int(getattr(source, "top_k", 5))
    return k if max_top_k is None else min(k, max_top_k)


def _spec(name: str, modality: str, opts: ModelOptions, settings: Settings) -> ModelSpec:
    t = TensorSpec
    dim, labels, max_top_k, kind_params = _kind_facts(modality, opts)
    params: dict[str, Any] = {
        "modality": modality,
        "kind": opts.kind,
        **weights_parameters(opts, settings),
        **kind_params,
    }
    if modality == "text":
        ins = (t("text", "BYTES", (1,)),)
        outs = (t("embedding", "FP32", (1, dim)),)
    elif modality == "image":
        ins = (t("image", "BYTES", (1,)),)
        outs = (t("embedding", "FP32", (1, dim)),)
    elif modality == "video":
        ins = (t("video", "BYTES", (1,)),)
        outs = (
            t("clip_embedding", "FP32", (1, dim)),
            t("frame_embeddings", "FP32", (-1, dim)),
            t("timestamps_s", "FP32", (-1,)),
        )
    else:  # xmodal
        ins = (t("image", "BYTES", (1,)), t("texts", "BYTES", (-1,)))
        outs = (
            t("scores", "FP32", (-1,)),
            t("logits", "FP32", (-1,)),
            t("probs", "FP32", (-1,)),
            t("image_embedding", "FP32", (1, dim)),
            t("text_embeddings", "FP32", (-1, dim)),
        )
        params["max_texts"] = int(getattr(opts, "max_texts", 16))
    if labels:
        outs += (t("labels", "BYTES", (-1,)), t("probabilities", "FP32", (-1,)))
        params["top_k"] = _default_top_k(opts, settings, max_top_k)
        if max_top_k is not None:
            params["max_top_k"] = max_top_k
    return ModelSpec(name, modality, opts.kind, ins, outs, params, max_top_k if labels else None)


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
        InvalidInput: ``top_k`` on a model without labels, or not an integer from 0 to the
            model's class count (when the gateway knows it; else the worker checks the top).
    """
    if not parameters or "top_k" not in parameters:
        return {}
    k = parameters["top_k"]
    if not spec.labelled:
        raise InvalidInput(f"model {spec.name!r} has no labels: parameters.top_k does not apply")
    top = spec.max_top_k
    if isinstance(k, bool) or not isinstance(k, int) or k < 0 or (top is not None and k > top):
        bound = f"from 0 to {top}" if top is not None else "from 0"
        raise InvalidInput(f"parameters.top_k must be an integer {bound}, got {k!r}")
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
    options = top_k_option(spec, parameters)
    return {"image_b64": b64(_media_bytes(got["image"])), "texts": texts, **options}, None


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
        *_label_outputs(spec, result),
    ]


def _label_outputs(spec: ModelSpec, result: dict[str, Any]) -> list[OutputTensor]:
    """``labels`` (BYTES, the class names) and ``probabilities`` (FP32), best first, for a
    model whose metadata lists them (empty when the result has none: a folder the gateway
    could not read that turned out not to classify)."""
    if not spec.labelled:
        return []
    labels = result.get("labels") or []
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
