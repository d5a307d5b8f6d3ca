"""Hugging Face folders served by real workers, with no code: each modality's model table
names a tiny random checkpoint (``tests/models/hf_tiny.py``) through ``FLEET_MODELS__*``
overrides, and requests go through ``FleetClient`` to a stack of this module's own (Redis +
the workers). Three image+text workers serve the three dual-encoder architectures (CLIP,
SigLIP, ViT+BERT), one consuming at a time. A folder no adapter serves, and one too big for
the worker's partition, make the worker refuse to start with the load error's code and
message. Every worker starts at once (about 35 s on 2 busy cores: seven processes importing
torch); the requests take a few seconds.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from producer.client import FleetClient, SubmitRequest, image_inputs, xmodal_inputs
from producer.stack.procs import StackError
from tests.conftest import ops_app
from tests.models.hf_tiny import ID2LABEL, build

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "data" / "images"
PHOTOS = ["skimage_chelsea.png", "skimage_coffee.png", "skimage_rocket.jpg", "pillow_hopper.jpg"]
TEXTS = [
    "a",
    "a cat",
    "the big red car sat on the mat",
    "a photo of a tabby cat on the mat at night",
]
CAPTIONS = ["a photo of a tabby cat", "a cup of coffee", "a rocket launch at night"]


def models_env(root: Path) -> dict[str, str]:
    """Model tables of tiny folders, and the modalities naming them."""
    env: dict[str, str] = {}
    tables = {
        "tiny-bert": {"KIND": "hf", "POOLING": "cls"},  # kind picked from config.json
        "tiny-vit": {"KIND": "hf-image", "TOP_K": "2"},
        "tiny-clip": {"KIND": "hf"},
        "tiny-siglip": {"KIND": "hf-xmodal"},
        "tiny-dual": {"KIND": "hf"},
        "tiny-gpt2": {"KIND": "hf"},
    }
    folders = {"tiny-bert": "bert", "tiny-vit": "vit-classifier", "tiny-clip": "clip",
               "tiny-siglip": "siglip", "tiny-dual": "dual", "tiny-gpt2": "gpt2"}  # fmt: skip
    for name, keys in tables.items():
        env[f"FLEET_MODELS__{name.upper()}__CHECKPOINT"] = str(build(root, folders[name]))
        for k, v in keys.items():
            env[f"FLEET_MODELS__{name.upper()}__{k}"] = v
    env["FLEET_MODALITIES__TEXT__MODEL"] = "tiny-bert"
    env["FLEET_MODALITIES__IMAGE__MODEL"] = "tiny-vit"
    env["FLEET_MODALITIES__XMODAL__MODEL"] = "tiny-clip"
    for m in ("TEXT", "IMAGE", "XMODAL"):  # short warmups; batches still form
        env[f"FLEET_MODALITIES__{m}__BATCHING__MAX_BATCH_SIZE"] = "4"
    return env


XMODAL = {0: "tiny-clip", 1: "tiny-siglip", 2: "tiny-dual"}  # xmodal worker instance -> model
REFUSED = {
    # A GPT-2 folder named by the text modality: no adapter serves it.
    "text": {"FLEET_MODALITIES__TEXT__MODEL": "tiny-gpt2"},
    # The image worker's partition: a millionth of the host's memory, kilobytes.
    "image": {"FLEET_MODALITIES__IMAGE__DEVICE__MEMORY_FRACTION": "0.000001"},
}


@dataclass
class Fleet:
    stack: Any
    client: FleetClient
    refusals: dict[str, str]  # modality -> the StackError of its worker that refused to start

    def node(self, modality: str, instance: int) -> str:
        name = f"{modality}-{instance}" if instance else modality
        return f"{name}@{socket.gethostname()}"

    def serve_xmodal_with(self, instance: int) -> None:
        """Only xmodal worker ``instance`` consumes the queue from now on."""
        control = ops_app(self.client.settings).control
        others = [self.node("xmodal", i) for i in XMODAL if i != instance]
        control.cancel_consumer("xmodal", reply=True, destination=others)
        control.add_consumer("xmodal", reply=True, destination=[self.node("xmodal", instance)])
        time.sleep(1.2)  # a BRPOP issued before the cancel times out after 1 s


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Redis, a text, an image and three xmodal workers (CLIP, SigLIP, dual encoder: one
    consuming at a time), and two workers that refuse to start; all started at once."""
    from producer.stack.local import Stack, isolated_environment

    root = tmp_path_factory.mktemp("hf-folders")
    shm_root = Path(f"/dev/shm/mmfleet-it-{os.getuid()}-{secrets.token_hex(4)}")
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_TRANSPORT__SHM_ROOT": str(shm_root),
        **models_env(root),
    }
    with isolated_environment(tmp_path_factory.mktemp("hf-run"), overrides) as settings:
        st = Stack(settings)
        st.up([], flower=False, gateway=False)  # Redis
        try:
            with ThreadPoolExecutor(7) as pool:  # every worker loads at the same time
                serving = [pool.submit(st.start_worker, m) for m in ("text", "image")]
                serving += [
                    pool.submit(st.start_worker, "xmodal", "batch", i,
                                {"FLEET_MODALITIES__XMODAL__MODEL": model})
                    for i, model in XMODAL.items()
                ]  # fmt: skip
                refusing = {
                    m: pool.submit(st.start_worker, m, "batch", 1, env)
                    for m, env in REFUSED.items()
                }
                for f in serving:
                    f.result()
                refusals = {}
                for m, f in refusing.items():
                    with pytest.raises(StackError) as err:
                        f.result()
                    refusals[m] = str(err.value)
            fleet = Fleet(st, FleetClient(settings), refusals)
            fleet.serve_xmodal_with(0)
            yield fleet
            fleet.client.close()
        finally:
            st.down()
            shutil.rmtree(shm_root, ignore_errors=True)


def test_text_from_a_bert_folder(fleet: Fleet) -> None:
    client = fleet.client
    burst = client.submit_many([SubmitRequest("text", {"text": t}) for t in TEXTS])
    results = [h.get(30) for h in burst]
    for text, r in zip(TEXTS, results, strict=True):
        assert r["model"] == "tiny-bert" and r["dim"] == 32 and len(r["embedding"]) == 32
        assert float(np.linalg.norm(r["embedding"])) == pytest.approx(1.0, abs=1e-5)
        alone = client.submit("text", {"text": text}).get(30)  # in a batch of its own
        np.testing.assert_allclose(r["embedding"], alone["embedding"], atol=1e-5)
    assert [r["tokens"] for r in results] == [3, 4, 10, 13]


def test_image_labels_from_id2label(fleet: Fleet) -> None:
    client = fleet.client
    reqs = [SubmitRequest("image", image_inputs(IMAGES / p)) for p in PHOTOS]
    results = [h.get(30) for h in client.submit_many(reqs)]
    for p, r in zip(PHOTOS, results, strict=True):
        assert r["model"] == "tiny-vit" and r["dim"] == 32
        assert len(r["labels"]) == 2  # the table's top_k
        for lb in r["labels"]:
            assert lb["label"] == ID2LABEL[lb["index"]]
        assert r["labels"][0]["probability"] >= r["labels"][1]["probability"]
        alone = client.submit("image", {**image_inputs(IMAGES / p), "top_k": 3}).get(30)
        np.testing.assert_allclose(r["embedding"], alone["embedding"], atol=1e-5)
        assert sum(lb["probability"] for lb in alone["labels"]) == pytest.approx(1.0, abs=1e-5)
        assert [lb["index"] for lb in alone["labels"][:2]] == [lb["index"] for lb in r["labels"]]


def xmodal_round(client: FleetClient, model: str) -> None:
    """A burst of image+text requests of mixed sizes; scores in the order of the texts."""
    reqs = [
        SubmitRequest("xmodal", xmodal_inputs(IMAGES / PHOTOS[0], CAPTIONS)),
        SubmitRequest("xmodal", xmodal_inputs(IMAGES / PHOTOS[0], CAPTIONS[::-1])),
        SubmitRequest("xmodal", xmodal_inputs(IMAGES / PHOTOS[0], CAPTIONS[:1])),
        SubmitRequest("xmodal", xmodal_inputs(IMAGES / PHOTOS[2], CAPTIONS[1:])),
        SubmitRequest("xmodal", xmodal_inputs(IMAGES / PHOTOS[3], CAPTIONS[2])),
    ]
    fwd, rev, one, two, three = [h.get(30) for h in client.submit_many(reqs)]
    for r, n in ((fwd, 3), (rev, 3), (one, 1), (two, 2), (three, 1)):
        assert r["model"] == model and r["texts"] == n == len(r["scores"]) == len(r["probs"])
        emb = np.asarray(r["text_embeddings"])
        assert emb.shape == (n, r["dim"]) and len(r["image_embedding"]) == r["dim"]
        np.testing.assert_allclose(emb @ np.asarray(r["image_embedding"]), r["scores"], atol=1e-5)
    np.testing.assert_allclose(fwd["scores"], rev["scores"][::-1], atol=1e-5)
    np.testing.assert_allclose(fwd["image_embedding"], rev["image_embedding"], atol=1e-5)
    np.testing.assert_allclose(one["scores"], fwd["scores"][:1], atol=1e-5)


def test_image_text_from_clip_siglip_and_dual_encoder_folders(fleet: Fleet) -> None:
    for instance, model in XMODAL.items():
        fleet.serve_xmodal_with(instance)
        xmodal_round(fleet.client, model)


def test_unsupported_and_too_big_folders_refuse_to_start(fleet: Fleet) -> None:
    errors, st = fleet.refusals, fleet.stack
    assert "engine failed to start: [MODEL_UNSUPPORTED] model 'tiny-gpt2'" in errors["text"]
    assert "model_type 'gpt2', GPT2Model: no adapter serves it; supported:" in errors["text"]
    assert (
        "engine failed to start: [MODEL_TOO_LARGE] model 'tiny-vit': its weights need"
        in (errors["image"])
    )
    assert "above the worker's memory partition of" in errors["image"]
    assert not st.alive(st.worker_name("text", 1)) and not st.alive(st.worker_name("image", 1))
