"""Steady mixed traffic for a chaos scenario: texts at every priority, images, videos.

One thread submits every 50 ms what the rates call for. A submit that fails (the broker
is being restarted: that is the point) is retried on the next tick with the same request;
a request counts as sent once its publish returned.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from producer.client import FleetClient, ResultHandle, SubmitRequest, image_inputs

log = logging.getLogger("fleet.chaos")

DATA = Path(__file__).resolve().parents[3] / "data"
TICK_S = 0.05
PRIORITIES = (("bulk", 0.70), ("normal", 0.20), ("high", 0.05), ("realtime", 0.05))
IMAGES = ("pillow_hopper.jpg", "pillow_hopper_gray.jpg", "pillow_hopper_bw_500.png")
VIDEO = DATA / "videos" / "torchcodec_nasa_13013.mp4"  # 673 KB: its input goes through shm


class LoadSpec(BaseModel):
    """Steady traffic during every scenario (rates in requests per second; ``[load]`` of
    ``configs/chaos.toml``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    text_per_s: float = Field(default=12.0, ge=0.0)
    image_per_s: float = Field(default=1.0, ge=0.0)
    video_every_s: float = Field(default=4.0, gt=0.0)
    warmup_s: float = Field(default=3.0, ge=0.0)
    settle_timeout_s: float = Field(default=90.0, gt=0.0)


def texts() -> list[str]:
    lines = (DATA / "text" / "botchan_sentences.txt").read_text().splitlines()
    return [s.strip() for s in lines if 20 <= len(s.strip()) <= 200][:500]


class Load:
    """Submits ``spec``'s traffic until :meth:`stop`; ``handles`` maps id -> handle."""

    def __init__(self, client: FleetClient, spec: LoadSpec, with_video: bool, seed: int) -> None:
        self.client = client
        self.spec = spec
        self.with_video = with_video
        self.handles: dict[str, ResultHandle] = {}
        self.order: list[str] = []
        self.errors = 0
        self._rng = random.Random(seed)
        self._texts = texts()
        self._images = [DATA / "images" / n for n in IMAGES]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="chaos-load", daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def add(self, handles: list[ResultHandle]) -> None:
        with self._lock:
            for h in handles:
                self.handles[h.id] = h
                self.order.append(h.id)

    def video(self) -> ResultHandle:
        """Submit one video now (its input through /dev/shm)."""
        h = self.client.submit("video", self.client.video_inputs(VIDEO), "bulk")
        self.add([h])
        return h

    def _priority(self) -> str:
        x, acc = self._rng.random(), 0.0
        for name, share in PRIORITIES:
            acc += share
            if x < acc:
                return name
        return "bulk"

    def _due(self, elapsed: float) -> list[SubmitRequest]:
        want_text = int(elapsed * self.spec.text_per_s) - self._sent_text
        want_image = int(elapsed * self.spec.image_per_s) - self._sent_image
        reqs = [
            SubmitRequest("text", {"text": self._rng.choice(self._texts)}, self._priority())
            for _ in range(max(want_text, 0))
        ]
        reqs += [
            SubmitRequest("image", image_inputs(self._rng.choice(self._images)), "bulk")
            for _ in range(max(want_image, 0))
        ]
        return reqs

    def _run(self) -> None:
        self._sent_text = self._sent_image = 0
        t0 = next_video = time.monotonic()
        while not self._stop.wait(TICK_S):
            now = time.monotonic()
            reqs = self._due(now - t0)
            try:
                if reqs:
                    self.add(self.client.submit_many(reqs))
                    self._sent_text += sum(r.modality == "text" for r in reqs)
                    self._sent_image += sum(r.modality == "image" for r in reqs)
                if self.with_video and now >= next_video:
                    self.video()
                    next_video = now + self.spec.video_every_s
            except Exception as exc:  # the broker is down: retry next tick
                self.errors += 1
                log.debug("submit failed: %s", exc)
