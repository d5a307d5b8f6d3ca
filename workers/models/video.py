"""The video modality's adapter: sampled frames through the image model, per-frame + clip.

Request inputs (exactly one key):

- ``{"video_ref": <TensorRef wire dict>}``: the encoded video file as a 1-D ``uint8`` tensor
  in ``/dev/shm``, put there by the producer (``producer.client.video_inputs``). Preferred
  for anything above a few tens of KB: the message stays small (< 1 KB) whatever the file
  size. The worker maps the segment (zero-copy) and never writes or releases it: **the
  producer owns it** and releases it once the request's final result is in
  (``ResultHandle.get`` does); its TTL is the backstop.
- ``{"video_b64": "<base64 of the file>"}``: small files inline (``limits.max_inline_bytes``
  at most; keep it to a few tens of KB so the message stays under 64 KB).

Either may come with ``"top_k": int`` (0..1000; the model config's ``top_k``, 5, when
absent): how many of the clip's labels to return.

Containers: MP4/MOV, Matroska/WebM, AVI, MPEG-TS, with any codec FFmpeg (PyAV's bundled
build) decodes. Frames are sampled at ``sample_fps`` up to ``max_frames``, centre-cropped,
resized and normalised exactly as the image modality does, and embedded and classified by
the same model, EfficientNet-Lite0 with its real ImageNet weights (same weights file: a frame
embeds like the same picture sent to the image worker) in mini-batches of
``frame_batch_size``; the adapter reports progress
(frames embedded / frames sampled) as it goes, which the engine publishes as the task's
``PROGRESS`` state and a ``task-progress`` event (Flower shows ``state: PROGRESS`` and
``result: "done/total"``).

Result per request::

    {"clip_embedding": [dim floats, L2 norm 1],  # L2-normalized mean of the frame embeddings
     "dim": 1280, "model": "<models key>",
     "labels": [{"label": "volcano", "index": 980, "probability": 0.41}, ...],
                                                 # top_k of the mean of the frames' class
                                                 # probabilities, best first
     "frames": n,                                # frames sampled and embedded
     "frame_embeddings": {"kind": "shm" | "inline", ...},  # float32 [n, dim], unit rows
     "timestamps_s": [n floats],                 # seconds from the first frame
     "sample_fps": 2.0, "fps": 25.0 | null,      # sampling rate; the source's frame rate
     "duration_s": 13.0 | null,                  # declared by the header
     "decoded_until_s": 13.0,                    # end of the last decoded frame
     "width": 320, "height": 180, "codec": "h264", "container": "mov,mp4,...",
     "partial": false, "partial_reason": null,   # see below
     "capped": false}                            # max_frames reached before the end

``frame_embeddings`` is a :class:`~shared.transport.TensorRef` (a detached segment that
lives ``transport.default_ttl_s``; ``FleetClient.resolve`` / ``ResultHandle.get`` map it and
release it) or, up to ``output_inline_max_bytes`` or without a shared host, an inline
tensor object. Either way the stored result stays well under 64 KB.

Bad videos: a file that cannot be opened (not a video, a disallowed container, an MP4 cut
before its ``moov`` index) or from which no frame decodes fails with ``VIDEO_DECODE``; one
that decodes for a while and then stops (a decode error, or data ending well before the
declared duration) **succeeds with what decoded** and ``"partial": true`` plus a
``partial_reason``. Limits (``PAYLOAD_TOO_LARGE``): ``max_video_bytes``, ``max_streams``,
``max_video_pixels``, ``max_duration_s``; see :mod:`workers.models.videodecode`.

Model config keys (``[models.<name>]``, kind ``"video"``): those of the EfficientNet image
adapter (``checkpoint``, ``image_size``, ``pixel_mean``, ``pixel_std``, ``top_k``,
``jpeg_draft``, ``torchscript``, ``precision``) plus ``sample_fps`` (2.0), ``max_frames`` (64),
``frame_batch_size`` (8), ``decode_threads`` (1), ``max_video_bytes`` (256 MiB),
``max_streams`` (16), ``max_video_pixels`` (3840*2160), ``max_duration_s`` (3600),
``output_inline_max_bytes`` (16384).
"""

from __future__ import annotations

import base64
import io
import math
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shared.errors import InvalidInput, ModelError, PayloadTooLarge, VideoDecodeError
from shared.model_kinds import IMAGENET_CLASSES, VideoOptions
from shared.transport import TensorRef
from workers.models.base import Prepared
from workers.models.efficientnet import EfficientNetAdapter, encode_batch
from workers.models.imagenet import TOP_K_KEY, imagenet_classes, parse_top_k, top_labels
from workers.models.imaging import normalize_frames
from workers.models.tensors import TensorIO
from workers.models.videodecode import (
    SampledVideo,
    VideoInfo,
    VideoLimits,
    probe_video,
    sample_frames,
)

if TYPE_CHECKING:
    from shared.settings import Settings
    from workers.models.runtime import DeviceRuntime

B64_KEY = "video_b64"
REF_KEY = "video_ref"
_EXAMPLE_SIZE = (96, 64)  # width, height of the synthetic warmup video


@dataclass(frozen=True, slots=True)
class VideoPayload:
    """What ``prepare`` hands ``preprocess``: the encoded bytes (or a mapped view) + header."""

    data: Any  # bytes, or a read-only uint8 numpy view of a shm segment
    info: VideoInfo
    source: str  # "inline" | "shm"
    top_k: int  # labels of the clip to return


@dataclass(frozen=True, slots=True)
class VideoSample:
    """What ``preprocess`` hands ``run_batch``: the sampled frames and decode facts."""

    video: SampledVideo
    top_k: int


@lru_cache(maxsize=16)
def example_video(index: int = 0, seconds: float = 2.0, fps: int = 10) -> bytes:
    """A small synthetic MPEG-4 Part 2 video in an MP4 container (warmup; no files needed).

    A moving gradient, ``96x64`` pixels, ``seconds`` long at ``fps``; ``index`` shifts the
    pattern so examples differ. A few KB, encoded in milliseconds with PyAV's FFmpeg.
    """
    import av

    width, height = _EXAMPLE_SIZE
    n = max(1, round(seconds * fps))
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(n):
            rgb = np.stack(
                [
                    (x * 255.0 / (width - 1) + 8 * i) % 256,
                    (y * 255.0 / (height - 1) + 37 * index) % 256,
                    (x + y + 16 * i) % 256,
                ],
                axis=-1,
            ).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


class VideoAdapter(EfficientNetAdapter):
    """Video clips -> per-frame and clip embeddings and the clip's labels, with the image
    modality's model.

    Subclasses :class:`~workers.models.efficientnet.EfficientNetAdapter` for its model
    (``load``: EfficientNet-Lite0, packaged weights or a checkpoint, traced and cached) and
    replaces the per-request steps.

    Args:
        cfg: the ``[models.<name>]`` entry (see the module docstring for its keys).
        settings: fleet settings (``limits.max_inline_bytes``, ``[transport]``).
        runtime: the worker's :class:`~workers.models.runtime.DeviceRuntime`.

    Raises:
        ValueError: a config value of the wrong type or out of range.
    """

    modality = "video"
    reports_progress = True
    options_type = VideoOptions

    def __init__(self, cfg: VideoOptions, settings: Settings, runtime: DeviceRuntime) -> None:
        super().__init__(cfg, settings, runtime)
        self.sample_fps = cfg.sample_fps
        self.max_frames = cfg.max_frames
        self.frame_batch_size = cfg.frame_batch_size
        self.decode_threads = cfg.decode_threads
        self.limits = VideoLimits(
            max_bytes=cfg.max_video_bytes,
            max_streams=cfg.max_streams,
            max_pixels=cfg.max_video_pixels,
            max_duration_s=cfg.max_duration_s,
        )
        self.tensors = TensorIO(settings, cfg.output_inline_max_bytes)
        self.bucket = f"frames{self.image_size}"
        self.last_timing: dict[str, float] = {}

    # -- per request ----------------------------------------------------------------------
    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        """Validate the inputs, get the bytes (decode base64 or map the segment), read the header.

        Returns:
            ``Prepared(bucket="frames<size>", length=<frames expected>, nbytes=<frame
            staging bytes>, payload=VideoPayload)``.

        Raises:
            InvalidInput: not a dict, unknown keys, not exactly one of ``video_b64`` /
                ``video_ref``, bad base64, a ref that is not a 1-D uint8 tensor.
            TensorRefError: a malformed, unknown or expired ref.
            PayloadTooLarge: over a size limit (see the module docstring).
            VideoDecodeError: not a video in a supported container, or an unreadable header.
        """
        if not isinstance(inputs, dict):
            raise InvalidInput(f"video inputs must be an object, got {type(inputs).__name__}")
        unknown = sorted(str(k) for k in inputs if k not in (B64_KEY, REF_KEY, TOP_K_KEY))
        if unknown:
            raise InvalidInput(
                f"unknown video input keys {unknown}; expected {B64_KEY!r} or {REF_KEY!r}, "
                f"and {TOP_K_KEY!r}"
            )
        present = [k for k in (B64_KEY, REF_KEY) if k in inputs]
        if len(present) != 1:
            raise InvalidInput(
                f"video inputs need exactly one of {B64_KEY!r} (base64 of the file) or "
                f"{REF_KEY!r} (a shared-memory tensor ref)"
            )
        top_k = parse_top_k(inputs, self.top_k, IMAGENET_CLASSES)
        if present[0] == B64_KEY:
            data, source = self._inline_bytes(inputs[B64_KEY]), "inline"
        else:
            data, source = self._mapped_bytes(inputs[REF_KEY]), "shm"
        info = probe_video(data, self.limits)
        expected = self.max_frames
        if info.duration_s is not None:
            expected = max(1, min(self.max_frames, math.ceil(info.duration_s * self.sample_fps)))
        size = self.image_size
        # uint8 frames held until the batch runs, plus one float32 mini-batch of staging.
        nbytes = expected * size * size * 3 + self.frame_batch_size * 3 * size * size * 4
        return Prepared(self.bucket, expected, nbytes, VideoPayload(data, info, source, top_k))

    def _inline_bytes(self, b64: Any) -> bytes:
        if not isinstance(b64, str):
            raise InvalidInput(f"{B64_KEY!r} must be a base64 string, got {type(b64).__name__}")
        if not b64:
            raise InvalidInput(f"{B64_KEY!r} is empty")
        limit = self.settings.limits.max_inline_bytes  # max_video_bytes: probe_video checks
        if len(b64) > 4 * -(-limit // 3):
            raise PayloadTooLarge(
                f"{B64_KEY!r} is {len(b64):,} base64 characters, over the inline limit of "
                f"{limit:,} bytes; send large videos as {REF_KEY!r} (shared memory)"
            )
        try:
            return base64.b64decode(b64, validate=True)
        except ValueError as e:
            raise InvalidInput(f"{B64_KEY!r} is not valid base64: {e}") from e

    def _mapped_bytes(self, wire: Any) -> np.ndarray:
        ref = TensorRef.from_dict(wire)  # TensorRefError on anything malformed
        if ref.dtype != "uint8" or len(ref.shape) != 1:
            raise InvalidInput(
                f"{REF_KEY!r} must be a 1-D uint8 tensor of the file's bytes, got "
                f"{ref.dtype} {list(ref.shape)}"
            )
        if ref.nbytes > self.limits.max_bytes:
            raise PayloadTooLarge(
                f"video is {ref.nbytes:,} bytes, above the limit of {self.limits.max_bytes:,}"
            )
        if ref.nbytes == 0:
            raise VideoDecodeError("empty video data (0 bytes)")
        return self.tensors.read(ref)

    def preprocess(self, prepared: Prepared) -> VideoSample:
        """Decode and sample the frames of one prepared request (inference thread).

        Reports ``0/n`` progress once the ``n`` frames are sampled.

        Raises:
            VideoDecodeError: no frame decodes.
            PayloadTooLarge: a limit the header did not reveal.
        """
        payload = prepared.payload
        if not isinstance(payload, VideoPayload):
            raise ModelError(f"video preprocess got {type(payload).__name__}")
        video = sample_frames(
            payload.data,
            sample_fps=self.sample_fps,
            max_frames=self.max_frames,
            size=self.image_size,
            limits=self.limits,
            threads=self.decode_threads,
        )
        self.report_progress(0, 0, len(video.frames))
        return VideoSample(video, payload.top_k)

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        """Embed every sample's frames in mini-batches of ``frame_batch_size`` frames.

        Frames of all samples are packed together (a mini-batch may span two videos), so a
        batch of short clips fills the model as well as one long clip. After each
        mini-batch, each sample it touched reports ``(frames embedded, frames sampled)``.

        Returns:
            One result dict per sample (see the module docstring), in order.

        Raises:
            ModelError: called before :meth:`load`, or a sample that is not a VideoSample.
            ShmCapacityError: the output segments do not fit (none is left behind).
        """
        encoder = self._encoder()
        if not samples:
            return []
        for i, s in enumerate(samples):
            if not isinstance(s, VideoSample):
                raise ModelError(f"sample {i} is a {type(s).__name__}, expected a VideoSample")
        counts = [len(s.video.frames) for s in samples]
        owner = np.repeat(np.arange(len(samples)), counts)  # sample index of each frame
        frames = np.concatenate([s.video.frames for s in samples])
        emb = np.empty((len(frames), int(self.dim or 0)), dtype=np.float32)
        probs = np.empty((len(frames), IMAGENET_CLASSES), dtype=np.float32)
        done = [0] * len(samples)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for start in range(0, len(frames), self.frame_batch_size):
                stop = min(start + self.frame_batch_size, len(frames))
                # Through the runtime's staging arena; the .cpu() below waits for this
                # mini-batch, so the next stage() cannot overwrite a buffer still in use.
                (batch,) = self.runtime.stage(
                    [torch.from_numpy(normalize_frames(frames[start:stop], self.norm))]
                )
                emb[start:stop], probs[start:stop] = encode_batch(encoder, batch.to(self._dtype))
                for i in np.unique(owner[start:stop]).tolist():
                    done[i] += int(np.count_nonzero(owner[start:stop] == i))
                    self.report_progress(i, done[i], counts[i])
        self.last_timing = {"embed_s": time.perf_counter() - t0, "frames": float(len(frames))}
        bounds = np.cumsum(counts)[:-1]
        per_sample = np.split(emb, bounds)
        per_probs = np.split(probs, bounds)
        wires = self.tensors.pack_all(per_sample)
        return [
            self._result(s, e, p, w)
            for s, e, p, w in zip(samples, per_sample, per_probs, wires, strict=True)
        ]

    def _result(
        self, s: VideoSample, emb: np.ndarray, probs: np.ndarray, wire: dict[str, Any]
    ) -> dict[str, Any]:
        v = s.video
        clip = emb.mean(axis=0)
        clip = clip / max(float(np.linalg.norm(clip)), 1e-12)
        info = v.info
        return {
            "clip_embedding": clip.astype(np.float32).tolist(),
            "dim": int(emb.shape[1]),
            "labels": top_labels(probs.mean(axis=0), s.top_k, imagenet_classes()),
            "model": self.name,
            "frames": int(emb.shape[0]),
            "frame_embeddings": wire,
            "timestamps_s": v.timestamps_s,
            "sample_fps": self.sample_fps,
            "fps": info.fps,
            "duration_s": info.duration_s,
            "decoded_until_s": v.decoded_until_s,
            "width": info.width,
            "height": info.height,
            "codec": info.codec,
            "container": info.format,
            "partial": v.partial,
            "partial_reason": v.partial_reason,
            "capped": v.capped,
        }

    # -- warmup and facts -----------------------------------------------------------------
    def buckets(self) -> list[str]:
        """One bucket: every frame is resized to ``image_size``."""
        return [self.bucket]

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        """``batch_size`` distinct synthetic MP4 clips, inline, each long enough to fill one
        frame mini-batch at ``sample_fps`` (at most ``max_frames``).

        Raises:
            ValueError: ``bucket`` is not this adapter's bucket.
        """
        if bucket is not None and bucket != self.bucket:
            raise ValueError(f"unknown video bucket {bucket!r}; this adapter has {self.bucket!r}")
        frames = min(self.frame_batch_size, self.max_frames)
        seconds = max(frames / self.sample_fps, 0.2)
        return [
            {B64_KEY: base64.b64encode(example_video(i, round(seconds, 3))).decode("ascii")}
            for i in range(batch_size)
        ]

    def describe(self) -> dict[str, Any]:
        """The image model's facts plus the sampling settings."""
        out = super().describe()
        out.update(
            sample_fps=self.sample_fps,
            max_frames=self.max_frames,
            frame_batch_size=self.frame_batch_size,
            decode_threads=self.decode_threads,
        )
        return out
