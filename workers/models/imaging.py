"""Image decoding for the image modality: bytes -> a normalized ``(3, size, size)`` array.

Everything here is pure CPU work with Pillow and numpy (no torch), so it runs on the
inference thread per request (``ModelAdapter.preprocess``) and is cheap to test.

Hostile input is expected: the pixel count is checked from the header before any pixel is
decoded, only a fixed set of raster formats is accepted (no EPS, which shells out to
Ghostscript, and none of Pillow's rarer plugins), and every Pillow failure becomes a
:class:`shared.errors.ImageDecodeError` or :class:`shared.errors.PayloadTooLarge` with a
stable code. ``ImageFile.LOAD_TRUNCATED_IMAGES`` is deliberately left off: a truncated file
is an error, not an image with a grey bottom half.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, ImageOps

from shared.errors import FleetError, ImageDecodeError, PayloadTooLarge
from shared.model_kinds import IMAGENET_MEAN, IMAGENET_STD

SUPPORTED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF")
"""Pillow open-plugin ids ``decode_image`` accepts. The JPEG plugin also opens MPO (the
multi-picture JPEGs phones write), reported with ``format == "MPO"``."""


_WHITE = (255, 255, 255, 255)
_MAX_DETAIL = 200  # characters of a Pillow message kept in our own error message


@dataclass(frozen=True, slots=True, eq=False)
class PixelNorm:
    """A per-channel normalisation of 0..255 RGB pixels folded into one multiply-add per
    pixel: ``(x - mean) / std == x * scale + bias``.

    Attributes:
        scale: float32 ``(3,)``, ``1 / std``.
        bias: float32 ``(3,)``, ``-mean / std``.
    """

    scale: np.ndarray
    bias: np.ndarray

    @classmethod
    def unit(cls, mean: tuple[float, ...], std: tuple[float, ...]) -> PixelNorm:
        """Statistics of pixels scaled to [0, 1] (torchvision's ``Normalize`` after
        ``ToTensor``): ``(x / 255 - mean) / std``."""
        m, sd = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
        return cls((1.0 / (255.0 * sd)).astype(np.float32), (-m / sd).astype(np.float32))

    @classmethod
    def pixels(cls, mean: tuple[float, ...], std: tuple[float, ...]) -> PixelNorm:
        """Statistics on the 0..255 pixel scale (TF-Lite's ``(x - 127) / 128``)."""
        m, sd = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
        return cls((1.0 / sd).astype(np.float32), (-m / sd).astype(np.float32))

    def apply(self, pixels: np.ndarray) -> np.ndarray:
        """float32 ``(..., 3)`` channels-last pixels in 0..255 -> normalised, same shape."""
        return pixels * self.scale + self.bias


IMAGENET_NORM = PixelNorm.unit(IMAGENET_MEAN, IMAGENET_STD)
"""torchvision's ImageNet normalisation (the ResNet and dual-encoder adapters' inputs)."""


@dataclass(frozen=True, slots=True)
class ImageHeader:
    """What an image's header says, read without decoding pixels.

    Attributes:
        format: Pillow format id: one of :data:`SUPPORTED_FORMATS`, or ``"MPO"``.
        mode: Pillow mode of the first frame (``"RGB"``, ``"L"``, ``"P"``, ``"CMYK"``...).
        width: pixels.
        height: pixels.
        frames: number of frames (1 for still images; GIF/WebP/TIFF may have more).
    """

    format: str
    mode: str
    width: int
    height: int
    frames: int


def _detail(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= _MAX_DETAIL else text[:_MAX_DETAIL] + "..."


def bomb_message(exc: BaseException, max_pixels: int) -> str:
    """The message for Pillow's decompression-bomb refusal, in our terms: the image's pixel
    count (from Pillow's text, when it gives one) against ``[limits] max_image_pixels``.
    Pillow refuses on its own above twice ``Image.MAX_IMAGE_PIXELS``, before our header
    check can run, and its text names only its own limit."""
    import re

    found = re.search(r"\((\d+) pixels\)", str(exc))
    pixels = int(found.group(1)) if found else None
    size = f"{pixels:,} pixels" if pixels is not None else "too many pixels"
    setting = f"[limits] max_image_pixels = {max_pixels:,}"
    if pixels is not None and pixels <= max_pixels:
        # A setting above Pillow's own refusal level cannot let such an image through.
        return (
            f"image rejected as a decompression bomb: {size}, within {setting} but above "
            f"Pillow's own limit ({2 * (Image.MAX_IMAGE_PIXELS or 0):,}), which applies too"
        )
    return f"image rejected as a decompression bomb: {size}, above the limit ({setting})"


def _open(data: bytes, max_pixels: int) -> ImageFile.ImageFile:
    """Open lazily (header only) and enforce the pixel limit.

    Raises:
        ImageDecodeError: empty data, unknown/unsupported format, unreadable header.
        PayloadTooLarge: width * height above ``max_pixels``, or Pillow's own
            decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``) tripped.
    """
    if not data:
        raise ImageDecodeError("empty image data (0 bytes)")
    try:
        img = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # The warning is only raised when warnings are turned into errors (python -W error).
        raise PayloadTooLarge(bomb_message(e, max_pixels)) from e
    except Image.UnidentifiedImageError as e:
        raise ImageDecodeError(
            f"cannot identify an image (supported: {', '.join(SUPPORTED_FORMATS)}); "
            f"{len(data)} bytes starting {data[:8].hex()}"
        ) from e
    except Exception as e:
        # Pillow's plugins raise whatever their parser hits (OSError, SyntaxError,
        # ValueError, struct.error, EOFError...); callers must only ever see our errors.
        raise ImageDecodeError(f"cannot read image header: {_detail(e)}") from e
    width, height = img.size
    if width <= 0 or height <= 0:
        img.close()
        raise ImageDecodeError(f"image header gives an empty size {width}x{height}")
    if width * height > max_pixels:
        img.close()
        raise PayloadTooLarge(
            f"image is {width}x{height} = {width * height:,} pixels, "
            f"above the limit ([limits] max_image_pixels = {max_pixels:,})"
        )
    return img


def probe_image(data: bytes, *, max_pixels: int) -> ImageHeader:
    """Read an image's header only (microseconds; no pixel is decoded).

    Catches empty, non-image, unsupported-format and oversized inputs early. A file whose
    header is fine but whose pixel data is truncated or corrupt passes here and fails in
    :func:`decode_image`.

    Args:
        data: the encoded file's bytes.
        max_pixels: largest accepted ``width * height``.

    Raises:
        ImageDecodeError: see :func:`decode_image`.
        PayloadTooLarge: ``width * height > max_pixels`` (or Pillow's bomb limit).
    """
    img = _open(data, max_pixels)
    with img:
        return ImageHeader(
            format=str(img.format),
            mode=img.mode,
            width=img.size[0],
            height=img.size[1],
            frames=int(getattr(img, "n_frames", 1)),
        )


def _high_bit_depth_to_l(img: Image.Image) -> Image.Image:
    """Map a 16/32-bit integer or float single-band image to 8-bit ``L``.

    Pillow's own ``convert`` clips these at 255 instead of rescaling, which turns most
    16-bit images white.
    """
    a = np.asarray(img).astype(np.float32)
    if img.mode.startswith("I;16"):
        a = a / 257.0  # 65535 -> 255
    elif img.mode == "F" and a.size and float(np.nanmax(a)) <= 1.0:
        a = a * 255.0  # float images in [0, 1]
    elif img.mode == "I" and a.size and float(a.max()) > 255.0:
        a = np.clip(a, 0.0, 65535.0) / 257.0  # 16-bit PNG data read as 32-bit "I"
    a = np.nan_to_num(a, nan=0.0, posinf=255.0, neginf=0.0)
    return Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), mode="L")


def _to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode -> ``RGB``; transparent pixels are composited on white."""
    if img.mode == "RGB" and "transparency" not in img.info:
        return img
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        return _high_bit_depth_to_l(img).convert("RGB")
    if img.has_transparency_data:
        # RGBA, LA, PA, La, RGBa, and P/L/RGB with a tRNS colour key. White, not black,
        # because transparent regions of logos and cut-outs are meant to be background.
        rgba = img.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, _WHITE)
        canvas.alpha_composite(rgba)
        return canvas.convert("RGB")
    return img.convert("RGB")  # L, 1, P, CMYK (Adobe-inverted handled by Pillow), YCbCr...


def decode_image(
    data: bytes,
    *,
    max_pixels: int,
    size: int = 224,
    jpeg_draft: bool = True,
    norm: PixelNorm = IMAGENET_NORM,
) -> np.ndarray:
    """Decode an encoded image into the model's input array.

    Steps: header check (format, ``width * height <= max_pixels``) before any pixel is
    decoded; first frame only (GIF/WebP/TIFF animations); EXIF orientation applied; any
    mode converted to RGB (alpha composited on white; 16-bit rescaled); the shorter side
    resized to ``size`` (bicubic, antialiased) and the centre ``size x size`` square kept
    (done as one resize of the centre box, so a 1x40000 strip never becomes a huge
    intermediate image); normalised with ``norm`` (default: :data:`IMAGENET_MEAN` /
    :data:`IMAGENET_STD` on pixels scaled to [0, 1]).

    Args:
        data: the encoded file's bytes (JPEG, PNG, GIF, WebP, BMP, TIFF, MPO).
        max_pixels: largest accepted ``width * height`` of the encoded image (the
            decompression-bomb guard; ``settings.limits.max_image_pixels``). Pillow's own
            ``Image.MAX_IMAGE_PIXELS`` check still applies on top (it refuses above twice
            that value, about 179 M pixels by default).
        size: output side in pixels.
        jpeg_draft: let libjpeg decode a JPEG at 1/2, 1/4 or 1/8 scale when the result is
            still at least ``size`` on both sides (what ``Image.thumbnail`` does): faster and
            up to 64x less memory (1/8 scale) on large photos; pixel values differ slightly
            from a full decode (see docs/decisions.md, "JPEG draft decoding"). Set False to
            match a reference pipeline exactly.
        norm: the per-channel normalisation the model was trained with.

    Returns:
        float32 array of shape ``(3, size, size)``, channels RGB, C-contiguous (with the
        default ``norm``, values roughly in [-2.12, 2.64]).

    Raises:
        ImageDecodeError: empty data, not an image, unsupported format, a corrupt or
            truncated file, or a mode that cannot be converted to RGB.
        PayloadTooLarge: ``width * height > max_pixels`` or Pillow's bomb check tripped.
    """
    img = _open(data, max_pixels)
    fmt, (width, height) = img.format, img.size
    try:
        with img:
            if jpeg_draft and fmt in ("JPEG", "MPO"):
                # A square request keeps both sides >= size whatever the EXIF rotation.
                img.draft(None, (size, size))
            img.load()  # the first frame of a multi-frame file
            ImageOps.exif_transpose(img, in_place=True)
            rgb = _to_rgb(img)
            w, h = rgb.size
            side = min(w, h)
            box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
            out = rgb.resize((size, size), Image.Resampling.BICUBIC, box=box)
    except FleetError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise PayloadTooLarge(bomb_message(e, max_pixels)) from e
    except Exception as e:
        # Truncated data ("image file is truncated"), corrupt streams, bad EXIF, modes
        # Pillow cannot convert: all the caller's input problem, none retryable.
        raise ImageDecodeError(f"cannot decode {fmt} image ({width}x{height}): {_detail(e)}") from e
    arr = np.asarray(out, dtype=np.float32)  # (size, size, 3), 0..255
    arr = norm.apply(arr)
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def normalize_frames(frames: np.ndarray, norm: PixelNorm = IMAGENET_NORM) -> np.ndarray:
    """uint8 ``(n, s, s, 3)`` RGB -> float32 ``(n, 3, s, s)`` normalised with ``norm``.

    Bit-identical to what :func:`decode_image` produces for the same pixels and ``norm``
    (the same constants and arithmetic), so a video frame embeds exactly like the same RGB
    picture sent to the image worker as a PNG.
    """
    arr = norm.apply(frames.astype(np.float32))
    return np.ascontiguousarray(arr.transpose(0, 3, 1, 2))
