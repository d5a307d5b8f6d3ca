"""The demo's semantic checks: every modality's answers fit the repo's real inputs.

- text: captions of one photo are closer to each other than to another photo's caption,
  and "a man playing a guitar" is closer to "someone playing an instrument" than to the
  stock market (all-MiniLM-L6-v2);
- image: the top-5 labels of each photo whose content is an ImageNet class hold one of
  the classes written here (EfficientNet-Lite0; what it gives on every repo photo is in
  docs/models.md, *EfficientNet-Lite0*);
- image+text: each photo with captions is scored against all the captions of
  ``data/captions`` (the xmodal default, ConSE): the photos whose content is an ImageNet
  concept rank one of their own captions first, and over all photos an own caption beats
  another photo's caption in at least ``XMODAL_MIN_WIN`` of the pairs (chance 0.5;
  docs/models.md, *ConSE*);
- video: each repo clip's top-5 labels (the top-k of the mean of its frames' class
  probabilities) hold one of the classes written here: the NASA clip (a worker lit by a
  spotlight in a dark clean room) gets stage lighting, the synthetic test patterns get
  screen-like classes (docs/models.md, *Video labels*).

Each check returns ``{"passed": bool, "rows": [...]}``; :func:`all_checks` combines them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

DATA = Path(__file__).resolve().parents[3] / "data"

TEXT_EXTRA = (
    "A man is playing a guitar.",
    "Someone is playing an instrument.",
    "The stock market fell sharply today.",
)
CAT_CLASSES = ("tabby", "tiger cat", "Persian cat", "Siamese cat", "Egyptian cat")
# Photo -> classes one of which its top 5 must hold (its top 1 in docs/models.md's table).
IMAGE_EXPECT: dict[str, tuple[str, ...]] = {
    "skimage_coffee.png": ("espresso", "cup", "coffee mug"),
    "skimage_chelsea.png": CAT_CLASSES,
    "skimage_rocket.jpg": ("missile", "projectile", "space shuttle"),
    "skimage_camera.png": ("tripod", "reflex camera", "Polaroid camera"),
    "pillow_pil123rgba.png": ("toucan",),
    "detectron_34501842524_3c858b3080_k.jpg": ("street sign",),
    "detectron_16004479832_a748d55f21_k.jpg": ("golden retriever", "Labrador retriever"),
}
# Photos whose content is an ImageNet concept: their own caption must rank first.
XMODAL_RANK1 = (
    "skimage_coffee.png",
    "skimage_chelsea.png",
    "skimage_rocket.jpg",
    "skimage_camera.png",
)
XMODAL_MIN_WIN = 0.85  # measured 0.895 on the repo's 8 photos x 14 captions
VIDEO_EXPECT: dict[str, tuple[str, ...]] = {
    "torchcodec_nasa_13013.mp4": ("spotlight", "stage"),
    "torchcodec_av1_video.mkv": ("web site", "screen", "monitor", "binder"),
    "torchcodec_h264_10bits.mp4": ("web site", "screen", "monitor", "binder"),
}


def caption_groups() -> list[list[str]]:
    """Captions of one image per group (from data/captions), groups of >= 2 captions."""
    coco = json.loads((DATA / "captions" / "captions_coco.json").read_text())
    by_image: dict[int, list[str]] = defaultdict(list)
    for a in coco["annotations"]:
        by_image[a["image_id"]].append(a["caption"])
    return [caps for caps in by_image.values() if len(caps) >= 2]


def captioned_images() -> tuple[list[str], list[tuple[str, str]]]:
    """``(every caption in file order, [(image file name, its caption), ...])``: the texts an
    xmodal request scores, and which image each belongs to."""
    coco = json.loads((DATA / "captions" / "captions_coco.json").read_text())
    names = {im["id"]: Path(im["file_name"]).name for im in coco["images"]}
    pairs = [(names[a["image_id"]], a["caption"]) for a in coco["annotations"]]
    return [c for _, c in pairs], pairs


def text_texts() -> list[str]:
    """The texts :func:`text_check` needs embeddings of."""
    return [c for g in caption_groups() for c in g] + list(TEXT_EXTRA)


def text_check(embeddings: dict[str, list[float]]) -> dict[str, Any]:
    """Related pairs (captions of one image) must be closer than unrelated ones."""

    def cos(a: str, b: str) -> float:
        return float(np.dot(embeddings[a], embeddings[b]))

    groups = caption_groups()
    triples = [(g[0], g[1], groups[(i + 1) % len(groups)][0]) for i, g in enumerate(groups)] + [
        TEXT_EXTRA
    ]
    rows = [
        {
            "anchor": a,
            "related": r,
            "unrelated": u,
            "cos_related": cos(a, r),
            "cos_unrelated": cos(a, u),
        }
        for a, r, u in triples
    ]
    return {"passed": all(r["cos_related"] > r["cos_unrelated"] for r in rows), "rows": rows}


def _labels_check(labels: dict[str, list[str]], expect: dict[str, tuple[str, ...]]) -> dict:
    rows = []
    for name, want in expect.items():
        got = labels.get(name)
        ok = got is not None and bool(set(got[:5]) & set(want))
        rows.append({"input": name, "top5": got, "expected_one_of": list(want), "passed": ok})
    return {"passed": all(r["passed"] for r in rows), "rows": rows}


def image_check(labels: dict[str, list[str]]) -> dict[str, Any]:
    """``labels``: photo file name -> its top labels, best first."""
    return _labels_check(labels, IMAGE_EXPECT)


def video_check(labels: dict[str, list[str]]) -> dict[str, Any]:
    """``labels``: clip file name -> its top labels, best first."""
    return _labels_check(labels, VIDEO_EXPECT)


def xmodal_check(scores: dict[str, list[float]]) -> dict[str, Any]:
    """``scores``: photo file name -> its scores against every caption, in
    :func:`captioned_images` order."""
    _, pairs = captioned_images()
    owners = np.asarray([name for name, _ in pairs])
    rows, wins = [], []
    for name in dict.fromkeys(owners.tolist()):
        s = scores.get(name)
        if s is None:
            rows.append({"image": name, "passed": False, "reason": "no result"})
            continue
        s_arr = np.asarray(s, dtype=np.float64)
        own, other = s_arr[owners == name], s_arr[owners != name]
        win = [float((o > other).mean()) for o in own]
        wins += win
        best = int(np.argmax(s_arr))
        first = bool(owners[best] == name)
        rows.append(
            {
                "image": name,
                "best_caption": pairs[best][1],
                "own_caption_first": first,
                "win_rate": float(np.mean(win)),
                "passed": first or name not in XMODAL_RANK1,
            }
        )
    mean_win = float(np.mean(wins)) if wins else 0.0
    passed = all(r["passed"] for r in rows) and mean_win >= XMODAL_MIN_WIN
    rank1 = sum(bool(r.get("own_caption_first")) for r in rows)
    return {
        "passed": passed,
        "rank1": f"{rank1}/{len(rows)}",
        "mean_win_rate": mean_win,
        "min_win_rate": XMODAL_MIN_WIN,
        "rows": rows,
    }


def all_checks(
    text: dict[str, Any], image: dict[str, Any], xmodal: dict[str, Any], video: dict[str, Any]
) -> dict[str, Any]:
    """The four checks under one ``passed``."""
    checks = {"text": text, "image": image, "xmodal": xmodal, "video": video}
    return {"passed": all(c["passed"] for c in checks.values()), **checks}
