"""Image-text scores from any CLIP-style Hugging Face folder (kind ``hf-xmodal``).

The folder: a ``CLIPModel``, ``SiglipModel`` or ``VisionTextDualEncoderModel`` saved with
``save_pretrained``, with its tokenizer and its ``preprocessor_config.json``
(:mod:`workers.models.hf_pixels`). Image and texts are embedded in the model's one space
(``get_image_features`` / ``get_text_features``: the projected pooled outputs), so a
zero-shot classification is a request with the candidate labels as texts.

Request and result keep the xmodal modality's shape (:mod:`workers.models.xmodal`):
``{"image_b64": str, "texts": [str, ...]}`` (or ``"text": str``), 1 to ``max_texts`` texts,
each checked as the text modality does and cut to ``max_text_tokens`` tokens (0: the text
tower's ``max_position_embeddings``, CLIP's 77, SigLIP's 64; the final special token kept,
flagged per text); the image checked and decoded as the image modality does. Result::

    {"scores": [cosine(image, text_i)], "logits": [...], "probs": [...],   # order of texts
     "image_embedding": [dim floats, unit norm], "text_embeddings": <wire [n, dim]>,
     "dim": dim, "texts": n, "truncated": [...], "tokens": [...],
     "logit_scale": s, "model": "<models key>"}

``logits`` = ``logit_scale * score`` (+ ``logit_bias`` for SigLIP); ``probs``: the softmax of
the request's logits (CLIP, dual encoder: which text fits best), the sigmoid of each logit
for SigLIP (how it was trained: each text's own match probability).

SigLIP's texts are padded to ``max_text_tokens`` (its training did so, and its pooled output
is the last position's); the others' to the batch's longest text with an attention mask.
Batching: the images of a batch run as one vision batch, all their texts as one text batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from shared.errors import InvalidInput, ModelError, PayloadTooLarge
from shared.model_kinds import HFXModalOptions
from workers.models.base import ModelAdapter, Prepared, check_pixel_shapes, require_loaded
from workers.models.hf_folder import HFFolder, inspect_folder, require_family
from workers.models.hf_partition import check_runtime_fits
from workers.models.hf_pixels import Pixels, image_pixels
from workers.models.image import _model_name, example_png, image_bytes
from workers.models.imaging import decode_image
from workers.models.precision import apply_precision, parse_precision
from workers.models.tensors import TensorIO
from workers.models.xmodal import xmodal_result

if TYPE_CHECKING:
    from shared.settings import Settings
    from workers.models.runtime import DeviceRuntime

IMAGE_KEY = "image_b64"
PAD_TO_MAX = ("siglip",)  # model types whose texts are padded to max_text_tokens
_WARMUP_TEXTS = ("a photo of a cat", "a cup of coffee", "a rocket in the sky", "a red car")


@dataclass(frozen=True, slots=True)
class PairPayload:
    image: bytes
    ids: list[list[int]]
    truncated: list[bool]


@dataclass(frozen=True, slots=True)
class PairSample:
    pixels: np.ndarray  # float32 (3, S, S)
    ids: list[list[int]]
    truncated: list[bool]


def features(out: Any) -> torch.Tensor:
    """``get_*_features``' projected embeddings: a tensor (transformers 4) or the
    ``pooler_output`` of the output object it returns (transformers 5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def request_texts(inputs: Any, max_texts: int, max_chars: int) -> list[str]:
    """The texts of an xmodal request, checked as :mod:`workers.models.xmodal` does.

    Raises:
        InvalidInput: not a dict, unknown keys, both or neither of ``text``/``texts``, not
            1..max_texts strings, a blank text, no image.
        PayloadTooLarge: a text over ``max_chars`` characters.
    """
    if not isinstance(inputs, dict):
        raise InvalidInput(f"xmodal inputs must be an object, got {type(inputs).__name__}")
    unknown = sorted(str(k) for k in inputs if k not in (IMAGE_KEY, "text", "texts"))
    if unknown:
        raise InvalidInput(
            f"unknown xmodal input keys {unknown}; expected {IMAGE_KEY!r} and 'texts' (or 'text')"
        )
    if ("text" in inputs) == ("texts" in inputs):
        raise InvalidInput("xmodal inputs need exactly one of 'texts' (a list) or 'text'")
    texts = [inputs["text"]] if "text" in inputs else inputs["texts"]
    if not isinstance(texts, list) or not 1 <= len(texts) <= max_texts:
        raise InvalidInput(f"'texts' must be a list of 1 to {max_texts} strings")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InvalidInput(f"text {i} must be a string, got {type(t).__name__}")
        if not t.strip():
            raise InvalidInput(f"text {i} is empty or only whitespace")
        if len(t) > max_chars:
            raise PayloadTooLarge(f"text {i} has {len(t)} characters; the limit is {max_chars}")
    if IMAGE_KEY not in inputs:
        raise InvalidInput(f"xmodal inputs need {IMAGE_KEY!r} (base64 of the image file)")
    return texts


class HFXModalAdapter(ModelAdapter):
    """Image and text embeddings in one space, and their scores (see the module docstring)."""

    modality = "xmodal"
    options_type = HFXModalOptions

    def __init__(self, cfg: HFXModalOptions, settings: Settings, runtime: DeviceRuntime) -> None:
        super().__init__(cfg, settings, runtime)
        self.cfg: HFXModalOptions = cfg
        self.name = _model_name(cfg, settings)
        self.tensors = TensorIO(settings, cfg.output_inline_max_bytes)
        self.folder: HFFolder | None = None
        self.pixels: Pixels | None = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.pad_id = 0
        self.specials = 0  # tokens the tokenizer adds to an empty text
        self.max_tokens = 0
        self.pad_to_max = False
        self.dim: int | None = None
        self.precision = "fp32"
        self.weight_bytes = 0

    # -- lifecycle ----------------------------------------------------------------------
    def load(self) -> None:
        """Check the folder (a dual encoder, fits the partition); load model, tokenizer and
        image processor.

        Raises:
            UnsupportedFolder: not a CLIP / SigLIP / dual-encoder folder, no square processor.
            ModelTooLarge: its weights exceed the partition.
            ModelError: transformers cannot load it; ``max_text_tokens`` above the model's.
        """
        from transformers import AutoModel, AutoTokenizer

        folder = inspect_folder(self.cfg.checkpoint, self.name)
        require_family(folder, self.name, ("xmodal",), self.cfg.kind)
        self.precision = parse_precision(self.cfg.precision, self.runtime.device)
        self.weight_bytes = check_runtime_fits(self.name, folder.path, self.precision, self.runtime)
        self.pixels = image_pixels(folder.path, self.name)
        try:
            model = AutoModel.from_pretrained(folder.path, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(folder.path, local_files_only=True)
        except Exception as e:
            raise ModelError(f"model {self.name!r}: cannot load {str(folder.path)!r}: {e}") from e
        model.eval().requires_grad_(False)
        self.model = apply_precision(model.to(self.runtime.device), self.precision)
        self.tokenizer = tokenizer
        self.pad_id = int(tokenizer.pad_token_id or 0)
        self.specials = len(tokenizer("")["input_ids"])
        text_cfg = model.config.text_config
        limit = int(getattr(text_cfg, "max_position_embeddings", 0) or 0) or 77
        self.max_tokens = self.cfg.max_text_tokens or limit
        if not self.specials < self.max_tokens <= limit:
            raise ModelError(
                f"model {self.name!r}: max_text_tokens {self.max_tokens} outside "
                f"{self.specials + 1}..{limit} (the text tower's positions)"
            )
        self.pad_to_max = folder.model_type in PAD_TO_MAX
        self.folder = folder
        with torch.inference_mode():
            px = torch.zeros(1, 3, self.side, self.side, device=self.runtime.device)
            self.dim = int(self._images(px).shape[1])

    @property
    def side(self) -> int:
        return require_loaded(self.pixels, self.name).size  # type: ignore[no-any-return]

    def _dtype(self) -> torch.dtype:
        return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.precision, torch.float32)

    def _images(self, pixels: torch.Tensor) -> torch.Tensor:
        out = self.model.get_image_features(pixel_values=pixels.to(self._dtype()))
        return F.normalize(features(out).float(), dim=-1)

    def _texts(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = self.model.get_text_features(input_ids=ids, attention_mask=mask)
        return F.normalize(features(out).float(), dim=-1)

    # -- per request ----------------------------------------------------------------------
    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        """Check the texts and the image (header only); tokenize the texts."""
        if self.tokenizer is None:
            raise ModelError(f"model {self.name!r}: prepare called before load()")
        texts = request_texts(inputs, self.cfg.max_texts, self.settings.limits.max_text_chars)
        raw = image_bytes({IMAGE_KEY: inputs[IMAGE_KEY]}, self.settings)
        enc = self.tokenizer(texts, truncation=False, add_special_tokens=True)
        ids_all: list[list[int]] = []
        truncated: list[bool] = []
        for i, ids in enumerate(enc["input_ids"]):
            if len(ids) <= self.specials:
                raise InvalidInput(f"text {i} contains no tokens after normalisation")
            cut = len(ids) > self.max_tokens
            if cut:
                ids = ids[: self.max_tokens - 1] + ids[-1:]  # keep the final special token
            ids_all.append(list(ids))
            truncated.append(cut)
        longest = self.max_tokens if self.pad_to_max else max(len(x) for x in ids_all)
        size = self.side
        nbytes = 3 * size * size * 4 + len(ids_all) * 2 * 8 * longest
        return Prepared(str(size), longest, nbytes, PairPayload(raw, ids_all, truncated))

    def preprocess(self, prepared: Prepared) -> PairSample:
        """Decode the image (``decode_image``: the folder's side and normalisation)."""
        p = prepared.payload
        px = require_loaded(self.pixels, self.name)
        pixels = decode_image(
            p.image,
            max_pixels=self.settings.limits.max_image_pixels,
            size=px.size,
            jpeg_draft=self.cfg.jpeg_draft,
            norm=px.norm,
        )
        return PairSample(pixels, p.ids, p.truncated)

    def _pad(self, all_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.max_tokens if self.pad_to_max else max(len(ids) for ids in all_ids)
        ids_t = torch.full((len(all_ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(all_ids), width), dtype=torch.long)
        for i, ids in enumerate(all_ids):
            ids_t[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, : len(ids)] = 1
        return ids_t, mask

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        """Score each sample's image against its own texts, in their order."""
        model = require_loaded(self.model, self.name)
        if not samples:
            return []
        for i, s in enumerate(samples):
            if not isinstance(s, PairSample):
                raise ModelError(f"sample {i} is a {type(s).__name__}, expected a PairSample")
        check_pixel_shapes([s.pixels for s in samples], (3, self.side, self.side))
        ids_t, mask = self._pad([ids for s in samples for ids in s.ids])
        pixels = torch.from_numpy(np.stack([s.pixels for s in samples]))
        pixels, ids_t, mask = self.runtime.stage([pixels, ids_t, mask])
        with torch.inference_mode():
            img = self._images(pixels).cpu().numpy()
            txt = self._texts(ids_t, None if self.pad_to_max else mask).cpu().numpy()
            scale = float(model.logit_scale.exp())
            bias_t = getattr(model, "logit_bias", None)
            bias = 0.0 if bias_t is None else float(bias_t.reshape(-1)[0])
        counts = [len(s.ids) for s in samples]
        per_sample = np.split(txt.astype(np.float32), np.cumsum(counts)[:-1])
        wires = self.tensors.pack_all(per_sample)
        out = []
        for k, (s, t, w) in enumerate(zip(samples, per_sample, wires, strict=True)):
            scores = t @ img[k]
            logits = scale * scores + bias
            if self.pad_to_max:
                probs = 1.0 / (1.0 + np.exp(-logits))
            else:
                z = np.exp(logits - logits.max())
                probs = z / z.sum()
            out.append(
                xmodal_result(
                    scores=scores,
                    logits=logits,
                    probs=probs,
                    image_embedding=img[k],
                    text_embeddings=w,
                    truncated=list(s.truncated),
                    tokens=[len(x) for x in s.ids],
                    logit_scale=scale,
                    model=self.name,
                )
            )
        return out

    # -- warmup and facts -----------------------------------------------------------------
    def buckets(self) -> list[str]:
        return [str(self.side)]

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        import base64

        if bucket is not None and bucket != str(self.side):
            raise ValueError(f"unknown xmodal bucket {bucket!r}; this adapter has {self.side!r}")
        return [
            {
                IMAGE_KEY: base64.b64encode(example_png(i)).decode("ascii"),
                "texts": list(_WARMUP_TEXTS[: 2 + i % 3]),
            }
            for i in range(batch_size)
        ]

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        f, px = self.folder, self.pixels
        out.update(
            name=self.name,
            weights=self.cfg.checkpoint,
            model_type=None if f is None else f.model_type,
            architectures=None if f is None else list(f.architectures),
            image_size=None if px is None else px.size,
            processor=None if px is None else px.processor,
            dim=self.dim,
            max_texts=self.cfg.max_texts,
            max_text_tokens=self.max_tokens,
            probs="sigmoid" if self.pad_to_max else "softmax",
            precision=self.precision,
            weight_bytes=self.weight_bytes,
            device=str(self.runtime.device),
            semantic=True,
        )
        return out
