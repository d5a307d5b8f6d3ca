"""Image embeddings, and labels, from any Hugging Face vision folder (kind ``hf-image``).

The folder: an ``AutoModelForImageClassification`` (ViT, DeiT, ConvNeXt, Swin, ResNet,
EfficientNet, ... ``*ForImageClassification``) or a vision ``AutoModel`` (``ViTModel``,
``Dinov2Model``, ...), with its ``preprocessor_config.json``
(:mod:`workers.models.hf_pixels`).

Request inputs as the image modality's default model: ``{"image_b64": str, "top_k": int}``
(``top_k`` optional: the table's ``top_k``, 5, or the model's label count if fewer, when
absent; 0 .. the model's label count;
refused on an embeddings-only folder). Result per request::

    {"embedding": [dim floats, L2 norm 1],
     "dim": dim,
     "labels": [{"label": "<id2label[i]>", "index": i, "probability": p}, ...],  # best first
     "model": "<models key>"}

(``labels`` only from a classifier). The embedding of a classifier is its pooled output:
the input of its classification head (the last ``Linear`` with ``num_labels`` outputs: the
class token's final state for ViT, the pooled convolution features for ConvNeXt/ResNet),
L2-normalised; a vision ``AutoModel``'s is its ``pooler_output`` (else the mean of its last
hidden state over tokens / positions). Probabilities: softmax over the classes, or a
sigmoid per class when the config's ``problem_type`` is ``multi_label_classification``.

Machinery shared with the EfficientNet adapter: the request checks
(:func:`workers.models.image.image_bytes`), decoding and limits
(:func:`workers.models.imaging.decode_image`: ``IMAGE_DECODE``, ``PAYLOAD_TOO_LARGE``),
``top_k`` parsing and the labels' shape (:mod:`workers.models.imagenet`), TorchScript
tracing checked against eager and the trace cache (:mod:`workers.models.trace_cache`).
"""

from __future__ import annotations

import logging
import threading
import warnings
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shared.errors import InvalidInput, ModelError
from shared.model_kinds import HFImageOptions
from workers.models import trace_cache
from workers.models.base import ModelAdapter, Prepared, check_pixel_shapes, require_loaded
from workers.models.hf_folder import HFFolder, inspect_folder, require_family
from workers.models.hf_partition import check_runtime_fits
from workers.models.hf_pixels import Pixels, image_pixels
from workers.models.image import INPUT_KEY, _model_name, example_png, image_bytes
from workers.models.imagenet import TOP_K_KEY, parse_top_k, top_labels
from workers.models.imaging import decode_image
from workers.models.precision import apply_precision, parse_precision

if TYPE_CHECKING:
    from shared.settings import Settings
    from workers.models.runtime import DeviceRuntime

log = logging.getLogger(__name__)


def classifier_head(model: torch.nn.Module, num_labels: int) -> torch.nn.Linear:
    """The classification head: the last ``Linear`` with ``num_labels`` outputs.

    Raises:
        UnsupportedFolder: none found.
    """
    from workers.models.hf_folder import UnsupportedFolder

    heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
             and m.out_features == num_labels]  # fmt: skip
    if not heads:
        raise UnsupportedFolder(
            f"{type(model).__name__} has no Linear layer with {num_labels} outputs (its head)"
        )
    return heads[-1]


class _Classifier(torch.nn.Module):
    """``(B, 3, S, S) -> ((B, D) head inputs, (B, classes) logits)``: the head's input is
    caught by a forward hook that keeps only its own thread's call (two inference lanes may
    run the eager model at once)."""

    def __init__(self, model: torch.nn.Module, head: torch.nn.Linear) -> None:
        super().__init__()
        self.model = model
        self.head = head

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        box: list[torch.Tensor] = []
        me = threading.get_ident()

        def catch(_m: Any, args: Any, _out: Any) -> None:
            if threading.get_ident() == me:
                box.append(args[0])

        handle = self.head.register_forward_hook(catch)
        try:
            logits = self.model(pixel_values=pixels).logits
        finally:
            handle.remove()
        return box[-1].flatten(1), logits


class _Embedder(torch.nn.Module):
    """``(B, 3, S, S) -> (B, D)``: a vision ``AutoModel``'s pooled output."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values=pixels)
        pooled = getattr(out, "pooler_output", None)
        if pooled is not None:
            return pooled.flatten(1)
        hidden = out.last_hidden_state
        return hidden.mean(1) if hidden.dim() == 3 else hidden.flatten(2).mean(2)


class HFImageAdapter(ModelAdapter):
    """Embeddings (and ``id2label`` labels) of a Hugging Face vision folder."""

    modality = "image"
    options_type = HFImageOptions
    input_keys: tuple[str, ...] = (INPUT_KEY, TOP_K_KEY)

    def __init__(self, cfg: HFImageOptions, settings: Settings, runtime: DeviceRuntime) -> None:
        super().__init__(cfg, settings, runtime)
        self.cfg: HFImageOptions = cfg
        self.name = _model_name(cfg, settings)
        self.folder: HFFolder | None = None
        self.pixels: Pixels | None = None
        self.labels: tuple[str, ...] = ()  # empty: embeddings only
        self.top_k = 0  # labels when a request says none: the table's, at most the model's
        self.multi_label = False
        self.module: torch.nn.Module | None = None  # _Classifier or _Embedder
        self.traced: Any = None
        self.trace_cache = "off"
        self.dim: int | None = None
        self.precision = "fp32"
        self._dtype = torch.float32
        self.weight_bytes = 0

    # -- lifecycle ----------------------------------------------------------------------
    def load(self) -> None:
        """Check the folder (a vision model, fits the partition), read its processor and
        labels, load it, trace it (from the trace cache when there).

        Raises:
            UnsupportedFolder: not a vision folder, no square image processor.
            ModelTooLarge: its weights exceed the partition.
            ModelError: transformers cannot load it.
        """
        from transformers import AutoModel, AutoModelForImageClassification

        folder = inspect_folder(self.cfg.checkpoint, self.name)
        require_family(folder, self.name, ("image-labels", "image"), self.cfg.kind)
        self.precision = parse_precision(self.cfg.precision, self.runtime.device)
        self._dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(
            self.precision, torch.float32
        )
        self.weight_bytes = check_runtime_fits(self.name, folder.path, self.precision, self.runtime)
        self.pixels = image_pixels(folder.path, self.name)
        classify = folder.family == "image-labels"
        try:
            if classify:
                model = AutoModelForImageClassification.from_pretrained(
                    folder.path, local_files_only=True
                )
            else:
                model = AutoModel.from_pretrained(folder.path, local_files_only=True)
        except Exception as e:
            raise ModelError(f"model {self.name!r}: cannot load {str(folder.path)!r}: {e}") from e
        model.eval().requires_grad_(False)
        model = apply_precision(model.to(self.runtime.device), self.precision)
        if classify:
            id2label = model.config.id2label
            self.labels = tuple(str(id2label[i]) for i in range(model.config.num_labels))
            self.multi_label = model.config.problem_type == "multi_label_classification"
            self.top_k = min(self.cfg.top_k, len(self.labels))
            self.module = _Classifier(model, classifier_head(model, len(self.labels))).eval()
        else:
            self.module = _Embedder(model).eval()
        self.folder = folder
        self.traced, self.trace_cache = None, "off"
        if self.cfg.torchscript:
            parts = self._trace_parts()
            key = trace_cache.cache_key(parts)
            self.traced = trace_cache.load(key, self.runtime.device)
            if self.traced is not None:
                self.trace_cache = "hit"
            else:
                self.traced = self._trace()
                if self.traced is not None and trace_cache.save(key, self.traced, parts):
                    self.trace_cache = "stored"
        with torch.inference_mode():
            feats, _ = self._encode(
                torch.zeros(1, 3, self.side, self.side, device=self.runtime.device)
            )
        self.dim = int(feats.shape[1])

    @property
    def side(self) -> int:
        return require_loaded(self.pixels, self.name).size  # type: ignore[no-any-return]

    def _trace_parts(self) -> dict[str, Any]:
        folder = require_loaded(self.folder, self.name)
        return {
            "adapter": "hf-image-classifier" if self.labels else "hf-image-embedder",
            "weights": str(folder.path.resolve()),
            "files": trace_cache.folder_fingerprint(folder.path),
            "image_size": self.side,
            "torch": torch.__version__,
            "transformers": version("transformers"),
            "device": self.runtime.device.type,
            "precision": self.precision,
        }

    def _trace(self) -> Any:
        """The module traced, checked against eager on another batch size; ``None`` (eager
        runs) when tracing fails or differs."""
        module, size, dev = self.module, self.side, self.runtime.device
        tol = 1e-4 if self.precision == "fp32" else 1e-2
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings():
                torch.manual_seed(0)
                warnings.simplefilter("ignore")  # TracerWarnings; checked below
                example = torch.rand(2, 3, size, size, device=dev).to(self._dtype)
                check = torch.rand(3, 3, size, size, device=dev).to(self._dtype)
                traced = torch.jit.trace(module, (example,), strict=False)
                got, want = traced(check), module(check)  # type: ignore[misc]
                got = got if isinstance(got, tuple) else (got,)
                want = want if isinstance(want, tuple) else (want,)
                diff = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
        except Exception:
            log.warning("TorchScript trace of %s failed; running eagerly", self.name, exc_info=True)
            return None
        if diff > tol:
            log.warning("TorchScript trace of %s differs from eager by %.2e; running eagerly",
                        self.name, diff)  # fmt: skip
            return None
        return traced

    def _encode(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(features, logits or None)`` of a pixel batch."""
        run = self.traced if self.traced is not None else require_loaded(self.module, self.name)
        out = run(batch.to(self._dtype))
        if isinstance(out, tuple):
            return out[0], out[1]
        return out, None

    def torch_modules(self) -> list[Any]:
        return [] if self.traced is not None or self.module is None else [self.module]

    # -- per request ----------------------------------------------------------------------
    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        """Check ``{"image_b64", "top_k"}`` as the image modality does (header read only).

        Raises:
            InvalidInput: bad inputs; ``top_k`` outside 0..labels, or given to an
                embeddings-only model.
            PayloadTooLarge: over the inline or pixel limits.
            ImageDecodeError: not a supported image.
        """
        raw = image_bytes(inputs, self.settings, self.input_keys)
        if self.labels:
            k = parse_top_k(inputs, self.top_k, len(self.labels))
        elif TOP_K_KEY in inputs:
            raise InvalidInput(f"model {self.name!r} gives embeddings only (no labels): no top_k")
        else:
            k = 0
        size = self.side
        return Prepared(str(size), 1, 3 * size * size * 4, (raw, k))

    def preprocess(self, prepared: Prepared) -> tuple[np.ndarray, int]:
        """Decode (``decode_image``: the folder's side and normalisation)."""
        raw, k = prepared.payload
        px = require_loaded(self.pixels, self.name)
        pixels = decode_image(
            raw,
            max_pixels=self.settings.limits.max_image_pixels,
            size=px.size,
            jpeg_draft=self.cfg.jpeg_draft,
            norm=px.norm,
        )
        return pixels, k

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        """Embed (and classify) a batch of ``(pixels, top_k)`` samples."""
        require_loaded(self.module, self.name)
        if not samples:
            return []
        pixels = [s[0] for s in samples]
        check_pixel_shapes(pixels, (3, self.side, self.side))
        batch = torch.from_numpy(np.stack(pixels).astype(np.float32, copy=False))
        (batch,) = self.runtime.stage([batch])
        with torch.inference_mode():
            feats, logits = self._encode(batch)
            emb = torch.nn.functional.normalize(feats.float(), dim=1).cpu().numpy()
            probs = None
            if logits is not None:
                lf = logits.float()
                probs = (
                    (torch.sigmoid(lf) if self.multi_label else torch.softmax(lf, 1)).cpu().numpy()
                )
        out = []
        for i, (e, (_, k)) in enumerate(zip(emb, samples, strict=True)):
            r: dict[str, Any] = {"embedding": e.tolist(), "dim": int(emb.shape[1])}
            if probs is not None:
                r["labels"] = top_labels(probs[i], k, self.labels)
            r["model"] = self.name
            out.append(r)
        return out

    # -- warmup and facts -----------------------------------------------------------------
    def buckets(self) -> list[str]:
        return [str(self.side)]

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        import base64

        if bucket is not None and bucket != str(self.side):
            raise ValueError(f"unknown image bucket {bucket!r}; this adapter has {self.side!r}")
        return [
            {INPUT_KEY: base64.b64encode(example_png(i)).decode("ascii")} for i in range(batch_size)
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
            classes=len(self.labels) or None,
            top_k=self.top_k if self.labels else None,
            multi_label=self.multi_label,
            precision=self.precision,
            torchscript=self.traced is not None,
            trace_cache=self.trace_cache,
            weight_bytes=self.weight_bytes,
            device=str(self.runtime.device),
        )
        return out
