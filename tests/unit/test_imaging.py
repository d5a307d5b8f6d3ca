"""Image decoding on the repo's real images (data/images, listed in data/SOURCES.md)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from shared.errors import ImageDecodeError, InvalidInput, PayloadTooLarge
from workers.models.imaging import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageHeader,
    decode_image,
    probe_image,
)

DATA = Path(__file__).resolve().parents[2] / "data"
IMAGES = DATA / "images"
GOOD = sorted(p.name for p in IMAGES.iterdir() if p.is_file())
BAD = {
    "pillow_broken.png": ImageDecodeError,  # open() cannot identify it
    "pillow_broken_data_stream.png": ImageDecodeError,  # header fine, corrupt IDAT
    "pillow_truncated_jpeg.jpg": ImageDecodeError,  # header fine, load() truncated
    "skimage_truncated.jpg": ImageDecodeError,  # truncated inside the header
    "pillow_decompression_bomb.gif": PayloadTooLarge,  # claims 65535x66601 pixels
}
LIMIT = 40_000_000  # settings.limits.max_image_pixels in configs/fleet.toml


def read(name: str) -> bytes:
    return (IMAGES / name).read_bytes()


def to_pixels(arr: np.ndarray) -> np.ndarray:
    """Undo the normalization: (3, H, W) float32 -> the same in 0..255 pixel units."""
    mean = np.asarray(IMAGENET_MEAN, dtype=np.float32)[:, None, None]
    std = np.asarray(IMAGENET_STD, dtype=np.float32)[:, None, None]
    return (arr * std + mean) * 255.0


def encode(img: Image.Image, fmt: str = "PNG", **kwargs: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def gif_claiming(width: int, height: int) -> bytes:
    """A real 1x1 GIF whose logical-screen header is patched to claim width x height."""
    data = bytearray(encode(Image.new("P", (1, 1)), "GIF"))
    data[6:8] = width.to_bytes(2, "little")
    data[8:10] = height.to_bytes(2, "little")
    return bytes(data)


def test_repo_has_the_expected_images() -> None:
    assert len(GOOD) >= 20
    assert sorted(p.name for p in (IMAGES / "bad").iterdir()) == sorted(BAD)


def test_every_repo_image_is_listed_in_sources() -> None:
    sources = (DATA / "SOURCES.md").read_text(encoding="utf-8")
    for name in [*GOOD, *(f"bad/{b}" for b in BAD)]:
        assert f"`images/{name}`" in sources, name


def test_import_leaves_truncated_images_an_error() -> None:
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


@pytest.mark.parametrize("name", GOOD)
@pytest.mark.parametrize("draft", [True, False])
def test_every_good_image_decodes(name: str, draft: bool) -> None:
    arr = decode_image(read(name), max_pixels=LIMIT, jpeg_draft=draft)
    assert arr.shape == (3, 224, 224)
    assert arr.dtype == np.float32
    assert arr.flags.c_contiguous
    assert np.isfinite(arr).all()
    pixels = to_pixels(arr)
    assert pixels.min() >= -0.5 and pixels.max() <= 255.5


def test_draft_decode_stays_close_to_full_decode() -> None:
    data = read("skimage_retina.jpg")  # 1411x1411: libjpeg decodes at 1/4 scale
    fast = to_pixels(decode_image(data, max_pixels=LIMIT, jpeg_draft=True))
    full = to_pixels(decode_image(data, max_pixels=LIMIT, jpeg_draft=False))
    assert np.abs(fast - full).mean() < 2.0


def test_size_parameter() -> None:
    assert decode_image(read("skimage_coffee.png"), max_pixels=LIMIT, size=64).shape == (3, 64, 64)


def test_normalization_constants() -> None:
    white = decode_image(encode(Image.new("RGB", (8, 8), (255, 255, 255))), max_pixels=LIMIT)
    black = decode_image(encode(Image.new("RGB", (8, 8), (0, 0, 0))), max_pixels=LIMIT)
    mean, std = np.asarray(IMAGENET_MEAN), np.asarray(IMAGENET_STD)
    np.testing.assert_allclose(white[:, 5, 5], (1 - mean) / std, rtol=1e-6)
    np.testing.assert_allclose(black[:, 5, 5], -mean / std, rtol=1e-6)


def test_exif_orientation_6_is_applied() -> None:
    data = read("pillow_hopper_orientation_6.jpg")
    decoded = decode_image(data, max_pixels=LIMIT)
    with Image.open(io.BytesIO(data)) as raw:
        raw.load()
        assert raw.getexif().get(0x0112) == 6
        stored = raw.copy()  # pixels as stored, without EXIF
    # Orientation 6 means "rotate 90 degrees clockwise to display" (= Pillow's ROTATE_270).
    by_hand = decode_image(encode(stored.transpose(Image.Transpose.ROTATE_270)), max_pixels=LIMIT)
    unrotated = decode_image(encode(stored), max_pixels=LIMIT)
    np.testing.assert_allclose(decoded, by_hand, atol=1e-5)
    assert np.abs(to_pixels(decoded) - to_pixels(unrotated)).mean() > 30
    # The file is the upright hopper.jpg stored rotated: once turned, they match (up to JPEG).
    upright = decode_image(read("pillow_hopper.jpg"), max_pixels=LIMIT)
    assert np.abs(to_pixels(decoded) - to_pixels(upright)).mean() < 8


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("skimage_camera.png", "L"),
        ("pillow_hopper_gray.jpg", "L"),
        ("pillow_hopper_bw_500.png", "1"),
        ("pillow_bw_gradient.png", "L"),
    ],
)
def test_gray_and_bilevel_give_equal_channels(name: str, mode: str) -> None:
    assert probe_image(read(name), max_pixels=LIMIT).mode == mode
    pixels = to_pixels(decode_image(read(name), max_pixels=LIMIT))
    np.testing.assert_allclose(pixels[0], pixels[1], atol=1e-3)
    np.testing.assert_allclose(pixels[1], pixels[2], atol=1e-3)


def test_bilevel_keeps_black_and_white() -> None:
    pixels = to_pixels(decode_image(read("pillow_hopper_bw_500.png"), max_pixels=LIMIT))
    assert pixels.min() < 5 and pixels.max() > 250


def test_cmyk_corners_are_red_and_black() -> None:
    # Pillow's own test of this file: top-left C=0 M,Y>0.8 K=0 (red), bottom-right K>0.9.
    assert probe_image(read("pillow_pil_sample_cmyk.jpg"), max_pixels=LIMIT).mode == "CMYK"
    pixels = to_pixels(decode_image(read("pillow_pil_sample_cmyk.jpg"), max_pixels=LIMIT))
    red, black = pixels[:, 0, 0], pixels[:, -1, -1]
    assert red[0] > 200 and red[1] < 60 and red[2] < 60
    assert black.max() < 30


def test_rgba_transparency_is_composited_on_white() -> None:
    data = read("pillow_pil123rgba.png")
    with Image.open(io.BytesIO(data)) as im:
        assert im.mode == "RGBA" and im.getpixel((0, 0)) == (0, 0, 0, 0)  # transparent black
    pixels = to_pixels(decode_image(data, max_pixels=LIMIT))
    np.testing.assert_allclose(pixels[:, 0, 0], [255, 255, 255], atol=0.5)
    assert pixels.min() < 50  # the toucan itself is still there


def test_palette_with_transparent_1x1_is_white() -> None:
    header = probe_image(read("pillow_tRNS_null_1x1.png"), max_pixels=LIMIT)
    assert (header.mode, header.width, header.height) == ("P", 1, 1)
    pixels = to_pixels(decode_image(read("pillow_tRNS_null_1x1.png"), max_pixels=LIMIT))
    np.testing.assert_allclose(pixels, 255.0, atol=0.5)


def test_wide_strip_keeps_its_centre() -> None:
    # 256x10 gradient, value == x: the kept centre square spans x = 123..133.
    pixels = to_pixels(decode_image(read("pillow_bw_gradient.png"), max_pixels=LIMIT))[0]
    row = pixels[112]
    assert 120 <= row[0] <= 126 and 129 <= row[-1] <= 136
    assert np.all(np.diff(row) >= -1e-3)
    np.testing.assert_allclose(pixels, np.broadcast_to(row, pixels.shape), atol=1e-3)


def test_extreme_aspect_ratio_does_not_blow_up() -> None:
    strip = Image.fromarray(np.tile(np.arange(256, dtype=np.uint8), (1, 160)))  # 1x40960
    arr = decode_image(encode(strip), max_pixels=LIMIT)
    assert arr.shape == (3, 224, 224) and np.isfinite(arr).all()


def test_multi_frame_gif_uses_first_frame() -> None:
    with Image.open(IMAGES / "pillow_hopper.jpg") as im:
        first = im.convert("RGB")
    second = Image.eval(first, lambda v: 255 - v)
    gif = encode(first, "GIF", save_all=True, append_images=[second], duration=100, loop=0)
    assert probe_image(gif, max_pixels=LIMIT).frames == 2
    only_first = encode(first, "GIF")
    np.testing.assert_allclose(
        decode_image(gif, max_pixels=LIMIT), decode_image(only_first, max_pixels=LIMIT), atol=1e-5
    )


def test_16_bit_gray_is_rescaled_not_clipped() -> None:
    with Image.open(IMAGES / "skimage_camera.png") as im:
        gray8 = np.asarray(im)
    gray16 = Image.fromarray(gray8.astype(np.uint16) * 257)
    data16 = encode(gray16)
    assert probe_image(data16, max_pixels=LIMIT).mode.startswith("I")
    np.testing.assert_allclose(
        to_pixels(decode_image(data16, max_pixels=LIMIT)),
        to_pixels(decode_image(read("skimage_camera.png"), max_pixels=LIMIT)),
        atol=0.5,
    )


def test_probe_reads_header_only() -> None:
    assert probe_image(read("skimage_hubble_deep_field.jpg"), max_pixels=LIMIT) == ImageHeader(
        format="JPEG", mode="RGB", width=1000, height=872, frames=1
    )
    assert probe_image(read("pillow_flower.webp"), max_pixels=LIMIT).format == "WEBP"
    # Truncated pixel data is only found by decoding.
    assert probe_image(read("bad/pillow_truncated_jpeg.jpg"), max_pixels=LIMIT).width == 100


@pytest.mark.parametrize("name", sorted(BAD))
@pytest.mark.parametrize("draft", [True, False])
def test_bad_files_raise_the_right_error(name: str, draft: bool) -> None:
    cls = BAD[name]
    with pytest.raises(InvalidInput) as info:
        decode_image(read(f"bad/{name}"), max_pixels=LIMIT, jpeg_draft=draft)
    assert type(info.value) is cls
    assert (
        info.value.code
        == {ImageDecodeError: "IMAGE_DECODE", PayloadTooLarge: "PAYLOAD_TOO_LARGE"}[cls]
    )
    assert info.value.to_dict()["code"] == info.value.code
    assert info.value.message


@pytest.mark.parametrize("name", ["pillow_broken.png", "pillow_decompression_bomb.gif"])
def test_probe_rejects_bad_headers(name: str) -> None:
    with pytest.raises(BAD[name]):
        probe_image(read(f"bad/{name}"), max_pixels=LIMIT)


def test_pixel_limit_is_checked_from_the_header() -> None:
    data = read("skimage_astronaut.png")  # 512x512 = 262,144 pixels
    assert decode_image(data, max_pixels=512 * 512).shape == (3, 224, 224)
    with pytest.raises(PayloadTooLarge, match="512x512") as info:
        decode_image(data, max_pixels=512 * 512 - 1)
    assert info.value.code == "PAYLOAD_TOO_LARGE"
    with pytest.raises(PayloadTooLarge):
        probe_image(data, max_pixels=1000)


def test_header_claiming_too_many_pixels_is_refused_without_decoding() -> None:
    data = gif_claiming(8000, 8000)  # 64 M: under Pillow's warning level, over ours
    assert len(data) < 100
    with pytest.raises(PayloadTooLarge, match="8000x8000"):
        decode_image(data, max_pixels=LIMIT)


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
def test_pillow_bomb_warning_as_error_is_payload_too_large() -> None:
    data = gif_claiming(10000, 10000)  # 100 M: above Pillow's 89.5 M warning level
    with pytest.raises(PayloadTooLarge, match="decompression bomb"):
        decode_image(data, max_pixels=200_000_000)


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image at all", b"\x89PNG\r\n\x1a\n", read("skimage_rocket.jpg")[:5000]],
    ids=["empty", "text", "png-signature-only", "half-a-jpeg"],
)
def test_undecodable_bytes_raise_image_decode_error(data: bytes) -> None:
    with pytest.raises(ImageDecodeError) as info:
        decode_image(data, max_pixels=LIMIT)
    assert info.value.code == "IMAGE_DECODE"


def test_formats_outside_the_allow_list_are_refused() -> None:
    with Image.open(IMAGES / "pillow_hopper.jpg") as im:
        ppm = encode(im, "PPM")
    with pytest.raises(ImageDecodeError, match="cannot identify"):
        decode_image(ppm, max_pixels=LIMIT)


def test_pillows_own_bomb_refusal_names_our_setting_and_its_value() -> None:
    # 400 M pixels: above twice Image.MAX_IMAGE_PIXELS, so Pillow refuses in Image.open,
    # before our header check; the message must still speak of [limits] max_image_pixels.
    data = gif_claiming(20000, 20000)
    with pytest.raises(PayloadTooLarge) as info:
        decode_image(data, max_pixels=LIMIT)
    msg = info.value.message
    assert "400,000,000 pixels" in msg
    assert f"[limits] max_image_pixels = {LIMIT:,}" in msg
    assert str(2 * Image.MAX_IMAGE_PIXELS) not in msg.replace(",", "")  # not Pillow's limit


def test_our_header_check_names_the_setting_and_its_value() -> None:
    with pytest.raises(PayloadTooLarge) as info:
        decode_image(gif_claiming(8000, 8000), max_pixels=LIMIT)
    assert f"[limits] max_image_pixels = {LIMIT:,}" in info.value.message
