"""XModalAdapter on the repo's image-caption pairs: shapes, scores, batching, determinism.

The dual encoder's text tower is the real all-MiniLM-L6-v2; the image tower and both
projections are random (seeded), so these tests check the mechanics, never that a caption
"wins" for its own image: with random projections the scores carry no meaning.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.errors import ImageDecodeError, InvalidInput, ModelError, PayloadTooLarge
from shared.model_kinds import ModelOptions, parse_model_options
from shared.settings import Settings
from shared.transport import ShmStore, decode_inline
from workers.models.runtime import DeviceRuntime
from workers.models.xmodal import XModalAdapter, XModalSample

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
MODEL = "xmodal-vit-minilm"


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode("ascii")


def caption_pairs() -> list[tuple[Path, list[str]]]:
    """(image path, its captions) from data/captions/captions_coco.json."""
    coco = json.loads((DATA / "captions" / "captions_coco.json").read_text())
    caps: dict[int, list[str]] = defaultdict(list)
    for a in coco["annotations"]:
        caps[a["image_id"]].append(a["caption"])
    return [(DATA / im["file_name"], caps[im["id"]]) for im in coco["images"] if caps[im["id"]]]


PAIRS = caption_pairs()
ALL_CAPTIONS = [c for _, caps in PAIRS for c in caps]


@pytest.fixture(scope="module")
def adapter(settings: Settings, runtime: DeviceRuntime) -> XModalAdapter:
    # Not the xmodal modality's default model (ConSE is): built from its table.
    a = XModalAdapter(settings.models[MODEL], settings, runtime)
    a.load()
    return a


def with_model(settings: Settings, **extra: Any) -> ModelOptions:
    return parse_model_options({**settings.models[MODEL].model_dump(), **extra})


def run(adapter: XModalAdapter, *inputs: dict[str, Any]) -> list[dict[str, Any]]:
    return adapter.run_batch([adapter.preprocess(adapter.prepare(i)) for i in inputs])


def texts_of(result: dict[str, Any], settings: Settings) -> np.ndarray:
    wire = result["text_embeddings"]
    if wire["kind"] == "inline":
        return decode_inline(wire)
    store = ShmStore(root=settings.transport.shm_root)
    arr = np.array(store.get(wire))
    store.release(wire)
    return arr


def test_image_with_its_captions_gives_well_formed_scores(
    adapter: XModalAdapter, settings: Settings
) -> None:
    path, caps = PAIRS[0]  # the astronaut photo and its captions
    out = run(adapter, {"image_b64": b64(path), "texts": caps})[0]
    json.dumps(out)
    assert out["texts"] == len(caps) and out["dim"] == 512
    assert len(out["scores"]) == len(out["logits"]) == len(out["probs"]) == len(caps)
    assert all(-1.0 <= s <= 1.0 for s in out["scores"])
    assert out["logit_scale"] == pytest.approx(100.0, rel=1e-4)
    np.testing.assert_allclose(out["logits"], 100.0 * np.asarray(out["scores"]), rtol=1e-4)
    assert sum(out["probs"]) == pytest.approx(1.0)
    img = np.asarray(out["image_embedding"], dtype=np.float32)
    assert img.shape == (512,) and abs(np.linalg.norm(img) - 1) < 1e-5
    txt = texts_of(out, settings)
    assert txt.shape == (len(caps), 512) and txt.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(txt, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(txt @ img, out["scores"], atol=1e-5)
    assert out["truncated"] == [False] * len(caps)
    assert out["model"] == MODEL


def test_all_images_against_all_captions_in_one_batch(
    adapter: XModalAdapter, settings: Settings
) -> None:
    assert len(PAIRS) == 8 and len(ALL_CAPTIONS) == 14
    reqs = [{"image_b64": b64(p), "texts": ALL_CAPTIONS} for p, _ in PAIRS[:4]]
    out = run(adapter, *reqs)
    assert [len(r["scores"]) for r in out] == [14] * 4
    # 14 texts x 512 float32 = 28 KiB: over the inline limit, so the result carries a ref.
    assert {r["text_embeddings"]["kind"] for r in out} == {"shm"}
    first = texts_of(out[0], settings)
    for r in out[1:]:  # the same texts embed the same in every request of the batch
        np.testing.assert_allclose(texts_of(r, settings), first, atol=1e-6)
    assert not ShmStore(root=settings.transport.shm_root).ls()
    # Different images must give different score rows (random towers still see pixels).
    rows = np.asarray([r["scores"] for r in out])
    assert np.abs(rows[0] - rows[1]).max() > 1e-4


def test_batch_equals_single(adapter: XModalAdapter) -> None:
    reqs = [
        {"image_b64": b64(PAIRS[1][0]), "texts": PAIRS[1][1]},
        {"image_b64": b64(PAIRS[2][0]), "text": "A cat."},
        {"image_b64": b64(DATA / "images" / "pillow_hopper_orientation_6.jpg"), "texts": ["a"]},
    ]
    batched = run(adapter, *reqs)
    for req, b in zip(reqs, batched, strict=True):
        s = run(adapter, req)[0]
        np.testing.assert_allclose(b["scores"], s["scores"], atol=1e-5)
        np.testing.assert_allclose(b["image_embedding"], s["image_embedding"], atol=1e-5)


def test_single_text_key(adapter: XModalAdapter) -> None:
    out = run(adapter, {"image_b64": b64(PAIRS[0][0]), "text": "An astronaut."})[0]
    assert out["texts"] == 1 and out["probs"] == [1.0]
    assert out["text_embeddings"]["kind"] == "inline"


def test_long_text_is_truncated_and_flagged(adapter: XModalAdapter) -> None:
    long = " ".join(["astronaut"] * 200)
    out = run(adapter, {"image_b64": b64(PAIRS[0][0]), "texts": [long, "short"]})[0]
    assert out["truncated"] == [True, False]
    assert out["tokens"][0] == 77


def test_deterministic_across_instances_and_seeded(
    adapter: XModalAdapter, settings: Settings, runtime: DeviceRuntime
) -> None:
    req = {"image_b64": b64(PAIRS[3][0]), "texts": PAIRS[3][1]}
    other = XModalAdapter(settings.models[MODEL], settings, runtime)
    other.load()
    assert run(other, req)[0]["scores"] == run(adapter, req)[0]["scores"]
    reseeded = XModalAdapter(with_model(settings, seed=1), settings, runtime)
    reseeded.load()
    diff = np.subtract(run(reseeded, req)[0]["scores"], run(adapter, req)[0]["scores"])
    assert np.abs(diff).max() > 1e-3


def test_text_tower_keeps_the_real_minilm_weights(adapter: XModalAdapter) -> None:
    from transformers import AutoModel

    from workers.models.xmodal import _packaged_minilm

    ref = AutoModel.from_pretrained(_packaged_minilm(), local_files_only=True).state_dict()
    mine = adapter.model.text_model.state_dict()
    assert set(ref) <= set(mine)
    for k, v in ref.items():
        torch.testing.assert_close(mine[k], v, rtol=0, atol=0)


def test_load_leaves_the_global_rng_alone(settings: Settings, runtime: DeviceRuntime) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    XModalAdapter(with_model(settings, vision_layers=1), settings, runtime).load()
    torch.testing.assert_close(torch.rand(4), expected)


def test_checkpoint_round_trip(
    adapter: XModalAdapter, settings: Settings, runtime: DeviceRuntime, tmp_path: Path
) -> None:
    small = XModalAdapter(with_model(settings, vision_layers=2), settings, runtime)
    small.load()
    ckpt = tmp_path / "dual"
    small.model.save_pretrained(ckpt)
    try:
        loaded = XModalAdapter(with_model(settings, checkpoint=str(ckpt)), settings, runtime)
        loaded.load()
        assert loaded.describe()["semantic"] is True and loaded.describe()["weights"] == str(ckpt)
        req = {"image_b64": b64(PAIRS[0][0]), "texts": PAIRS[0][1]}
        ours, theirs = run(loaded, req)[0]["scores"], run(small, req)[0]["scores"]
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    bad = XModalAdapter(with_model(settings, checkpoint=str(tmp_path / "none")), settings, runtime)
    with pytest.raises(ModelError, match="checkpoint"):
        bad.load()


def test_clip_statistics_renormalize_pixels(
    adapter: XModalAdapter, settings: Settings, runtime: DeviceRuntime
) -> None:
    clip_mean, clip_std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    other = XModalAdapter(
        with_model(settings, image_mean=clip_mean, image_std=clip_std), settings, runtime
    )
    other.tokenizer = adapter.tokenizer  # prepare needs only the tokenizer
    req = {"image_b64": b64(PAIRS[0][0]), "text": "x y"}
    a = adapter.preprocess(adapter.prepare(req)).pixels
    b = other.preprocess(other.prepare(req)).pixels
    # Back to 0..1 pixels both ways: the same picture.
    imagenet_mean, imagenet_std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    x_a = a * np.reshape(imagenet_std, (3, 1, 1)) + np.reshape(imagenet_mean, (3, 1, 1))
    x_b = b * np.reshape(clip_std, (3, 1, 1)) + np.reshape(clip_mean, (3, 1, 1))
    np.testing.assert_allclose(x_a, x_b, atol=1e-5)
    assert np.abs(a - b).max() > 0.01


# -- bad inputs -----------------------------------------------------------------------------------
IMG = b64(DATA / "images" / "pillow_hopper.jpg")


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        ("nope", "must be an object"),
        ({"texts": ["a"]}, "need 'image_b64'"),
        ({"image_b64": IMG}, "exactly one of"),
        ({"image_b64": IMG, "text": "a", "texts": ["a"]}, "exactly one of"),
        ({"image_b64": IMG, "texts": []}, "1 to 16"),
        ({"image_b64": IMG, "texts": ["a"] * 17}, "1 to 16"),
        ({"image_b64": IMG, "texts": "a"}, "1 to 16"),
        ({"image_b64": IMG, "texts": ["a", 3]}, "text 1 must be a string"),
        ({"image_b64": IMG, "texts": ["a", "   "]}, "text 1 is empty"),
        ({"image_b64": IMG, "texts": ["\u200b\x01"]}, "no tokens"),
        ({"image_b64": IMG, "texts": ["a"], "extra": 1}, "unknown xmodal input keys"),
        ({"image_b64": "abc$", "texts": ["a"]}, "not valid base64"),
    ],
)
def test_prepare_rejects_malformed_inputs(adapter: XModalAdapter, inputs: Any, match: str) -> None:
    with pytest.raises(InvalidInput, match=match) as info:
        adapter.prepare(inputs)
    assert info.value.code == "INVALID_INPUT"


def test_bad_images_and_long_texts_keep_their_codes(adapter: XModalAdapter) -> None:
    with pytest.raises(ImageDecodeError):
        adapter.prepare(
            {"image_b64": b64(DATA / "images" / "bad" / "pillow_broken.png"), "text": "a"}
        )
    prepared = adapter.prepare(
        {"image_b64": b64(DATA / "images" / "bad" / "pillow_truncated_jpeg.jpg"), "text": "a"}
    )
    with pytest.raises(ImageDecodeError):
        adapter.preprocess(prepared)
    with pytest.raises(PayloadTooLarge):
        adapter.prepare({"image_b64": IMG, "text": "x" * 20_001})


def test_run_batch_edge_cases_and_describe(
    adapter: XModalAdapter, settings: Settings, runtime: DeviceRuntime
) -> None:
    assert adapter.run_batch([]) == []
    with pytest.raises(ModelError, match="XModalSample"):
        adapter.run_batch([np.zeros((3, 224, 224), np.float32)])
    unloaded = XModalAdapter(settings.models[MODEL], settings, runtime)
    with pytest.raises(ModelError, match="before load"):
        sample = XModalSample(np.zeros((3, 224, 224), np.float32), [[101, 7592, 102]], [False])
        unloaded.run_batch([sample])
    d = adapter.describe()
    assert d["modality"] == "xmodal" and d["semantic"] is False and d["dim"] == 512
    assert "random(seed=0)" in d["weights"]
    json.dumps(d)
    with pytest.raises(ValueError, match="text_pooling"):
        XModalAdapter(with_model(settings, text_pooling="max"), settings, runtime)


def test_example_inputs_run_end_to_end(adapter: XModalAdapter) -> None:
    inputs = adapter.example_inputs(3, adapter.buckets()[0])
    assert [len(i["texts"]) for i in inputs] == [2, 3, 4]
    assert [r["texts"] for r in run(adapter, *inputs)] == [2, 3, 4]
