"""``make demo``: the main job on real input, end to end.

Brings a stack of its own up (Redis, text, image, video and xmodal workers, Flower, the
gateway: free loopback ports, its own run dir ``<run_dir>/demo``, metrics off; a stack the
user started with ``make up`` is never touched), submits the
repo's real texts, images, videos (large ones through /dev/shm) and image+caption pairs at
mixed priorities at a steady pace, plus deliberately bad inputs, waits
for every result, checks that every modality's answers are semantically right
(``producer.tools.demo.semantic``: text, image, image+text, video), prints a latency table,
writes ``reports/demo.json`` and brings its stack down.

Exit status 0 only if every valid input succeeded, every bad input came back with its
expected error code, and the semantic checks passed.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from producer.client import FleetClient, ResultHandle, image_inputs, xmodal_inputs
from producer.tools.demo.semantic import (
    all_checks,
    captioned_images,
    image_check,
    text_check,
    text_texts,
    video_check,
    xmodal_check,
)
from shared.errors import FleetError
from shared.settings import load_settings

DATA = Path(__file__).resolve().parents[3] / "data"
REPORT = Path("reports/demo.json")
N_SENTENCES = 80
PACE_S = 0.04  # seconds between submissions: ~25 requests/s, well below the stack's capacity
console = Console()


@dataclass
class Job:
    kind: str  # "valid" | "bad"
    modality: str
    priority: str
    label: str
    expect_code: str | None = None
    source: str = ""  # the input's file name (images, videos, xmodal photos)
    handle: ResultHandle | None = None
    outcome: dict[str, Any] | None = None
    submit_error: dict[str, Any] | None = None


def texts() -> list[str]:
    lines = (DATA / "text" / "botchan_sentences.txt").read_text(encoding="utf-8").splitlines()
    return [t.strip() for t in lines if len(t.strip()) > 20][:N_SENTENCES]


def images() -> list[Path]:
    return sorted(p for p in (DATA / "images").iterdir() if p.is_file())


def media_jobs(client: FleetClient) -> list[tuple[Job, dict[str, Any]]]:
    """Videos (through /dev/shm above 32 KiB) and image + all-captions pairs, valid and bad."""
    videos = DATA / "videos"
    jobs: list[tuple[Job, dict[str, Any]]] = []
    for p in sorted(x for x in videos.iterdir() if x.is_file()):
        job = Job("valid", "video", "bulk", p.name, source=p.name)
        jobs.append((job, client.video_inputs(p)))
    partial = videos / "bad" / "torchcodec_av1_video_truncated_half.mkv"
    jobs.append(
        (
            Job("valid", "video", "bulk", f"partial video {partial.name}"),
            client.video_inputs(partial),
        )
    )
    for name in ("nasa_13013_truncated_300000B.mp4", "torchcodec_av1_video_truncated_3000B.mkv"):
        job = Job("bad", "video", "bulk", f"bad video {name}", "VIDEO_DECODE")
        jobs.append((job, client.video_inputs(videos / "bad" / name)))
    captions, _ = captioned_images()  # every photo against every caption
    coco = json.loads((DATA / "captions" / "captions_coco.json").read_text())
    for im in coco["images"]:
        name = Path(im["file_name"]).name
        job = Job("valid", "xmodal", "bulk", f"xmodal {name}", source=name)
        jobs.append((job, xmodal_inputs(DATA / im["file_name"], captions)))
    no_texts = {"image_b64": image_inputs(images()[0])["image_b64"]}
    jobs.append((Job("bad", "xmodal", "bulk", "xmodal without texts", "INVALID_INPUT"), no_texts))
    return jobs


def media_summary(job: Job, result: dict[str, Any]) -> dict[str, Any]:
    """What a video or xmodal result holds, with its arrays (resolved refs) as shapes."""
    if job.modality == "video":
        return {
            "label": job.label,
            "modality": "video",
            "source": job.source,
            "frames": result["frames"],
            "frame_embeddings": list(result["frame_embeddings"].shape),
            "partial": result["partial"],
            "capped": result["capped"],
            "labels": [x["label"] for x in result.get("labels", [])],
        }
    return {
        "label": job.label,
        "modality": "xmodal",
        "source": job.source,
        "scores": list(result["scores"]),
        "text_embeddings": list(result["text_embeddings"].shape),
        "best_caption": int(max(range(len(result["scores"])), key=result["scores"].__getitem__)),
        "labels": [x["label"] for x in result.get("labels", [])],
    }


def plan() -> tuple[list[tuple[Job, dict[str, Any]]], list[str]]:
    prios = ["realtime", "high", "normal", "bulk"]
    jobs: list[tuple[Job, dict[str, Any]]] = []
    for i, t in enumerate(texts()):
        jobs.append((Job("valid", "text", prios[i % 4], f"sentence {i}"), {"text": t}))
    sem_texts = text_texts()
    for t in sem_texts:
        jobs.append((Job("valid", "text", "high", f"semantic: {t[:40]}"), {"text": t}))
    for i, p in enumerate(images()):
        jobs.append(
            (
                Job("valid", "image", ["normal", "bulk", "high"][i % 3], p.name, source=p.name),
                image_inputs(p),
            )
        )
    bad_images = sorted((DATA / "images" / "bad").iterdir())
    codes = {"pillow_decompression_bomb.gif": "PAYLOAD_TOO_LARGE"}
    for p in bad_images:
        jobs.append(
            (
                Job(
                    "bad",
                    "image",
                    "normal",
                    f"bad image {p.name}",
                    codes.get(p.name, "IMAGE_DECODE"),
                ),
                image_inputs(p),
            )
        )
    novel = (DATA / "text" / "botchan_sentences.txt").read_text(encoding="utf-8")
    jobs += [
        (Job("bad", "text", "normal", "empty text", "INVALID_INPUT"), {"text": ""}),
        (
            Job("bad", "text", "normal", "control characters only", "INVALID_INPUT"),
            {"text": "\x01\x02\x03\u200b"},
        ),
        (
            Job("bad", "text", "normal", "oversized text (whole novel)", "PAYLOAD_TOO_LARGE"),
            {"text": novel},
        ),
        (Job("bad", "text", "normal", "wrong input key", "INVALID_INPUT"), {"txt": "hello"}),
        (
            Job("bad", "audio", "normal", "unknown modality", "UNSUPPORTED_MODALITY"),
            {"text": "hello"},
        ),
        (Job("bad", "text", "urgent", "unknown priority", "INVALID_PRIORITY"), {"text": "hi"}),
    ]
    # Interleave modalities and priorities (a fixed shuffle): a steady mixed stream, not a
    # burst of one kind that a 2-core machine would serve after its deadlines.
    random.Random(7).shuffle(jobs)
    return jobs, sem_texts


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def submit_and_wait(client: FleetClient, jobs: list[tuple[Job, dict[str, Any]]]) -> None:
    """Submit every job at a steady pace, then wait for all their outcomes."""
    for job, inputs in jobs:
        try:
            job.handle = client.submit(job.modality, inputs, priority=job.priority)
        except FleetError as exc:
            job.submit_error = exc.to_dict()
        time.sleep(PACE_S)
    submitted = [j for j, _ in jobs if j.handle is not None]
    outcomes = client.wait_all([j.handle for j in submitted], timeout_s=180)  # type: ignore[misc]
    for j, o in zip(submitted, outcomes, strict=True):
        j.outcome = o


def _media_results(
    client: FleetClient, media_phase: list[tuple[Job, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Release the phase's input segments and summarise each media result (its TensorRefs
    mapped); a result that cannot be resolved becomes the job's error outcome."""
    media: list[dict[str, Any]] = []
    for job, inputs in media_phase:
        client.release_inputs(inputs)  # the video segments this producer put in /dev/shm
        o = job.outcome
        if o is not None and "result" in o:
            try:  # maps the TensorRefs (and releases the worker's output segments)
                media.append(media_summary(job, client.resolve(o["result"])))
            except FleetError as exc:
                job.outcome = {"error": exc.to_dict()}
    return media


@dataclass
class _Tally:
    """Outcomes counted over every job: latencies (ms) by (modality, priority), the semantic
    texts' embeddings, and what did not go as planned."""

    lat: dict[tuple[str, str], list[float]] = field(default_factory=lambda: defaultdict(list))
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    image_labels: dict[str, list[str]] = field(default_factory=dict)
    valid_ok: int = 0
    valid_failed: int = 0
    bad_ok: int = 0
    bad_wrong: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)


def _tally(jobs: list[tuple[Job, dict[str, Any]]], sem_texts: list[str]) -> _Tally:
    t = _Tally()
    for job, inputs in jobs:
        o = job.outcome
        if job.kind == "valid":
            if o is not None and "result" in o:
                t.valid_ok += 1
                assert job.handle is not None
                done = o.get("done_ms")
                if done is not None:
                    t.lat[(job.modality, job.priority)].append(
                        done - job.handle.envelope.submitted_ms
                    )
                if job.modality == "text" and inputs["text"] in sem_texts:
                    t.embeddings[inputs["text"]] = o["result"]["embedding"]
                if job.modality == "image":
                    labels = o["result"].get("labels", [])
                    t.image_labels[job.source] = [x["label"] for x in labels]
            else:
                t.valid_failed += 1
                t.failures.append({"label": job.label, "outcome": o})
        else:
            got = (job.submit_error or (o or {}).get("error") or {}).get("code")
            if got == job.expect_code:
                t.bad_ok += 1
            else:
                t.bad_wrong += 1
                t.failures.append({"label": job.label, "expected": job.expect_code, "got": got})
    return t


def _latency(lat: dict[tuple[str, str], list[float]]) -> dict[str, Any]:
    return {
        f"{m}/{p}": {
            "count": len(v),
            "p50_ms": percentile(v, 50),
            "p95_ms": percentile(v, 95),
            "p99_ms": percentile(v, 99),
            "max_ms": max(v),
        }
        for (m, p), v in sorted(lat.items())
    }


def run(client: FleetClient) -> dict[str, Any]:
    jobs, sem_texts = plan()
    t0 = time.monotonic()
    submit_and_wait(client, jobs)
    # A second phase for videos and image+caption pairs (BULK: no deadline), so their long
    # requests do not compete for a small machine's CPU with the first phase's deadlines.
    media_phase = media_jobs(client)
    submit_and_wait(client, media_phase)
    jobs += media_phase
    media = _media_results(client, media_phase)
    wall_s = time.monotonic() - t0

    t = _tally(jobs, sem_texts)
    text = (
        text_check(t.embeddings)
        if len(t.embeddings) == len(set(sem_texts))
        else {"passed": False, "rows": [], "reason": "semantic texts missing results"}
    )
    by = {m: {x["source"]: x for x in media if x["modality"] == m} for m in ("video", "xmodal")}
    sem = all_checks(
        text,
        image_check(t.image_labels),
        xmodal_check({k: v["scores"] for k, v in by["xmodal"].items()}),
        video_check({k: v["labels"] for k, v in by["video"].items()}),
    )
    return {
        "valid_submitted": sum(j.kind == "valid" for j, _ in jobs),
        "valid_succeeded": t.valid_ok,
        "valid_failed": t.valid_failed,
        "bad_submitted": sum(j.kind == "bad" for j, _ in jobs),
        "bad_rejected_with_expected_code": t.bad_ok,
        "bad_wrong_outcome": t.bad_wrong,
        "bad_inputs": [
            {
                "label": j.label,
                "expected": j.expect_code,
                "got": (j.submit_error or (j.outcome or {}).get("error") or {}).get("code"),
                "at": "submit" if j.submit_error else "worker",
            }
            for j, _ in jobs
            if j.kind == "bad"
        ],
        "failures": t.failures,
        "latency_ms": _latency(t.lat),
        "semantic_check": sem,
        "media": media,
        "wall_s": wall_s,
    }


def print_report(rep: dict[str, Any]) -> None:
    t = Table(title="fleet demo: end-to-end latency (submit -> result stored)")
    for col in ("modality/priority", "count", "p50 ms", "p95 ms", "p99 ms", "max ms"):
        t.add_column(col, justify="right")
    for k, v in rep["latency_ms"].items():
        t.add_row(
            k,
            str(v["count"]),
            f"{v['p50_ms']:.1f}",
            f"{v['p95_ms']:.1f}",
            f"{v['p99_ms']:.1f}",
            f"{v['max_ms']:.1f}",
        )
    console.print(t)
    b = Table(title="bad inputs")
    for col in ("input", "expected", "got", "where"):
        b.add_column(col)
    for x in rep["bad_inputs"]:
        b.add_row(x["label"], x["expected"], str(x["got"]), x["at"])
    console.print(b)
    s = rep["semantic_check"]
    x = s["xmodal"]
    for key, line in (
        ("text", f"text: {len(s['text']['rows'])} related/unrelated caption pairs"),
        ("image", f"image: top-5 labels of {len(s['image']['rows'])} photos of known content"),
        (
            "xmodal",
            f"image+text: own caption first for {x['rank1']} photos; an own caption beats "
            f"another photo's in {x['mean_win_rate']:.3f} of the pairs (chance 0.5)",
        ),
        ("video", f"video: top-5 labels of {len(s['video']['rows'])} clips"),
    ):
        console.print(f"  {'ok  ' if s[key]['passed'] else 'FAIL'} {line}")
    console.print(f"semantic check: {'PASSED' if s['passed'] else 'FAILED'} (4 modalities)")
    console.print(
        f"valid: {rep['valid_succeeded']}/{rep['valid_submitted']} succeeded; "
        f"bad: {rep['bad_rejected_with_expected_code']}/{rep['bad_submitted']} "
        f"rejected with the expected code; wall {rep['wall_s']:.1f} s"
    )


def demo_run_dir(user_run_dir: Path) -> Path:
    """The demo's own run dir: ``demo`` inside the user's run dir (its pidfiles, logs and
    secrets apart from the user's stack's; ``fleet down`` never sees them)."""
    return user_run_dir / "demo"


def main() -> int:
    import shutil

    from producer.stack.local import Stack, isolated_environment

    run_dir = demo_run_dir(load_settings().run_dir)
    if (run_dir / "pids").exists():
        Stack(load_settings(stack={"run_dir": run_dir})).down()  # a demo interrupted earlier
    for sub in ("redis", "logs"):  # no requests replayed from an earlier demo's AOF
        shutil.rmtree(run_dir / sub, ignore_errors=True)
    # Its own /dev/shm root, removed afterwards: the default root is a user's stack's.
    shm_root = Path(f"/dev/shm/mmfleet-{os.getuid()}-demo-{os.getpid()}")
    try:
        with isolated_environment(run_dir, {"FLEET_TRANSPORT__SHM_ROOT": str(shm_root)}) as s:
            return _run_demo(s)
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)


def _run_demo(settings: Any) -> int:
    from producer.stack.local import Stack, StackError

    stack = Stack(settings)
    console.print(
        "bringing the demo's own stack up (Redis, text/image/video/xmodal workers, Flower, "
        f"gateway; free ports, run dir {stack.dir})..."
    )
    try:
        stack.up(["text", "image", "video", "xmodal"], flower=True, gateway=True)
    except StackError as exc:
        console.print(f"[red]stack failed to start:[/red] {exc.summary} (log: {exc.log_path})")
        return 1
    try:
        console.print(
            f"Flower: {stack.flower_url()} (user {settings.flower.user}; password in "
            f"{stack.dir / 'flower.password'}, while the demo runs)"
        )
        client = FleetClient.from_settings(settings)
        try:
            rep = run(client)
            from producer.tools.demo.gateway import run_gateway

            console.print(f"gateway phase: a handful of requests through {stack.gateway_url()}")
            rep["gateway"] = run_gateway(
                stack.gateway_url(), settings.gateway_token(), client, texts()
            )
        finally:
            client.close()
    finally:
        console.print("bringing the stack down...")
        stack.down()
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(rep, indent=2))
    print_report(rep)
    gw = rep["gateway"]
    console.print(
        f"gateway: {gw['sent']} requests, {gw['failed']} failed checks, "
        f"p50 {gw['latency_ms']['p50']} ms"
    )
    console.print(f"report: {REPORT}")
    ok = (
        rep["valid_failed"] == 0
        and rep["bad_wrong_outcome"] == 0
        and rep["semantic_check"]["passed"]
        and gw["failed"] == 0
    )
    if gw["failed"]:
        rep["failures"] = [*rep.get("failures", []), *gw["failures"]]
    if not ok:
        console.print("[red]demo FAILED[/red]", json.dumps(rep["failures"], indent=1)[:4000])
    return 0 if ok else 1
