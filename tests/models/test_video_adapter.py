"""VideoAdapter on the repo's real videos: decoding, sampling, bad files, shm in and out.

The model is the image modality's EfficientNet-Lite0 with its real ImageNet weights; most
tests reuse one loaded model and vary only the adapter's config, so the whole file runs in
seconds.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from shared.errors import (
    InvalidInput,
    ModelError,
    PayloadTooLarge,
    ShmCapacityError,
    TensorRefError,
    VideoDecodeError,
)
from shared.model_kinds import parse_model_options
from shared.settings import Settings, load_settings
from shared.transport import ShmStore, decode_inline
from workers.models import make_adapter
from workers.models.efficientnet import EfficientNetAdapter
from workers.models.imagenet import imagenet_classes
from workers.models.runtime import DeviceRuntime
from workers.models.video import VideoAdapter, VideoSample, example_video
from workers.models.videodecode import MemoryReader, VideoLimits, sample_frames

REPO = Path(__file__).resolve().parents[2]
VIDEOS = REPO / "data" / "videos"
NASA = VIDEOS / "torchcodec_nasa_13013.mp4"  # H.264 320x180 25 fps, 13 s, 6 streams
AV1 = VIDEOS / "torchcodec_av1_video.mkv"  # AV1 640x360 25 fps, 5 s
H264_10 = VIDEOS / "torchcodec_h264_10bits.mp4"  # H.264 High10 200x200 30 fps, 1 s
MODEL = "video-efficientnet-lite0"


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode("ascii")


def zeroed_middle(path: Path, n: int = 2000) -> bytes:
    """The file with ``n`` bytes zeroed at its middle: it opens, then a packet fails to decode."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(n)
    return bytes(data)


@pytest.fixture(scope="module")
def store(settings: Settings) -> ShmStore:
    return ShmStore(root=settings.transport.shm_root, role="producer")


@pytest.fixture(scope="module")
def adapter(settings: Settings, runtime: DeviceRuntime) -> VideoAdapter:
    a = make_adapter("video", settings, runtime)
    assert isinstance(a, VideoAdapter)
    a.load()
    return a


def variant(adapter: VideoAdapter, settings: Settings | None = None, **extra: Any) -> VideoAdapter:
    """Another config around the same loaded model (no second load)."""
    s = settings or adapter.settings
    cfg = parse_model_options({**s.models[MODEL].model_dump(), **extra})
    v = VideoAdapter(cfg, s, adapter.runtime)
    v._model, v.traced, v.dim = adapter._model, adapter.traced, adapter.dim
    return v


def run(adapter: VideoAdapter, *inputs: dict[str, Any]) -> list[dict[str, Any]]:
    samples = [adapter.preprocess(adapter.prepare(i)) for i in inputs]
    return adapter.run_batch(samples)


def run_released(
    adapter: VideoAdapter, store: ShmStore, *inputs: dict[str, Any]
) -> list[dict[str, Any]]:
    """:func:`run`, with every output segment released (for tests that read other fields)."""
    out = run(adapter, *inputs)
    for r in out:
        frame_embeddings(r, store)
    return out


def frame_embeddings(result: dict[str, Any], store: ShmStore) -> np.ndarray:
    wire = result["frame_embeddings"]
    if wire["kind"] == "inline":
        return decode_inline(wire)
    arr = np.array(store.get(wire))
    store.release(wire)
    return arr


@pytest.fixture(scope="module")
def nasa_via_shm(adapter: VideoAdapter, store: ShmStore) -> tuple[dict[str, Any], list[tuple]]:
    """The NASA clip sent as a shm ref, run once: (result, progress reports)."""
    ref = store.put(np.frombuffer(NASA.read_bytes(), np.uint8), detach=True)
    reports: list[tuple] = []
    adapter.progress_sink = lambda i, done, total: reports.append((i, done, total))
    try:
        out = run(adapter, {"video_ref": ref.to_dict()})[0]
    finally:
        adapter.progress_sink = None
        store.release(ref)
    return out, reports


# -- real videos --------------------------------------------------------------------------------
def test_nasa_clip_through_shm_gives_frames_and_clip(
    nasa_via_shm: tuple[dict[str, Any], list[tuple]], store: ShmStore
) -> None:
    out, _ = nasa_via_shm
    json.dumps(out)  # the result goes to a JSON result backend as it is
    assert len(json.dumps(out)) < 32_000  # small whatever the number of frames
    assert out["frames"] == 26  # 13.0 s at 2 fps
    # Each target time 0.5 * i takes the first frame at or after it (frames every 0.04 s).
    ts = np.asarray(out["timestamps_s"])
    assert ((ts >= np.arange(26) * 0.5 - 1e-6) & (ts < np.arange(26) * 0.5 + 0.04)).all()
    assert (out["width"], out["height"], out["codec"], out["fps"]) == (320, 180, "h264", 25.0)
    assert out["duration_s"] == pytest.approx(13.0)
    assert out["decoded_until_s"] == pytest.approx(13.0)
    assert (out["partial"], out["partial_reason"], out["capped"]) == (False, None, False)
    wire = out["frame_embeddings"]
    assert wire["kind"] == "shm" and wire["shape"] == [26, 1280] and wire["dtype"] == "float32"
    assert wire["owner"].startswith("worker:")
    emb = frame_embeddings(out, store)
    assert emb.shape == (26, 1280) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    clip = np.asarray(out["clip_embedding"], dtype=np.float32)
    assert clip.shape == (1280,) and abs(np.linalg.norm(clip) - 1.0) < 1e-5
    mean = emb.mean(axis=0)
    np.testing.assert_allclose(clip, mean / np.linalg.norm(mean), atol=1e-5)
    assert not store.ls()  # the output segment was released, the input too


def test_progress_goes_up_to_the_total(nasa_via_shm: tuple[dict[str, Any], list[tuple]]) -> None:
    _, reports = nasa_via_shm
    assert reports[0] == (0, 0, 26)  # frames sampled, none embedded yet
    done = [d for _, d, _ in reports]
    assert done == sorted(done) and done[-1] == 26
    assert [d for d in done if d] == [8, 16, 24, 26]  # one report per frame mini-batch
    assert {(i, t) for i, _, t in reports} == {(0, 26)}


@pytest.mark.parametrize(
    ("path", "frames", "codec", "size"),
    [(AV1, 10, "libdav1d", (640, 360)), (H264_10, 2, "h264", (200, 200))],
)
def test_other_codecs(
    adapter: VideoAdapter,
    store: ShmStore,
    path: Path,
    frames: int,
    codec: str,
    size: tuple[int, int],
) -> None:
    out = run(adapter, {"video_b64": b64(path)})[0]
    assert out["frames"] == frames and out["codec"] == codec
    assert (out["width"], out["height"]) == size
    assert out["partial"] is False
    emb = frame_embeddings(out, store)
    assert emb.shape == (frames, 1280) and np.isfinite(emb).all()


def test_small_output_is_inline(adapter: VideoAdapter) -> None:
    out = run(adapter, {"video_b64": b64(H264_10)})[0]
    wire = out["frame_embeddings"]
    assert wire["kind"] == "inline"  # 2 x 1280 float32 = 10 KiB <= output_inline_max_bytes
    assert decode_inline(wire).shape == (2, 1280)


def test_frame_embeds_like_the_same_picture_sent_as_an_image(
    adapter: VideoAdapter, settings: Settings, runtime: DeviceRuntime
) -> None:
    import av

    with av.open(str(AV1)) as c:
        first = next(c.decode(c.streams.video[0])).to_image()
    png = io.BytesIO()
    first.save(png, format="PNG")
    image = EfficientNetAdapter(settings.models["efficientnet-lite0"], settings, runtime)  # type: ignore[arg-type]
    image._model, image.traced = adapter._model, adapter.traced  # the same weights
    img = image.run_batch([image.preprocess(image.prepare(
        {"image_b64": base64.b64encode(png.getvalue()).decode("ascii")}
    ))])[0]  # fmt: skip
    one = variant(adapter, max_frames=1)
    vid = run(one, {"video_b64": b64(AV1)})[0]
    np.testing.assert_allclose(vid["clip_embedding"], img["embedding"], atol=1e-5)
    assert [lab["index"] for lab in vid["labels"]] == [lab["index"] for lab in img["labels"]]


def test_nasa_clip_labels_name_what_its_frames_show(
    nasa_via_shm: tuple[dict[str, Any], list[tuple]],
) -> None:
    """The JWST mirror under a spotlight in a dark hall: "spotlight" (818) or "stage" (819)
    among the clip's 5 labels, best first, names matching their indices."""
    out, _ = nasa_via_shm
    labels = out["labels"]
    assert len(labels) == 5 and {818, 819} & {lab["index"] for lab in labels}, labels
    probs = [lab["probability"] for lab in labels]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0 + 1e-6
    assert all(imagenet_classes()[lab["index"]] == lab["label"] for lab in labels)


def test_clip_labels_are_the_mean_of_the_frames_probabilities(
    adapter: VideoAdapter, settings: Settings, runtime: DeviceRuntime, store: ShmStore
) -> None:
    """Each sampled frame sent to the image model as a PNG; the mean of their 1,000 class
    probabilities, ranked, is the clip's labels."""
    image = EfficientNetAdapter(settings.models["efficientnet-lite0"], settings, runtime)  # type: ignore[arg-type]
    image._model, image.traced = adapter._model, adapter.traced
    sample = adapter.preprocess(adapter.prepare({"video_b64": b64(AV1)}))
    assert isinstance(sample, VideoSample) and len(sample.video.frames) == 10
    mean = np.zeros(1000)
    for frame in sample.video.frames:
        png = io.BytesIO()
        Image.fromarray(frame).save(png, format="PNG")
        inputs = {"image_b64": base64.b64encode(png.getvalue()).decode("ascii"), "top_k": 1000}
        for lab in image.run_batch([image.preprocess(image.prepare(inputs))])[0]["labels"]:
            mean[lab["index"]] += lab["probability"] / len(sample.video.frames)
    out = run(adapter, {"video_b64": b64(AV1), "top_k": 3})[0]
    frame_embeddings(out, store)  # (released)
    assert [lab["index"] for lab in out["labels"]] == np.argsort(-mean)[:3].tolist()
    np.testing.assert_allclose(
        [lab["probability"] for lab in out["labels"]], np.sort(mean)[::-1][:3], atol=1e-5
    )


@pytest.mark.parametrize(("top_k", "n"), [(None, 5), (0, 0), (1, 1), (20, 20)])
def test_top_k_per_request(adapter: VideoAdapter, top_k: int | None, n: int) -> None:
    inputs: dict[str, Any] = {"video_b64": b64(H264_10)}
    if top_k is not None:
        inputs["top_k"] = top_k
    assert len(run(adapter, inputs)[0]["labels"]) == n


@pytest.mark.parametrize("top_k", [-1, 1001, "3", True, 1.5])
def test_bad_top_k_is_refused(adapter: VideoAdapter, top_k: Any) -> None:
    with pytest.raises(InvalidInput, match="top_k") as info:
        adapter.prepare({"video_b64": b64(H264_10), "top_k": top_k})
    assert info.value.code == "INVALID_INPUT"


def test_batch_equals_single(adapter: VideoAdapter, store: ShmStore) -> None:
    # 10 + 2 frames in mini-batches of 8: the second mini-batch spans both videos.
    inputs = [{"video_b64": b64(AV1)}, {"video_b64": b64(H264_10)}]
    batched = run(adapter, *inputs)
    singles = [run(adapter, i)[0] for i in inputs]
    for b, s in zip(batched, singles, strict=True):
        np.testing.assert_allclose(b["clip_embedding"], s["clip_embedding"], atol=1e-5)
        np.testing.assert_allclose(
            frame_embeddings(b, store), frame_embeddings(s, store), atol=1e-5
        )
        assert b["timestamps_s"] == s["timestamps_s"]
        assert [lab["index"] for lab in b["labels"]] == [lab["index"] for lab in s["labels"]]


def test_same_weights_same_embeddings_across_instances(
    adapter: VideoAdapter, settings: Settings, runtime: DeviceRuntime
) -> None:
    other = VideoAdapter(settings.models[MODEL], settings, runtime)
    other.load()
    a = run(adapter, {"video_b64": b64(H264_10)})[0]
    b = run(other, {"video_b64": b64(H264_10)})[0]
    assert a["clip_embedding"] == b["clip_embedding"]
    assert a["frame_embeddings"] == b["frame_embeddings"]  # inline: the same bytes


def test_max_frames_caps_and_stops_decoding(adapter: VideoAdapter, store: ShmStore) -> None:
    few = variant(adapter, max_frames=4, sample_fps=1.0)
    out = run_released(few, store, {"video_b64": b64(NASA)})[0]
    assert out["frames"] == 4 and out["timestamps_s"] == [0.0, 1.0, 2.0, 3.0]
    assert out["capped"] is True and out["partial"] is False
    assert out["decoded_until_s"] < 4.0  # decoding stopped at the 4th sample


# -- bad videos -----------------------------------------------------------------------------------
def test_truncated_mp4_without_moov_fails_at_prepare(adapter: VideoAdapter) -> None:
    with pytest.raises(VideoDecodeError, match="cannot open video") as info:
        adapter.prepare({"video_b64": b64(VIDEOS / "bad" / "nasa_13013_truncated_300000B.mp4")})
    assert info.value.code == "VIDEO_DECODE"


def test_file_with_no_decodable_frame_fails_in_preprocess(adapter: VideoAdapter) -> None:
    prepared = adapter.prepare(
        {"video_b64": b64(VIDEOS / "bad" / "torchcodec_av1_video_truncated_3000B.mkv")}
    )  # the header is fine
    with pytest.raises(VideoDecodeError, match="no frame") as info:
        adapter.preprocess(prepared)
    assert info.value.code == "VIDEO_DECODE"


def test_truncated_file_returns_what_decoded_flagged_partial(
    adapter: VideoAdapter, store: ShmStore
) -> None:
    half = VIDEOS / "bad" / "torchcodec_av1_video_truncated_half.mkv"
    out = run_released(adapter, store, {"video_b64": b64(half)})[0]
    assert out["partial"] is True and "ended at 1.40 s of the 5.00 s" in out["partial_reason"]
    assert out["frames"] == 3 and out["timestamps_s"] == [0.0, 0.52, 1.0]  # 25 fps frames
    assert out["duration_s"] == pytest.approx(5.0)


def test_truncated_avi_is_flagged_by_its_declared_frame_count(
    adapter: VideoAdapter, store: ShmStore
) -> None:
    """FFmpeg shortens a cut AVI's duration to the data present (3.28 s here); its header
    still declares 164 frames at 25 fps (6.56 s): that is what flags it."""
    half = VIDEOS / "bad" / "mmaction2_test_truncated_half.avi"
    out = run_released(variant(adapter, sample_fps=1.0), store, {"video_b64": b64(half)})[0]
    assert out["partial"] is True
    assert "ended at 3.08 s of the 6.56 s" in out["partial_reason"]
    # the first frame at or after each second on the clip's clock (its first frame is t = 0)
    assert out["frames"] == 4 and out["timestamps_s"] == [0.0, 1.0, 2.04, 3.0]


def test_corrupt_middle_returns_what_decoded_flagged_partial(
    adapter: VideoAdapter, store: ShmStore
) -> None:
    corrupt = base64.b64encode(zeroed_middle(NASA)).decode()
    out = run_released(variant(adapter, sample_fps=1.0), store, {"video_b64": corrupt})[0]
    assert out["partial"] is True and "decoding stopped" in out["partial_reason"]
    assert 0 < out["frames"] < 13 and out["decoded_until_s"] < 13.0


@pytest.mark.parametrize(
    "data",
    [
        (REPO / "data" / "images" / "pillow_hopper.jpg").read_bytes(),  # FFmpeg could open it
        b"\x00" * 4096,
        b"#EXTM3U\n#EXTINF:10,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n",  # a playlist
    ],
    ids=["jpeg-image", "zeros", "hls-playlist"],
)
def test_non_videos_are_refused_before_decoding(adapter: VideoAdapter, data: bytes) -> None:
    with pytest.raises(VideoDecodeError) as info:
        adapter.prepare({"video_b64": base64.b64encode(data).decode()})
    assert info.value.code == "VIDEO_DECODE"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"max_video_pixels": 320 * 179}, "pixels per frame"),
        ({"max_duration_s": 10}, "lasts 13.0 s"),
        ({"max_streams": 4}, "6 streams"),
        ({"max_video_bytes": 100_000}, "above the limit of 100,000"),
    ],
)
def test_limits_refuse_with_payload_too_large(
    adapter: VideoAdapter, extra: dict[str, Any], match: str
) -> None:
    with pytest.raises(PayloadTooLarge, match=match) as info:
        variant(adapter, **extra).prepare({"video_b64": b64(NASA)})
    assert info.value.code == "PAYLOAD_TOO_LARGE"


def test_inline_video_over_the_inline_limit(adapter: VideoAdapter, shm_root: Path) -> None:
    small = load_settings(
        limits={"max_inline_bytes": 20_000}, transport={"shm_root": str(shm_root)}
    )
    with pytest.raises(PayloadTooLarge, match="send large videos as 'video_ref'"):
        variant(adapter, small).prepare({"video_b64": b64(H264_10)})  # 34.7 KB


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        ("not a dict", "must be an object"),
        ({}, "exactly one of"),
        ({"video_b64": "AAAA", "video_ref": {}}, "exactly one of"),
        ({"video": "AAAA"}, "unknown video input keys"),
        ({"video_b64": 42}, "must be a base64 string"),
        ({"video_b64": ""}, "is empty"),
        ({"video_b64": "abc$"}, "not valid base64"),
    ],
)
def test_prepare_rejects_malformed_inputs(adapter: VideoAdapter, inputs: Any, match: str) -> None:
    with pytest.raises(InvalidInput, match=match) as info:
        adapter.prepare(inputs)
    assert info.value.code == "INVALID_INPUT"


def test_bad_refs(adapter: VideoAdapter, store: ShmStore) -> None:
    with pytest.raises(TensorRefError) as info:
        adapter.prepare({"video_ref": {"kind": "shm", "id": "../../etc/passwd"}})
    assert info.value.code == "TENSOR_REF_INVALID"
    floats = store.put(np.zeros((4, 4), np.float32))
    try:
        with pytest.raises(InvalidInput, match="1-D uint8"):
            adapter.prepare({"video_ref": floats.to_dict()})
    finally:
        store.release(floats)
    gone = store.put(np.frombuffer(H264_10.read_bytes(), np.uint8))
    store.release(gone)
    with pytest.raises(TensorRefError, match="unknown tensor"):
        adapter.prepare({"video_ref": gone.to_dict()})


def test_shm_full_fails_the_request_and_leaves_nothing(
    adapter: VideoAdapter, tmp_path: Path
) -> None:
    tiny = load_settings(
        transport={"shm_root": str(tmp_path / "tiny"), "capacity_bytes": 7_000},
        limits={"max_inline_bytes": 1024},  # and too large to go inline instead
    )
    a = variant(adapter, tiny, output_inline_max_bytes=0)  # every output through shm
    # (prepared where the input may be inline: 2 frames, 4 KiB of output)
    sample = adapter.preprocess(adapter.prepare({"video_b64": b64(H264_10)}))
    with pytest.raises(ShmCapacityError) as info:
        a.run_batch([sample, sample])  # the second 4 KiB segment passes 7,000 bytes
    assert info.value.code == "SHM_CAPACITY"
    assert not ShmStore(root=tmp_path / "tiny").ls()  # the first one was released


def test_shm_full_sends_an_output_redis_can_carry_inline(
    adapter: VideoAdapter, tmp_path: Path
) -> None:
    tiny = load_settings(transport={"shm_root": str(tmp_path / "tiny"), "capacity_bytes": 15_000})
    a = variant(adapter, tiny, output_inline_max_bytes=0)
    sample = a.preprocess(a.prepare({"video_b64": b64(H264_10)}))
    first, second = a.run_batch([sample, sample])  # the second 10 KiB output does not fit
    assert first["frame_embeddings"]["kind"] == "shm"
    assert second["frame_embeddings"]["kind"] == "inline"
    emb = decode_inline(second["frame_embeddings"], max_bytes=1 << 20)
    store = ShmStore(root=tmp_path / "tiny")
    np.testing.assert_array_equal(emb, store.get(first["frame_embeddings"]))
    store.release(first["frame_embeddings"]["id"])


# -- pieces -------------------------------------------------------------------------------------
def test_memory_reader_reads_a_read_only_view_in_place() -> None:
    data = np.frombuffer(AV1.read_bytes(), np.uint8)  # read-only, like a shm mapping
    r = MemoryReader(data)
    assert r.read(4) == data[:4].tobytes() and r.tell() == 4
    r.seek(-3, io.SEEK_END)
    assert r.read() == data[-3:].tobytes() and r.read(10) == b""
    sampled = sample_frames(data, sample_fps=4, max_frames=3, size=64, limits=VideoLimits())
    assert sampled.frames.shape == (3, 64, 64, 3) and sampled.frames.dtype == np.uint8


def test_sampled_frames_are_the_centre_square(adapter: VideoAdapter) -> None:
    import av

    payload = adapter.prepare({"video_b64": b64(AV1)})
    sample = adapter.preprocess(payload)
    assert isinstance(sample, VideoSample)
    with av.open(str(AV1)) as c:
        first = next(c.decode(c.streams.video[0])).to_image()  # 640x360
    expected = first.resize((224, 224), Image.Resampling.BICUBIC, box=(140, 0, 500, 360))
    np.testing.assert_array_equal(sample.video.frames[0], np.asarray(expected))


def test_example_inputs_run_end_to_end(adapter: VideoAdapter, store: ShmStore) -> None:
    inputs = adapter.example_inputs(2, adapter.buckets()[0])
    assert inputs == adapter.example_inputs(2) and len({i["video_b64"] for i in inputs}) == 2
    assert len(example_video(0)) < 20_000
    out = run_released(adapter, store, *inputs)
    assert [r["frames"] for r in out] == [8, 8]  # one frame mini-batch each
    with pytest.raises(ValueError, match="bucket"):
        adapter.example_inputs(1, "224")


def test_config_validation_and_describe(
    adapter: VideoAdapter, settings: Settings, runtime: DeviceRuntime
) -> None:
    with pytest.raises(ValueError, match="sample_fps"):
        variant(adapter, sample_fps=0)
    with pytest.raises(ValueError, match="max_frames"):
        variant(adapter, max_frames="many")
    v = variant(adapter, sample_fps="4", max_frames="16")  # env overrides arrive as strings
    assert (v.sample_fps, v.max_frames) == (4.0, 16)
    d = adapter.describe()
    assert d["modality"] == "video" and d["kind"] == "video" and d["name"] == MODEL
    assert (d["sample_fps"], d["max_frames"], d["frame_batch_size"], d["dim"]) == (2.0, 64, 8, 1280)
    json.dumps(d)
    with pytest.raises(ModelError, match="before load"):
        VideoAdapter(settings.models[MODEL], settings, runtime).run_batch([object()])
    assert adapter.run_batch([]) == []


# -- the producer's side: inputs through shm, results resolved ----------------------------------
def test_client_puts_large_videos_in_shm_and_resolves_results(
    adapter: VideoAdapter, settings: Settings
) -> None:
    from producer.client import FleetClient, video_inputs

    redis = settings.redis.model_copy(update={"password": "unused"})  # no broker is used
    client = FleetClient(settings.model_copy(update={"redis": redis}))
    store = client.shm()
    assert video_inputs(H264_10, None) == {"video_b64": b64(H264_10)}  # no store: inline
    assert set(client.video_inputs(AV1)) == {"video_b64"}  # 16 KB: inline
    inputs = client.video_inputs(H264_10)  # 34.7 KB: through shm
    ref = inputs["video_ref"]
    assert ref["shape"] == [H264_10.stat().st_size] and ref["owner"].startswith("producer:")
    assert len(json.dumps(inputs)) < 300
    out = run(variant(adapter, output_inline_max_bytes=0), inputs)[0]
    resolved = client.resolve({"result": out, "more": [{"n": 1}, [2]]})
    emb = resolved["result"]["frame_embeddings"]
    assert isinstance(emb, np.ndarray) and emb.shape == (2, 1280) and not emb.flags.writeable
    assert resolved["result"]["clip_embedding"] == out["clip_embedding"]
    with pytest.raises(TensorRefError):  # resolving released the output segment
        client.resolve(out)
    assert client.release_inputs({"x": [inputs]}) == 1 and client.release_inputs(inputs) == 0
    assert not store.ls()
    inline = run(adapter, {"video_b64": b64(H264_10)})[0]
    assert client.resolve(inline)["frame_embeddings"].shape == (2, 1280)
