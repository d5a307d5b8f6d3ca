"""Video decoding for the video modality: encoded bytes -> sampled, square RGB frames.

Pure CPU work with PyAV (FFmpeg) and Pillow, no torch, so it runs per request on the
inference thread (``ModelAdapter.preprocess``) and is cheap to test.

The bytes are read in place: :class:`MemoryReader` hands FFmpeg successive slices of a
buffer (``bytes``, a ``memoryview`` or a read-only numpy view of a shared-memory segment),
so a video that came through ``/dev/shm`` is never copied whole into the worker's heap.

Hostile input is expected:

- only the demuxers in :data:`ALLOWED_DEMUXERS` may open the data (FFmpeg's
  ``format_whitelist``), so an image, a playlist (HLS/concat, which can name other files or
  URLs) or an exotic container is refused before any demuxer parses it;
- the header is checked against :class:`VideoLimits` (bytes, streams, pixels, duration)
  before a frame is decoded;
- every PyAV/FFmpeg failure becomes :class:`shared.errors.VideoDecodeError` (``VIDEO_DECODE``)
  or :class:`shared.errors.PayloadTooLarge` with a stable code.

Truncated and corrupt files (the documented contract):

- a file whose header cannot be read (an MP4 cut before its ``moov`` atom, random bytes) ->
  ``VIDEO_DECODE`` at once;
- a file that opens but from which no frame decodes -> ``VIDEO_DECODE``;
- a file that opens and decodes for a while, then hits a decode error or ends well before
  the length its header declares -> the frames decoded so far, with ``partial=True`` and
  a ``partial_reason``. "Well before" means more than ``max(0.5 s, 2 frame intervals)``
  short of the declared length: the video stream's duration (the container's when the
  stream has none), or for an AVI its declared frame count over its frame rate when that is
  longer (an AVI cut in half declares its full frame count, while FFmpeg shortens its duration
  to the data present); a file whose header declares neither can only be flagged by a decode
  error.

Frame sampling: frames are taken at ``sample_fps`` on the video's own clock (the first
decoded frame is t = 0; each target time takes the first frame at or after it), up to
``max_frames``; decoding stops as soon as ``max_frames`` are taken (``capped=True`` when
the video continues past them). The first video stream is used; other streams are ignored.
Display rotation metadata (phone videos) is not applied.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from shared.errors import FleetError, PayloadTooLarge, VideoDecodeError

ALLOWED_DEMUXERS: tuple[str, ...] = (
    *("mov", "mp4", "m4a", "3gp", "3g2", "mj2"),
    *("matroska", "webm"),
    "avi",
    "mpegts",
)
"""FFmpeg demuxer names allowed to open a video (MP4/MOV family, Matroska/WebM, AVI,
MPEG-TS). Passed as FFmpeg's ``format_whitelist``: nothing else is even probed."""

_MAX_DETAIL = 200
_AVIO_BUFFER = 64 * 1024  # bytes FFmpeg asks for per read


@dataclass(frozen=True, slots=True)
class VideoLimits:
    """Resource limits checked from the header, before any frame is decoded.

    Attributes:
        max_bytes: largest encoded file, in bytes.
        max_streams: most streams (video + audio + subtitles + data) in the container.
        max_pixels: largest ``width * height`` of the video stream.
        max_duration_s: longest declared duration, in seconds.
        max_decoded_frames: decoding stops after this many frames whatever the header says
            (a guard against a lying header; the result is then ``capped``).
    """

    max_bytes: int = 256 * 1024 * 1024
    max_streams: int = 16
    max_pixels: int = 3840 * 2160
    max_duration_s: float = 3600.0
    max_decoded_frames: int = 200_000


@dataclass(frozen=True, slots=True)
class VideoInfo:
    """What a video's header says (read without decoding a frame).

    Attributes:
        format: FFmpeg demuxer name (e.g. ``"mov,mp4,m4a,3gp,3g2,mj2"``).
        codec: video codec name (``"h264"``, ``"libdav1d"``, ...).
        width: pixels.
        height: pixels.
        fps: average frame rate, or None when the header gives none.
        duration_s: declared duration of the video stream (else of the container), or None.
        streams: number of streams in the container.
        stream_index: index of the video stream used (the first one).
        nbytes: encoded size in bytes.
        declared_frames: an AVI video stream's frame count as its header states it
            (``dwLength``), else None. FFmpeg's AVI demuxer recomputes the stream's duration
            from the data actually present, so for a truncated AVI this count is the only
            trace of the length the file should have. Other containers' counts are not used:
            an MP4's sample count includes pre-roll that its edit list skips.
    """

    format: str
    codec: str
    width: int
    height: int
    fps: float | None
    duration_s: float | None
    streams: int
    stream_index: int
    nbytes: int
    declared_frames: int | None = None

    @property
    def declared_s(self) -> float | None:
        """The longest length the header declares, in seconds: ``duration_s`` or
        ``declared_frames / fps``, whichever is longer (None when it declares neither)."""
        by_frames = self.declared_frames / self.fps if self.declared_frames and self.fps else None
        known = [d for d in (self.duration_s, by_frames) if d is not None]
        return max(known) if known else None


@dataclass(slots=True)
class SampledVideo:
    """Frames sampled from one video, ready for the image model.

    Attributes:
        frames: uint8 array ``(n, size, size, 3)``, RGB, centre-cropped and resized.
        timestamps_s: time of each sampled frame, seconds from the first decoded frame.
        info: the header facts.
        decoded_frames: frames decoded (sampled or not).
        decoded_until_s: end of the last decoded frame, seconds from the first.
        partial: decoding stopped early on a decode error or a premature end of data.
        partial_reason: why, when ``partial``.
        capped: sampling stopped at ``max_frames`` (or the decoded-frame guard) before the
            end of the video.
        decode_s: wall time spent opening and decoding, seconds.
    """

    frames: np.ndarray
    timestamps_s: list[float]
    info: VideoInfo
    decoded_frames: int
    decoded_until_s: float
    partial: bool = False
    partial_reason: str | None = None
    capped: bool = False
    decode_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class MemoryReader(io.RawIOBase):
    """A seekable, read-only file over an in-memory buffer, without copying it whole.

    Args:
        buffer: anything exposing the buffer protocol as contiguous bytes (``bytes``,
            ``memoryview``, a 1-D uint8 numpy array, including a read-only shared-memory view).

    Each ``read(n)`` returns a new ``bytes`` of at most ``n`` bytes (PyAV copies it into
    FFmpeg's I/O buffer), so at most one read-sized chunk is copied at a time.
    """

    def __init__(self, buffer: Any) -> None:
        super().__init__()
        self._mv = memoryview(buffer).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = len(self._mv) + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise OSError("negative seek position")
        self._pos = pos
        return pos

    def read(self, size: int = -1) -> bytes:
        end = len(self._mv) if size is None or size < 0 else min(len(self._mv), self._pos + size)
        if self._pos >= end:
            return b""
        chunk = self._mv[self._pos : end].tobytes()
        self._pos = end
        return chunk

    def readinto(self, b: Any) -> int:  # pragma: no cover - PyAV uses read()
        chunk = self.read(len(b))
        b[: len(chunk)] = chunk
        return len(chunk)


def _detail(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= _MAX_DETAIL else text[:_MAX_DETAIL] + "..."


def _nbytes(data: Any) -> int:
    return memoryview(data).nbytes


def _open(data: Any, limits: VideoLimits, threads: int = 1) -> tuple[Any, Any, VideoInfo]:
    """Open the container, pick its first video stream and check the limits.

    Returns:
        ``(container, stream, info)``; the caller closes the container.

    Raises:
        VideoDecodeError: empty data, not an allowed container, unreadable header, no
            video stream, or a stream without dimensions.
        PayloadTooLarge: bytes, streams, pixels or duration over ``limits``.
    """
    import av  # lazily: only video workers load FFmpeg

    size = _nbytes(data)
    if size == 0:
        raise VideoDecodeError("empty video data (0 bytes)")
    if size > limits.max_bytes:
        raise PayloadTooLarge(f"video is {size:,} bytes, above the limit of {limits.max_bytes:,}")
    try:
        container = av.open(
            MemoryReader(data),
            mode="r",
            options={"format_whitelist": ",".join(ALLOWED_DEMUXERS)},
            buffer_size=_AVIO_BUFFER,
        )
    except Exception as e:  # av.FFmpegError subclasses, ValueError, OSError...
        raise VideoDecodeError(
            f"cannot open video ({size:,} bytes starting {bytes(memoryview(data)[:8]).hex()}; "
            f"supported containers: MP4/MOV, Matroska/WebM, AVI, MPEG-TS): {_detail(e)}"
        ) from None
    try:
        info, stream = _check(container, size, limits)
        stream.thread_type = "AUTO" if threads > 1 else "SLICE"
        stream.codec_context.thread_count = max(1, threads)
    except BaseException:
        container.close()
        raise
    return container, stream, info


def _check(container: Any, size: int, limits: VideoLimits) -> tuple[VideoInfo, Any]:
    fmt = str(container.format.name)
    n_streams = len(container.streams)
    if n_streams > limits.max_streams:
        raise PayloadTooLarge(
            f"video container has {n_streams} streams, above the limit of {limits.max_streams}"
        )
    videos = container.streams.video
    if not videos:
        kinds = sorted({s.type for s in container.streams})
        raise VideoDecodeError(f"no video stream in the {fmt} container (streams: {kinds})")
    stream = videos[0]
    ctx = stream.codec_context
    width, height = int(ctx.width or 0), int(ctx.height or 0)
    if width <= 0 or height <= 0:
        raise VideoDecodeError(f"video stream has no valid size ({width}x{height})")
    if width * height > limits.max_pixels:
        raise PayloadTooLarge(
            f"video is {width}x{height} = {width * height:,} pixels per frame, above the "
            f"limit of {limits.max_pixels:,}"
        )
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else None
    if fps is not None and not (math.isfinite(fps) and fps > 0):
        fps = None
    duration = None
    if stream.duration is not None and stream.time_base is not None:
        duration = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        duration = container.duration / 1_000_000.0  # AV_TIME_BASE
    if duration is not None and not (math.isfinite(duration) and duration >= 0):
        duration = None
    if duration is not None and duration > limits.max_duration_s:
        raise PayloadTooLarge(
            f"video lasts {duration:.1f} s, above the limit of {limits.max_duration_s:g} s"
        )
    codec = str(ctx.name or "?")
    frames = int(stream.frames or 0) if fmt == "avi" else 0
    info = VideoInfo(
        fmt, codec, width, height, fps, duration, n_streams, stream.index, size,
        declared_frames=frames if frames > 0 else None,
    )  # fmt: skip
    return info, stream


def probe_video(data: Any, limits: VideoLimits) -> VideoInfo:
    """Open a video and read its header only (no frame is decoded; about a millisecond).

    Catches empty data, non-videos, disallowed containers, files cut before their index
    (an MP4 without ``moov``), missing video streams and every :class:`VideoLimits` excess.
    A file whose header is fine but whose data is cut or corrupt passes here; see
    :func:`sample_frames`.

    Raises:
        VideoDecodeError: see above.
        PayloadTooLarge: over a limit.
    """
    container, _stream, info = _open(data, limits)
    container.close()
    return info


def square_rgb(img: Image.Image, size: int) -> np.ndarray:
    """Centre square of an RGB picture resized to ``size`` (bicubic, antialiased).

    The same single resize-of-the-centre-box that :func:`workers.models.imaging.decode_image`
    does, so a frame matches the image path.

    Returns:
        uint8 array ``(size, size, 3)``.
    """
    if img.mode != "RGB":
        img = img.convert("RGB")
    w, h = img.size
    side = min(w, h)
    box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
    return np.asarray(img.resize((size, size), Image.Resampling.BICUBIC, box=box), dtype=np.uint8)


def sample_frames(
    data: Any,
    *,
    sample_fps: float,
    max_frames: int,
    size: int,
    limits: VideoLimits,
    threads: int = 1,
    on_frame: Callable[[int], None] | None = None,
) -> SampledVideo:
    """Decode a video and sample square RGB frames at ``sample_fps`` (see the module doc).

    Args:
        data: the encoded file (bytes-like; read in place).
        sample_fps: frames taken per second of video (> 0).
        max_frames: most frames taken (>= 1); decoding stops when reached.
        size: output side in pixels.
        limits: resource limits (checked from the header first).
        threads: FFmpeg decoding threads.
        on_frame: called with the number of frames taken so far after each one.

    Returns:
        The sampled frames and the facts about how decoding went.

    Raises:
        VideoDecodeError: the header cannot be read, or no frame decodes.
        PayloadTooLarge: a :class:`VideoLimits` excess.
    """
    import time

    if not (sample_fps > 0 and math.isfinite(sample_fps)):
        raise ValueError(f"sample_fps must be positive, got {sample_fps}")
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    t_start = time.perf_counter()
    container, stream, info = _open(data, limits, threads)
    walk = _Walk(step=1.0 / sample_fps, frame_dt=1.0 / info.fps if info.fps else 0.0)
    try:
        _decode_sampled(container.decode(stream), walk, info, size, max_frames, limits, on_frame)
    finally:
        container.close()
    decode_s = time.perf_counter() - t_start
    if not walk.taken:
        why = f" ({walk.error})" if walk.error else " (the stream ended before its first frame)"
        raise VideoDecodeError(
            f"no frame could be decoded from the {info.codec} video in {info.format}{why}"
        )
    end = walk.last_rel + walk.frame_dt
    partial, reason = _partial(info, end, walk)
    return SampledVideo(
        frames=np.stack(walk.taken),
        timestamps_s=walk.stamps,
        info=info,
        decoded_frames=walk.decoded,
        decoded_until_s=round(end, 6),
        partial=partial,
        partial_reason=reason,
        capped=walk.capped,
        decode_s=decode_s,
    )


@dataclass(slots=True)
class _Walk:
    """Where the decoding of one video stands: the sampling step and the frame period (s),
    frames taken and their times (s from the first frame), how it stopped."""

    step: float
    frame_dt: float
    taken: list[np.ndarray] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)
    decoded: int = 0
    t0: float | None = None
    last_rel: float = 0.0
    next_t: float = 0.0
    error: str | None = None
    capped: bool = False


def _decode_sampled(
    frames: Any,
    w: _Walk,
    info: VideoInfo,
    size: int,
    max_frames: int,
    limits: VideoLimits,
    on_frame: Callable[[int], None] | None,
) -> None:
    """Decode ``frames`` into ``w`` until the stream ends, a frame fails, ``max_frames`` are
    taken or ``limits.max_decoded_frames`` are decoded.

    Raises:
        FleetError: as raised by the decoder (a limit); other decoder errors end the walk.
    """
    while True:
        try:
            frame = next(frames)
        except StopIteration:
            break
        except FleetError:
            raise
        except Exception as e:  # av.FFmpegError (InvalidDataError...), EOFError, ...
            w.error = f"{type(e).__name__}: {_detail(e)}"
            break
        t = frame.time
        if t is None:  # no timestamps: count frames at the declared rate
            t = w.decoded * (w.frame_dt or w.step)
        w.decoded += 1
        if w.t0 is None:
            w.t0 = t
        rel = max(0.0, float(t) - w.t0)
        w.last_rel = max(w.last_rel, rel)
        if rel + 1e-6 >= w.next_t:
            if not _take(frame, rel, w, size, on_frame):
                break
            if len(w.taken) >= max_frames:
                # Unknown duration: we cannot tell, so say the rest was not looked at.
                w.capped = info.declared_s is None or _continues(info, rel + w.frame_dt, w.frame_dt)
                break
        if w.decoded >= limits.max_decoded_frames:
            w.capped = True
            break


def _take(
    frame: Any, rel: float, w: _Walk, size: int, on_frame: Callable[[int], None] | None
) -> bool:
    """Sample ``frame`` (at ``rel`` s) into ``w``; False (with ``w.error``) if it cannot be
    converted to RGB."""
    try:
        w.taken.append(square_rgb(frame.to_image(), size))
    except Exception as e:
        w.error = f"frame at {rel:.2f} s cannot be converted to RGB: {_detail(e)}"
        return False
    w.stamps.append(round(rel, 6))
    w.next_t += w.step
    while w.next_t <= rel:  # a gap in the video: no catching up with old targets
        w.next_t += w.step
    if on_frame is not None:
        on_frame(len(w.taken))
    return True


def _partial(info: VideoInfo, end: float, w: _Walk) -> tuple[bool, str | None]:
    """Whether the video was cut short before ``end`` s, and why (``None`` when it was not)."""
    if w.error is not None and not w.capped:
        return True, f"decoding stopped at {end:.2f} s: {w.error}"
    if not w.capped and _continues(info, end, w.frame_dt):
        return True, (
            f"the data ended at {end:.2f} s of the {info.declared_s:.2f} s the header declares "
            "(truncated file?)"
        )
    return False, None


def _continues(info: VideoInfo, end_s: float, frame_dt: float) -> bool:
    """Whether the declared length extends clearly past ``end_s``."""
    declared = info.declared_s
    if declared is None:
        return False
    return end_s + max(0.5, 2.0 * frame_dt) < declared
