"""ImageAdapter on real images: validation, embeddings, batching, determinism, checkpoints."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.errors import ImageDecodeError, InvalidInput, ModelError, PayloadTooLarge
from shared.model_kinds import ModelOptions, parse_model_options
from shared.settings import Settings, load_settings
from workers.models.image import ImageAdapter
from workers.models.runtime import DeviceRuntime

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "data" / "images"
MODEL = "resnet18-random"
PHOTOS = ["skimage_astronaut.png", "skimage_coffee.png", "skimage_chelsea.png"]


def b64(name: str) -> str:
    return base64.b64encode((IMAGES / name).read_bytes()).decode("ascii")


@pytest.fixture(scope="module")
def adapter(settings: Settings, runtime: DeviceRuntime) -> Iterator[ImageAdapter]:
    a = ImageAdapter(settings.models[MODEL], settings, runtime)
    a.load()
    yield a


def embed(adapter: ImageAdapter, names: list[str]) -> np.ndarray:
    """Run ``names`` as one batch through prepare -> preprocess -> run_batch; (B, dim)."""
    samples = [adapter.preprocess(adapter.prepare({"image_b64": b64(n)})) for n in names]
    out = adapter.run_batch(samples)
    assert len(out) == len(names)
    return np.asarray([r["embedding"] for r in out], dtype=np.float32)


# A fresh process's adapter of MODEL, loaded (``a``), from the repo's config.
_LOAD = (
    "import sys\n"
    "from shared.settings import DeviceConfig, load_settings\n"
    "from workers.models.image import ImageAdapter\n"
    "from workers.models.runtime import DeviceRuntime\n"
    "s = load_settings(); rt = DeviceRuntime(DeviceConfig()); rt.start()\n"
    f"a = ImageAdapter(s.models[{MODEL!r}], s, rt); a.load()\n"
)


def _last_line(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    """The last line ``script`` prints, run by a fresh interpreter in the repo."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env={**os.environ, "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"), **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    return proc.stdout.strip().splitlines()[-1]


def with_model(settings: Settings, **extra: Any) -> ModelOptions:
    base = settings.models[MODEL].model_dump()
    return parse_model_options({**base, **extra})


# -- prepare --------------------------------------------------------------------------------
def test_prepare_returns_bucket_and_raw_bytes(adapter: ImageAdapter) -> None:
    p = adapter.prepare({"image_b64": b64("skimage_rocket.jpg")})
    assert p.bucket == "224" == adapter.buckets()[0]
    assert p.length == 1
    assert p.nbytes == 3 * 224 * 224 * 4
    assert p.payload == (IMAGES / "skimage_rocket.jpg").read_bytes()


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        (["not", "a", "dict"], "must be an object"),
        ({}, "need 'image_b64'"),
        ({"image_b64": b64("pillow_hopper.jpg"), "extra": 1}, "unknown image input keys"),
        ({"image": "x"}, "unknown image input keys"),
        ({"image_b64": 123}, "must be a base64 string"),
        ({"image_b64": b"abcd"}, "must be a base64 string"),
        ({"image_b64": ""}, "is empty"),
        ({"image_b64": "abc$"}, "not valid base64"),
        ({"image_b64": "abc"}, "not valid base64"),  # bad padding
        ({"image_b64": "aGVsbG8=\n"}, "not valid base64"),
        ({"image_b64": "héllo=="}, "not valid base64"),
    ],
)
def test_prepare_rejects_malformed_inputs(adapter: ImageAdapter, inputs: Any, match: str) -> None:
    with pytest.raises(InvalidInput, match=match) as info:
        adapter.prepare(inputs)
    assert type(info.value) is InvalidInput
    assert info.value.code == "INVALID_INPUT"


def test_prepare_refuses_payload_over_inline_limit(runtime: DeviceRuntime) -> None:
    small = load_settings(limits={"max_inline_bytes": 10_000})
    a = ImageAdapter(small.models[MODEL], small, runtime)
    a.prepare({"image_b64": b64("pillow_hopper.jpg")})  # 6.4 KB: fits
    with pytest.raises(PayloadTooLarge, match="inline limit") as info:
        a.prepare({"image_b64": b64("pillow_pil123rgba.png")})  # 28 KB
    assert info.value.code == "PAYLOAD_TOO_LARGE"


def test_prepare_refuses_too_many_pixels(runtime: DeviceRuntime) -> None:
    small = load_settings(limits={"max_image_pixels": 100_000})
    a = ImageAdapter(small.models[MODEL], small, runtime)
    with pytest.raises(PayloadTooLarge, match="512x512"):
        a.prepare({"image_b64": b64("skimage_astronaut.png")})


@pytest.mark.parametrize(
    ("name", "cls"),
    [("pillow_broken.png", ImageDecodeError), ("pillow_decompression_bomb.gif", PayloadTooLarge)],
)
def test_prepare_rejects_bad_headers_at_once(
    adapter: ImageAdapter, name: str, cls: type[InvalidInput]
) -> None:
    with pytest.raises(cls):
        adapter.prepare({"image_b64": b64(f"bad/{name}")})


@pytest.mark.parametrize("name", ["pillow_truncated_jpeg.jpg", "pillow_broken_data_stream.png"])
def test_corrupt_pixel_data_fails_in_preprocess(adapter: ImageAdapter, name: str) -> None:
    prepared = adapter.prepare({"image_b64": b64(f"bad/{name}")})  # header is fine
    with pytest.raises(ImageDecodeError) as info:
        adapter.preprocess(prepared)
    assert info.value.code == "IMAGE_DECODE"


# -- run_batch --------------------------------------------------------------------------------
def test_batch_of_real_images_gives_unit_embeddings(adapter: ImageAdapter) -> None:
    samples = [adapter.preprocess(adapter.prepare({"image_b64": b64(n)})) for n in PHOTOS]
    assert all(s.shape == (3, 224, 224) and s.dtype == np.float32 for s in samples)
    out = adapter.run_batch(samples)
    json.dumps(out)  # results go to a JSON result backend as they are
    for r in out:
        assert set(r) == {"embedding", "dim", "model"}
        assert r["dim"] == 512 and len(r["embedding"]) == 512
        assert r["model"] == MODEL
        assert all(isinstance(v, float) for v in r["embedding"])
        v = np.asarray(r["embedding"])
        assert np.isfinite(v).all()
        assert abs(np.linalg.norm(v) - 1.0) < 1e-5


def test_same_image_gives_identical_embeddings(adapter: ImageAdapter) -> None:
    e = embed(adapter, ["skimage_coffee.png", "skimage_rocket.jpg", "skimage_coffee.png"])
    np.testing.assert_array_equal(e[0], e[2])
    np.testing.assert_array_equal(e[0], embed(adapter, ["skimage_coffee.png"])[0])


def test_different_images_give_different_embeddings(adapter: ImageAdapter) -> None:
    e = embed(adapter, PHOTOS)
    for i in range(len(PHOTOS)):
        for j in range(i + 1, len(PHOTOS)):
            assert np.abs(e[i] - e[j]).max() > 1e-3
            assert float(e[i] @ e[j]) < 0.9999  # random weights: close, but not the same


@pytest.mark.parametrize("batch_size", [2, 4, 8])
def test_batching_does_not_change_answers(adapter: ImageAdapter, batch_size: int) -> None:
    names = [
        "skimage_astronaut.png",
        "pillow_pil_sample_cmyk.jpg",
        "skimage_camera.png",
        "pillow_hopper_orientation_6.jpg",
        "detectron_34501842524_3c858b3080_k.jpg",
        "pillow_pil123rgba.png",
        "pillow_flower.webp",
        "pillow_tRNS_null_1x1.png",
    ][:batch_size]
    batched = embed(adapter, names)
    singles = np.concatenate([embed(adapter, [n]) for n in names])
    np.testing.assert_allclose(batched, singles, atol=1e-4)


def test_run_batch_edge_cases(
    adapter: ImageAdapter, settings: Settings, runtime: DeviceRuntime
) -> None:
    assert adapter.run_batch([]) == []
    with pytest.raises(ModelError, match="expected"):
        adapter.run_batch([np.zeros((3, 64, 64), dtype=np.float32)])
    unloaded = ImageAdapter(settings.models[MODEL], settings, runtime)
    with pytest.raises(ModelError, match="before load"):
        unloaded.run_batch([np.zeros((3, 224, 224), dtype=np.float32)])


def test_direct_call_builds_no_autograd_graph(adapter: ImageAdapter) -> None:
    encoder = adapter._encoder()  # traced (from the trace cache or just traced) or eager
    assert not any(p.requires_grad for p in encoder.parameters())
    assert not encoder.training


# -- determinism and weights --------------------------------------------------------------------
def test_same_seed_same_model_across_instances(
    adapter: ImageAdapter, settings: Settings, runtime: DeviceRuntime
) -> None:
    other = ImageAdapter(settings.models[MODEL], settings, runtime)
    other.load()
    np.testing.assert_array_equal(embed(adapter, PHOTOS), embed(other, PHOTOS))


def test_other_seed_other_model(
    adapter: ImageAdapter, settings: Settings, runtime: DeviceRuntime
) -> None:
    other = ImageAdapter(with_model(settings, seed=1), settings, runtime)
    other.load()
    assert other.describe()["weights"] == "random(seed=1)"
    assert np.abs(embed(adapter, PHOTOS[:1]) - embed(other, PHOTOS[:1])).max() > 1e-3


def test_same_seed_same_model_across_processes(adapter: ImageAdapter) -> None:
    script = _LOAD + (
        "import base64, json\n"
        "data = base64.b64encode(open(sys.argv[1], 'rb').read()).decode()\n"
        "out = a.run_batch([a.preprocess(a.prepare({'image_b64': data}))])\n"
        "print(json.dumps(out[0]['embedding']))\n"
    )
    last = _last_line(script, str(IMAGES / PHOTOS[0]))
    theirs = np.asarray(json.loads(last), dtype=np.float32)
    np.testing.assert_array_equal(theirs, embed(adapter, PHOTOS[:1])[0])


def test_load_leaves_the_global_rng_alone(settings: Settings, runtime: DeviceRuntime) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    ImageAdapter(settings.models[MODEL], settings, runtime).load()
    torch.testing.assert_close(torch.rand(4), expected)


def test_checkpoint_folder_round_trip(
    adapter: ImageAdapter, settings: Settings, runtime: DeviceRuntime, tmp_path: Path
) -> None:
    eager = ImageAdapter(with_model(settings, torchscript=False), settings, runtime)
    eager.load()
    assert eager.traced is None and eager.trace_cache == "off"
    eager._model.save_pretrained(tmp_path)  # type: ignore[union-attr]
    loaded = ImageAdapter(with_model(settings, checkpoint=str(tmp_path)), settings, runtime)
    loaded.load()
    assert loaded.describe()["weights"] == str(tmp_path)
    np.testing.assert_allclose(embed(loaded, PHOTOS), embed(adapter, PHOTOS), atol=1e-6)


@pytest.mark.parametrize("kind", ["missing", "empty", "garbage"])
def test_bad_checkpoint_fails_loudly(
    settings: Settings, runtime: DeviceRuntime, tmp_path: Path, kind: str
) -> None:
    folder = tmp_path / "ckpt"
    if kind != "missing":
        folder.mkdir()
    if kind == "garbage":
        (folder / "config.json").write_text("{not json")
    a = ImageAdapter(with_model(settings, checkpoint=str(folder)), settings, runtime)
    with pytest.raises(ModelError, match="checkpoint"):
        a.load()


# -- warmup and facts -----------------------------------------------------------------------------
def test_example_inputs_run_end_to_end(adapter: ImageAdapter) -> None:
    inputs = adapter.example_inputs(4, adapter.buckets()[0])
    assert len(inputs) == 4 and len({i["image_b64"] for i in inputs}) == 4
    assert inputs == adapter.example_inputs(4)  # deterministic
    prepared = [adapter.prepare(i) for i in inputs]
    assert {p.bucket for p in prepared} == {"224"}
    out = adapter.run_batch([adapter.preprocess(p) for p in prepared])
    assert [r["dim"] for r in out] == [512] * 4
    with pytest.raises(ValueError, match="bucket"):
        adapter.example_inputs(1, "len32")


def test_describe(adapter: ImageAdapter) -> None:
    d = adapter.describe()
    assert d["modality"] == "image" and d["kind"] == "resnet"
    assert d["name"] == MODEL
    assert d["weights"] == "random(seed=0)"
    assert (d["image_size"], d["dim"], d["device"]) == (224, 512, "cpu")
    assert 11_000_000 < d["params"] < 12_000_000
    json.dumps(d)


# -- the trace cache ----------------------------------------------------------------------------
def test_a_second_load_takes_the_traced_encoder_from_the_cache_and_embeds_alike(
    settings: Settings, runtime: DeviceRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_TRACE_CACHE_DIR", str(tmp_path / "traced"))
    eager = ImageAdapter(with_model(settings, torchscript=False), settings, runtime)
    eager.load()
    first = ImageAdapter(settings.models[MODEL], settings, runtime)
    first.load()
    assert first.trace_cache == "stored" and first.traced is not None
    second = ImageAdapter(settings.models[MODEL], settings, runtime)
    second.load()
    assert second.trace_cache == "hit" and second._model is None  # no eager model built
    assert second.dim == eager.dim == 512 and second.describe()["params"] == 11176512
    want = embed(eager, PHOTOS)
    np.testing.assert_allclose(embed(first, PHOTOS), want, atol=1e-5)
    np.testing.assert_allclose(embed(second, PHOTOS), want, atol=1e-5)
    other_seed = ImageAdapter(with_model(settings, seed=1), settings, runtime)
    other_seed.load()
    assert other_seed.trace_cache == "stored"  # another key: its own entry


def test_a_start_from_the_cache_does_not_import_the_model_code(tmp_path: Path) -> None:
    """What cold start saves: transformers' modeling modules (seconds of imports) are never
    imported by a worker whose encoder comes from the trace cache."""
    script = _LOAD + "print(a.trace_cache, 'transformers.modeling_utils' in sys.modules)\n"
    env = {"FLEET_TRACE_CACHE_DIR": str(tmp_path / "traced")}
    outs = [_last_line(script, env=env) for _ in range(2)]
    assert outs == ["stored True", "hit False"]
