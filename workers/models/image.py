"""An image adapter (kind ``resnet``): a ResNet-18-like embedding model from transformers.

The image modality serves EfficientNet-Lite0 by default (``workers.models.efficientnet``);
this one serves a ``[models.<name>] kind = "resnet"`` table that a modality names. Its
request checks (:func:`image_bytes`) and warmup images (:func:`example_png`) are shared.

Request inputs: ``{"image_b64": "<base64 of an encoded image file>"}``. Result per request:
``{"embedding": [512 floats, L2 norm 1], "dim": 512, "model": "<models key>"}``.

Weights: random but seeded (``cfg.seed``) so every worker process builds the same model, or a
local ``save_pretrained`` folder named by ``cfg.checkpoint``. Model config keys (in
``[models.<name>]`` of ``configs/fleet.toml``): ``image_size`` (224), ``checkpoint`` ("" for
random), ``seed`` (0), ``jpeg_draft`` (true; see :func:`workers.models.imaging.decode_image`).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import warnings
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from shared.errors import InvalidInput, ModelError, PayloadTooLarge
from shared.model_kinds import ImageOptions
from workers.models import trace_cache
from workers.models.base import ModelAdapter, Prepared, check_pixel_shapes, require_loaded
from workers.models.imaging import decode_image, probe_image

if TYPE_CHECKING:
    from transformers import ResNetConfig, ResNetModel

    from shared.model_kinds import ModelOptions
    from shared.settings import Settings
    from workers.models.runtime import DeviceRuntime

log = logging.getLogger(__name__)

INPUT_KEY = "image_b64"
_EXAMPLE_SIZE = (320, 256)  # width, height: not square, so warmup runs the resize + crop path


RESNET18_DIM = 512  # resnet18_config()'s hidden_sizes[-1]: the embedding's size


class _Pooled(torch.nn.Module):
    """A transformers ResNet's pooled output, flattened: (B, 3, S, S) -> (B, dim)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).pooler_output.flatten(1)


def _params(module: Any) -> int | None:
    """``module``'s parameter count (``None``: not loaded)."""
    return None if module is None else sum(p.numel() for p in module.parameters())


def _checkpoint_dim(path: Path) -> int:
    """The embedding size of the checkpoint at ``path`` (its ``config.json``)."""
    config = json.loads((path / "config.json").read_text())
    return int(config["hidden_sizes"][-1])


def resnet18_config() -> ResNetConfig:
    """A transformers ``ResNetConfig`` shaped like ResNet-18 (11.2 M parameters, 512-d)."""
    from transformers import ResNetConfig

    return ResNetConfig(
        num_channels=3,
        embedding_size=64,
        hidden_sizes=[64, 128, 256, 512],
        depths=[2, 2, 2, 2],
        layer_type="basic",
        hidden_act="relu",
    )


def _model_name(cfg: ModelOptions, settings: Settings) -> str:
    """The ``[models.<name>]`` key this config came from; its ``kind`` if not found."""
    for name, candidate in settings.models.items():
        if candidate is cfg:
            return name
    for name, candidate in settings.models.items():
        if candidate == cfg:
            return name
    return cfg.kind


@lru_cache(maxsize=64)
def example_png(index: int = 0, size: tuple[int, int] = _EXAMPLE_SIZE) -> bytes:
    """A deterministic RGB gradient encoded as PNG (for warmup; no files needed).

    Args:
        index: shifts the blue channel's diagonal pattern, so examples differ.
        size: ``(width, height)`` in pixels.

    Returns:
        PNG file bytes (a few KiB for the default size).
    """
    width, height = size
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    red = x * 255.0 / max(width - 1, 1)
    green = y * 255.0 / max(height - 1, 1)
    blue = (x + y + 37.0 * index) % 256.0
    rgb = np.stack([red, green, blue], axis=-1).round().astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def image_bytes(inputs: Any, settings: Settings, keys: tuple[str, ...] = (INPUT_KEY,)) -> bytes:
    """The encoded image file of a request's inputs, checked: ``{"image_b64": str}`` plus
    any other of ``keys`` (the caller checks those).

    The header read (no pixel decoding, tens of microseconds) rejects non-images,
    unsupported formats and decompression bombs here, before they take a batch slot.

    Raises:
        InvalidInput: not a dict, a key not in ``keys``, ``image_b64`` missing, not a
            string, empty or not valid standard base64 (padding required, no whitespace).
        PayloadTooLarge: decoded bytes above ``limits.max_inline_bytes``, or pixels
            above ``limits.max_image_pixels``.
        ImageDecodeError: the bytes are not an image in a supported format.
    """
    if not isinstance(inputs, dict):
        raise InvalidInput(f"image inputs must be an object, got {type(inputs).__name__}")
    unknown = sorted(str(k) for k in inputs if k not in keys)
    if unknown:
        expected = f"only {INPUT_KEY!r}" if keys == (INPUT_KEY,) else str(sorted(keys))
        raise InvalidInput(f"unknown image input keys {unknown}; expected {expected}")
    if INPUT_KEY not in inputs:
        raise InvalidInput(f"image inputs need {INPUT_KEY!r} (base64 of the image file)")
    b64 = inputs[INPUT_KEY]
    if not isinstance(b64, str):
        raise InvalidInput(f"{INPUT_KEY!r} must be a base64 string, got {type(b64).__name__}")
    if not b64:
        raise InvalidInput(f"{INPUT_KEY!r} is empty")
    limit = settings.limits.max_inline_bytes
    # Refuse before decoding: base64 of n bytes is 4 * ceil(n / 3) characters.
    if len(b64) > 4 * -(-limit // 3):
        raise PayloadTooLarge(
            f"{INPUT_KEY!r} is {len(b64):,} base64 characters, over the inline limit of "
            f"{limit:,} bytes"
        )
    try:
        raw = base64.b64decode(b64, validate=True)
    except ValueError as e:  # binascii.Error, or non-ASCII characters
        raise InvalidInput(f"{INPUT_KEY!r} is not valid base64: {e}") from e
    if len(raw) > limit:
        raise PayloadTooLarge(
            f"image is {len(raw):,} bytes, over the inline limit of {limit:,} bytes"
        )
    probe_image(raw, max_pixels=settings.limits.max_image_pixels)
    return raw


class ImageAdapter(ModelAdapter):
    """Image embeddings from a ResNet's pooled output (L2-normalized float32).

    Args:
        cfg: the ``[models.<name>]`` entry; extra keys ``image_size`` (int, pixels, default
            224), ``checkpoint`` (str, local folder, default "" = random weights), ``seed``
            (int, default 0), ``jpeg_draft`` (bool, default True).
        settings: fleet settings; uses ``limits.max_inline_bytes`` and
            ``limits.max_image_pixels``.
        runtime: the worker's started :class:`~workers.models.runtime.DeviceRuntime`.

    Raises:
        ValueError: ``image_size`` is not a positive integer.
    """

    modality = "image"
    options_type = ImageOptions

    def __init__(self, cfg: ImageOptions, settings: Settings, runtime: DeviceRuntime) -> None:
        super().__init__(cfg, settings, runtime)
        self.image_size = cfg.image_size
        self.checkpoint = cfg.checkpoint
        self.seed = cfg.seed
        self.jpeg_draft = cfg.jpeg_draft
        self.name = _model_name(cfg, settings)
        self.bucket = str(self.image_size)
        self.dim: int | None = None
        self._model: ResNetModel | None = None
        self.traced: Any = None  # the traced encoder (torchscript), when there is one
        self.trace_cache = "off"

    @property
    def weights_source(self) -> str:
        """``"random(seed=N)"`` or the checkpoint folder."""
        return self.checkpoint if self.checkpoint else f"random(seed={self.seed})"

    # -- lifecycle ----------------------------------------------------------------------
    def load(self) -> None:
        """Build or load the model on ``runtime.device``, in eval mode, without gradients.

        With ``torchscript`` (default) the pooled encoder is traced (checked against eager,
        else eager runs) and kept in the trace cache (``workers.models.trace_cache``): a later
        start with the same key loads it and builds no eager model (nor imports its code).

        Random weights are drawn under ``torch.manual_seed(seed)`` inside a forked RNG (the
        process's global RNG state is left as it was), so every process with the same seed,
        torch and transformers versions builds bit-identical weights.

        Raises:
            ModelError: ``checkpoint`` is set but is not a non-empty local folder, or
                transformers cannot load it.
        """
        self.traced = None
        self.trace_cache = "off"
        path = self._checkpoint_path()
        key, parts = "", {}
        if self.cfg.torchscript:
            parts = self._trace_parts(path)
            key = trace_cache.cache_key(parts)
            self.traced = trace_cache.load(key, self.runtime.device)
            if self.traced is not None:
                self.trace_cache = "hit"
                self.dim = _checkpoint_dim(path) if path else RESNET18_DIM
                return
        self._load_eager(path)
        if self.cfg.torchscript:
            self.traced = self._trace()
            if self.traced is not None and trace_cache.save(key, self.traced, parts):
                self.trace_cache = "stored"

    def _checkpoint_path(self) -> Path | None:
        """The checkpoint folder (``None``: random weights).

        Raises:
            ModelError: a checkpoint was asked for and is not a non-empty folder (never
                random weights under a real model's name).
        """
        if not self.checkpoint:
            return None
        path = Path(self.checkpoint).expanduser()
        if not path.is_dir() or not any(path.iterdir()):
            raise ModelError(
                f"model {self.name!r}: checkpoint {self.checkpoint!r} is not a non-empty "
                "local folder"
            )
        return path

    def _load_eager(self, path: Path | None) -> None:
        """The transformers model, from ``path`` or seeded random weights."""
        from transformers import ResNetModel

        if path is not None:
            try:
                model = ResNetModel.from_pretrained(path, local_files_only=True)
            except Exception as e:
                raise ModelError(
                    f"model {self.name!r}: cannot load checkpoint {self.checkpoint!r}: {e}"
                ) from e
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                model = ResNetModel(resnet18_config())
        model.eval().requires_grad_(False)
        self._model = model.to(self.runtime.device)
        self.dim = int(model.config.hidden_sizes[-1])

    def _trace_parts(self, path: Path | None) -> dict[str, Any]:
        """Everything the traced encoder depends on (the trace cache's key); no import of
        the model code."""
        from importlib.metadata import version

        weights: Any = (
            {"checkpoint": str(path.resolve()), "files": trace_cache.folder_fingerprint(path)}
            if path is not None
            else {"config": "resnet18", "seed": self.seed}
        )
        return {
            "adapter": "resnet-pooled",
            "weights": weights,
            "torch": torch.__version__,
            "transformers": version("transformers"),
            "device": self.runtime.device.type,
        }

    def _trace(self) -> Any:
        """The eager model's pooled output (``pixel_values`` (B, 3, S, S) float32 -> (B,
        dim)) traced with TorchScript and checked against eager on another batch size;
        ``None`` (logged, eager runs) when tracing fails or differs."""
        pooled = _Pooled(self._model).eval()
        size, dev = self.image_size, self.runtime.device
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings():
                torch.manual_seed(0)
                warnings.simplefilter("ignore")  # TracerWarnings about shapes; checked below
                example = torch.rand(2, 3, size, size, device=dev)
                check = torch.rand(3, 3, size, size, device=dev)
                traced = torch.jit.trace(pooled, (example,), strict=False)
                diff = float((traced(check) - pooled(check)).abs().max())
        except Exception:  # an architecture the tracer cannot follow: run eagerly
            log.warning("TorchScript trace of %s failed; running eagerly", self.name, exc_info=True)
            return None
        if diff > 1e-4:
            log.warning("TorchScript trace of %s differs from eager by %.2e; running eagerly",
                        self.name, diff)  # fmt: skip
            return None
        return traced

    def _encoder(self) -> Any:
        """What embeds a pixel batch: the traced encoder, else the eager model's pooled
        output (:class:`_Pooled`).

        Raises:
            ModelError: called before :meth:`load`.
        """
        if self.traced is not None:
            return self.traced
        return _Pooled(require_loaded(self._model, self.name)).eval()

    def torch_modules(self) -> list[Any]:
        # A traced encoder runs no Python hooks: no yield points to put in it.
        return [] if self.traced is not None or self._model is None else [self._model]

    # -- per request ----------------------------------------------------------------------
    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        """Validate ``{"image_b64": str}``, decode the base64, read the image header.

        The header read (no pixel decoding, tens of microseconds) rejects non-images,
        unsupported formats and decompression bombs here, before they take a batch slot.

        Returns:
            ``Prepared(bucket=str(image_size), length=1, nbytes=3*size*size*4,
            payload=<file bytes>)``.

        Raises:
            InvalidInput: not a dict, unknown keys, ``image_b64`` missing, not a string,
                empty or not valid standard base64 (padding required, no whitespace).
            PayloadTooLarge: decoded bytes above ``limits.max_inline_bytes``, or pixels
                above ``limits.max_image_pixels``.
            ImageDecodeError: the bytes are not an image in a supported format.
        """
        raw = image_bytes(inputs, self.settings)
        size = self.image_size
        return Prepared(bucket=self.bucket, length=1, nbytes=3 * size * size * 4, payload=raw)

    def preprocess(self, prepared: Prepared) -> np.ndarray:
        """Decode one prepared request.

        Returns:
            float32 array ``(3, image_size, image_size)``, ImageNet-normalized.

        Raises:
            ImageDecodeError: corrupt or truncated image data.
            PayloadTooLarge: pixels above ``limits.max_image_pixels``.
        """
        return decode_image(
            prepared.payload,
            max_pixels=self.settings.limits.max_image_pixels,
            size=self.image_size,
            jpeg_draft=self.jpeg_draft,
        )

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        """Embed a batch of preprocessed images.

        Args:
            samples: arrays from :meth:`preprocess`, each float32 ``(3, S, S)`` with
                ``S == image_size``.

        Returns:
            One ``{"embedding": list[float] (dim values, L2 norm 1), "dim": int,
            "model": str}`` per sample, in order.

        Raises:
            ModelError: called before :meth:`load`, or a sample of the wrong shape.
        """
        encoder = self._encoder()
        if not samples:
            return []
        check_pixel_shapes(samples, (3, self.image_size, self.image_size))
        batch = torch.from_numpy(np.stack(samples).astype(np.float32, copy=False))
        (batch,) = self.runtime.stage([batch])
        # The engine already runs this inside runtime.batch_context(); entering
        # inference_mode again is a no-op there and keeps direct callers (tests, the bench's
        # in-process limit) off autograd. batch_context itself is not re-entered: it would
        # synchronize the stream a second time.
        with torch.inference_mode():
            emb = F.normalize(encoder(batch).float(), dim=1).cpu().numpy()
        dim = int(emb.shape[1])
        return [{"embedding": row.tolist(), "dim": dim, "model": self.name} for row in emb]

    # -- warmup and facts -----------------------------------------------------------------
    def buckets(self) -> list[str]:
        """One bucket: every image is resized to ``image_size``."""
        return [self.bucket]

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        """``batch_size`` distinct in-memory PNG gradients (320x256), base64-encoded.

        Raises:
            ValueError: ``bucket`` is not this adapter's bucket.
        """
        if bucket is not None and bucket != self.bucket:
            raise ValueError(f"unknown image bucket {bucket!r}; this adapter has {self.bucket!r}")
        return [
            {INPUT_KEY: base64.b64encode(example_png(i)).decode("ascii")} for i in range(batch_size)
        ]

    def describe(self) -> dict[str, Any]:
        """Name, weights source, input size, embedding dim, parameters, device."""
        out = super().describe()
        out.update(
            name=self.name,
            weights=self.weights_source,
            image_size=self.image_size,
            bucket=self.bucket,
            dim=self.dim,
            params=_params(self.traced if self.traced is not None else self._model),
            trace_cache=getattr(self, "trace_cache", "off"),
            device=str(self.runtime.device),
        )
        return out
