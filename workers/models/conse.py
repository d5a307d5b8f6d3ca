"""The default cross-modal adapter: ConSE over the real image classifier and text encoder.

ConSE (Norouzi et al., "Zero-Shot Learning by Convex Combination of Semantic Embeddings",
ICLR 2014) puts an image into a text embedding space without any image-text training: the
image's vector is the convex combination of the embeddings of its most probable class
names. Here the classifier is the image modality's EfficientNet-Lite0 (ImageNet-1k) and the
embedding space is all-MiniLM-L6-v2's (384-d):

- image vector = L2-normalise( sum over the image's ``top_t`` (10) classes of
  ``p_c / sum(p) * minilm(name_c)`` ), ``p`` the classifier's probabilities;
- text vector = ``minilm(text)`` (unit norm);
- score = cosine of the two.

The 1,000 class names (``workers.models.imagenet``) are embedded once at load, in batches,
and kept in the trace cache (``workers.models.trace_cache``, as a TorchScript module holding
the ``[1000, 384]`` table): a later start with the same text model, options, versions and
names loads the table instead of running the encoder 1,000 times (3.6 s of a 6.2 s load on
one CPU thread).
The two models are the adapters of the ``[models.<image_model>]`` (kind ``efficientnet``)
and ``[models.<text_model>]`` (kind ``minilm``) tables, composed, not copied: their
checks, decoding limits, error codes, preprocessing, truncation, tracing, trace cache and
precision apply unchanged, so an image is decoded and classified exactly as the image
modality does it and a text tokenized and embedded exactly as the text modality does.

What it can and cannot do: an image is described only through the 1,000 ImageNet concepts
its classifier knows, so captions about those concepts (a cup of coffee, a tabby cat, a
tripod) match their photos, and anything else (people, scenes, counts, colours, text,
relations) is invisible to it; far below CLIP (docs/models.md, *ConSE*).

Request inputs, as for every image+text model: ``{"image_b64": "<base64 of an image
file>", "texts": [str, ...]}`` (1 to ``max_texts``) or ``{"image_b64": ..., "text": str}``,
plus an optional ``"top_k"`` (the labels returned, the image model's ``top_k`` when absent;
0..1000). Result per request::

    {"scores": [cosine(image, text_i) for each text],   # in the order of the texts
     "logits": [logit_scale * score_i],
     "probs": [softmax(logits)_i],                      # over this request's texts
     "image_embedding": [384 floats, unit norm],        # the ConSE vector
     "text_embeddings": {"kind": "inline" | "shm", ...},  # float32 [n_texts, 384]
     "labels": [{"label": "espresso", "index": 967, "probability": 0.94}, ...],  # top_k
     "dim": 384, "texts": n_texts, "truncated": [bool per text], "tokens": [int per text],
     "logit_scale": 100.0, "model": "<models key>"}

Batching: the images of a batch run as one classifier batch; all texts of all requests in
the batch run as one text batch padded to the longest.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from importlib.metadata import version
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from shared.errors import FleetError, InvalidInput, ModelError
from shared.model_kinds import ConseOptions, EfficientNetOptions, ModelOptions, TextOptions
from workers.models import trace_cache
from workers.models.base import ModelAdapter, Prepared, check_pixel_shapes
from workers.models.efficientnet import EfficientNetAdapter
from workers.models.image import _model_name, example_png
from workers.models.imagenet import TOP_K_KEY, imagenet_classes
from workers.models.tensors import TensorIO
from workers.models.text import TextAdapter, _packaged_path
from workers.models.xmodal import xmodal_result

if TYPE_CHECKING:
    from shared.settings import Settings
    from workers.models.runtime import DeviceRuntime

IMAGE_KEY = "image_b64"
CLASS_BATCH = 125  # class names per text-encoder call at load (1,000 in 8 calls)
_WARMUP_TEXTS = (
    "A photo of an astronaut.",
    "A cup of coffee on a saucer.",
    "A cat lying on a rug.",
    "A rocket launching into the sky at dawn.",
)


@dataclass(frozen=True, slots=True)
class ConsePayload:
    image: Any  # the image adapter's prepared payload
    texts: list[tuple[list[int], bool]]  # the text adapter's: (token ids, truncated)


@dataclass(frozen=True, slots=True)
class ConseSample:
    pixels: np.ndarray  # float32 (3, S, S), as the image adapter preprocesses
    top_k: int
    texts: list[tuple[list[int], bool]]


def conse_vector(
    class_embeddings: np.ndarray, indices: list[int], probabilities: list[float]
) -> np.ndarray:
    """ConSE's image vector: the unit-norm convex combination of the class embeddings at
    ``indices``, weighted by ``probabilities`` renormalised to sum to 1."""
    p = np.asarray(probabilities, dtype=np.float64)
    w = p / max(float(p.sum()), 1e-30)
    v = w @ class_embeddings[np.asarray(indices, dtype=np.int64)].astype(np.float64)
    return (v / max(float(np.linalg.norm(v)), 1e-12)).astype(np.float32)


class _ClassTable(torch.nn.Module):
    """The class-name embeddings as a TorchScript-able module: how the trace cache keeps
    them (it stores TorchScript archives)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)

    def forward(self) -> torch.Tensor:
        return self.table


def _component(settings: Settings, owner: str, role: str, name: str, kind: str) -> ModelOptions:
    """The ``[models.<name>]`` table ConSE composes as its ``role``, checked to be ``kind``.

    Raises:
        ModelError: no such table, or one of another kind.
    """
    cfg = settings.models.get(name)
    if cfg is None:
        raise ModelError(
            f"model {owner!r}: {role} {name!r} is not a [models] table; "
            f"configured: {sorted(settings.models)}"
        )
    if cfg.kind != kind:
        raise ModelError(
            f"model {owner!r}: {role} {name!r} is kind {cfg.kind!r}; ConSE needs kind {kind!r}"
        )
    return cfg


class ConseAdapter(ModelAdapter):
    """Image-text similarity by ConSE (see the module docstring).

    Args:
        cfg: the ``[models.<name>]`` entry (:class:`~shared.model_kinds.ConseOptions`).
        settings: fleet settings (the two composed model tables, ``limits``,
            ``[transport]``).
        runtime: the worker's :class:`~workers.models.runtime.DeviceRuntime`.

    Raises:
        ModelError: ``image_model`` / ``text_model`` is not a table of kind ``efficientnet``
            / ``minilm``.
    """

    modality = "xmodal"
    options_type = ConseOptions

    def __init__(self, cfg: ConseOptions, settings: Settings, runtime: DeviceRuntime) -> None:
        super().__init__(cfg, settings, runtime)
        self.cfg: ConseOptions = cfg
        self.name = _model_name(cfg, settings)
        image_cfg = _component(settings, self.name, "image_model", cfg.image_model, "efficientnet")
        text_cfg = _component(settings, self.name, "text_model", cfg.text_model, "minilm")
        self.image = EfficientNetAdapter(cast(EfficientNetOptions, image_cfg), settings, runtime)
        self.text = TextAdapter(cast(TextOptions, text_cfg), settings, runtime)
        self.top_t = cfg.top_t
        self.max_texts = cfg.max_texts
        self.logit_scale = cfg.logit_scale
        self.tensors = TensorIO(settings, cfg.output_inline_max_bytes)
        self.bucket = self.image.bucket
        self.class_embeddings: np.ndarray | None = None  # float32 [1000, dim], unit rows
        self.class_table_cache = "off"  # "hit" | "stored" | "off": the trace cache's answer
        self.dim: int | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def load(self) -> None:
        """Load both models (each from the trace cache when it holds them), then the class
        names' embeddings: from the trace cache, else embedded now and stored there.

        Raises:
            ModelError: a model's weights are missing or do not load.
            ValueError: a precision the device cannot run.
        """
        self.image.load()
        self.text.load()
        parts = self._class_table_parts()
        key = trace_cache.cache_key(parts)
        cached = trace_cache.load(key, torch.device("cpu"))
        self.class_table_cache = "hit" if cached is not None else "off"
        if cached is not None:
            table = cached.table.float().numpy()
        else:
            table = self._embed_class_names()
            module = torch.jit.script(_ClassTable(torch.from_numpy(table)))
            if trace_cache.save(key, module, parts):
                self.class_table_cache = "stored"
        self.class_embeddings = np.ascontiguousarray(table, dtype=np.float32)
        self.dim = int(self.class_embeddings.shape[1])

    def _embed_class_names(self) -> np.ndarray:
        """The 1,000 class names through the text model, ``CLASS_BATCH`` at a time."""
        names = imagenet_classes()
        rows: list[list[float]] = []
        with torch.inference_mode():
            for i in range(0, len(names), CLASS_BATCH):
                batch = [self.text.prepare({"text": n}).payload for n in names[i : i + CLASS_BATCH]]
                rows += [r["embedding"] for r in self.text.run_batch(batch)]
        return np.asarray(rows, dtype=np.float32)

    def _class_table_parts(self) -> dict[str, Any]:
        """Everything the class-name table depends on (its trace-cache key): the text
        model's options and weights files, the names, the versions, the device type."""
        path = self.text.cfg.checkpoint or _packaged_path()
        names = "\n".join(imagenet_classes()).encode()
        return {
            "adapter": "conse-class-names",
            "text_model": self.text.cfg.model_dump(mode="json"),
            "files": trace_cache.folder_fingerprint(path),
            "names_sha256": hashlib.sha256(names).hexdigest(),
            "torch": torch.__version__,
            "transformers": version("transformers"),
            "device": self.runtime.device.type,
        }

    def torch_modules(self) -> list[Any]:
        return [*self.image.torch_modules(), *self.text.torch_modules()]

    # -- per request ----------------------------------------------------------------------
    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        """Check and tokenize the texts (as the text modality), then check the image's
        header and ``top_k`` (as the image modality).

        Raises:
            InvalidInput: not a dict, unknown keys, both or neither of ``text``/``texts``,
                not 1..max_texts strings, a blank text or one without tokens, a bad
                ``image_b64`` or ``top_k``.
            PayloadTooLarge: an image or text over its limit.
            ImageDecodeError: the image bytes are not a supported image.
        """
        if self.class_embeddings is None:
            raise ModelError(f"model {self.name!r}: prepare called before load()")
        if not isinstance(inputs, dict):
            raise InvalidInput(f"xmodal inputs must be an object, got {type(inputs).__name__}")
        allowed = (IMAGE_KEY, TOP_K_KEY, "text", "texts")
        unknown = sorted(str(k) for k in inputs if k not in allowed)
        if unknown:
            raise InvalidInput(
                f"unknown xmodal input keys {unknown}; expected {IMAGE_KEY!r} and 'texts' "
                f"(or 'text'), optionally {TOP_K_KEY!r}"
            )
        if ("text" in inputs) == ("texts" in inputs):
            raise InvalidInput("xmodal inputs need exactly one of 'texts' (a list) or 'text'")
        texts = [inputs["text"]] if "text" in inputs else inputs["texts"]
        if not isinstance(texts, list) or not 1 <= len(texts) <= self.max_texts:
            raise InvalidInput(f"'texts' must be a list of 1 to {self.max_texts} strings")
        prepared_texts: list[Prepared] = []
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise InvalidInput(f"text {i} must be a string, got {type(t).__name__}")
            try:
                prepared_texts.append(self.text.prepare({"text": t}))
            except FleetError as e:  # the same class (and code), naming the text
                raise type(e)(f"text {i}: {e.message}") from None
        if IMAGE_KEY not in inputs:
            raise InvalidInput(f"xmodal inputs need {IMAGE_KEY!r} (base64 of the image file)")
        image = self.image.prepare({k: inputs[k] for k in (IMAGE_KEY, TOP_K_KEY) if k in inputs})
        longest = max(p.length for p in prepared_texts)
        nbytes = image.nbytes + sum(p.nbytes for p in prepared_texts)
        payload = ConsePayload(image.payload, [p.payload for p in prepared_texts])
        return Prepared(self.bucket, longest, nbytes, payload)

    def preprocess(self, prepared: Prepared) -> ConseSample:
        """Decode the image as the image modality does.

        Raises:
            ImageDecodeError: corrupt or truncated image data.
            PayloadTooLarge: pixels above the limit.
        """
        p = prepared.payload
        if not isinstance(p, ConsePayload):
            raise ModelError(f"conse preprocess got {type(p).__name__}")
        pixels, k = self.image.preprocess(Prepared(self.bucket, 1, 0, p.image))
        return ConseSample(pixels, k, p.texts)

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        """Classify the batch's images, embed all its texts, score each image against its
        own texts.

        Returns:
            One result dict per sample (see the module docstring), in order.

        Raises:
            ModelError: called before :meth:`load`, or a malformed sample.
            ShmCapacityError: the text embeddings do not fit in shared memory.
        """
        classes = self.class_embeddings
        if classes is None:
            raise ModelError(f"model {self.name!r}: run_batch called before load()")
        if not samples:
            return []
        for i, s in enumerate(samples):
            if not isinstance(s, ConseSample):
                raise ModelError(f"sample {i} is a {type(s).__name__}, expected a ConseSample")
        size = self.image.image_size
        check_pixel_shapes([s.pixels for s in samples], (3, size, size))
        t = self.top_t
        images = self.image.run_batch([(s.pixels, max(s.top_k, t)) for s in samples])
        texts = self.text.run_batch([x for s in samples for x in s.texts])
        txt = np.asarray([r["embedding"] for r in texts], dtype=np.float32)
        per_sample = np.split(txt, np.cumsum([len(s.texts) for s in samples])[:-1])
        wires = self.tensors.pack_all(per_sample)
        out = []
        for s, im, tx, w in zip(samples, images, per_sample, wires, strict=True):
            top = im["labels"][:t]
            vec = conse_vector(classes, [x["index"] for x in top], [x["probability"] for x in top])
            scores = tx @ vec
            logits = self.logit_scale * scores.astype(np.float64)
            z = np.exp(logits - logits.max())
            out.append(
                xmodal_result(
                    scores=scores,
                    logits=logits,
                    probs=z / z.sum(),
                    image_embedding=vec,
                    text_embeddings=w,
                    labels=im["labels"][: s.top_k],
                    truncated=[tr for _, tr in s.texts],
                    tokens=[len(ids) for ids, _ in s.texts],
                    logit_scale=self.logit_scale,
                    model=self.name,
                )
            )
        return out

    # -- warmup and facts -----------------------------------------------------------------
    def buckets(self) -> list[str]:
        """One bucket: every image is resized to the image model's size."""
        return [self.bucket]

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        """``batch_size`` requests: an in-memory PNG gradient and 2-4 short captions each.

        Raises:
            ValueError: ``bucket`` is not this adapter's bucket.
        """
        if bucket is not None and bucket != self.bucket:
            raise ValueError(f"unknown xmodal bucket {bucket!r}; this adapter has {self.bucket!r}")
        return [
            {
                IMAGE_KEY: base64.b64encode(example_png(i)).decode("ascii"),
                "texts": list(_WARMUP_TEXTS[: 2 + i % 3]),
            }
            for i in range(batch_size)
        ]

    def describe(self) -> dict[str, Any]:
        return {
            "modality": self.modality,
            "kind": self.cfg.kind,
            "name": self.name,
            "method": "ConSE (Norouzi et al., ICLR 2014)",
            "image_model": self.image.describe(),
            "text_model": self.text.describe() if self.class_embeddings is not None else None,
            "top_t": self.top_t,
            "dim": self.dim,
            "class_table_cache": self.class_table_cache,
            "max_texts": self.max_texts,
            "device": str(self.runtime.device),
            "semantic": True,
        }
