"""What the bench reads from the fleet's workers: ``fleet_stats`` replies and their
differences per repetition (batch sizes, triggers, the model's busy share), and the
settings facts a report records per modality."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from producer.client import FleetClient
from shared.settings import Settings

if TYPE_CHECKING:
    from producer.tools.bench.results import ModeResult


def fleet_stats(client: FleetClient, expect: int = 0) -> dict[str, dict[str, Any]]:
    """``fleet_stats`` of every worker, by modality (the node name's prefix).

    Returns as soon as ``expect`` workers replied (0: waits the whole timeout).
    """
    try:
        replies = client.app.control.broadcast(
            "fleet_stats", reply=True, timeout=1.5, limit=expect or None
        )
    except Exception:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for reply in replies or []:
        for node, stats in reply.items():
            if isinstance(stats, dict) and "error" not in stats:
                out[node.split("@", 1)[0]] = stats
    return out


def add_stats_diff(
    out: ModeResult, before: dict[str, Any], after: dict[str, Any], wall_s: float
) -> None:
    for m, a in after.items():
        b = before.get(m, {})
        if "model_s" in a and wall_s > 0:
            busy = (a["model_s"] - b.get("model_s", 0.0)) / wall_s
            out.model_busy.setdefault(m, []).append(round(busy, 4))
        sizes = out.batches.setdefault(m, Counter())
        for k, v in (a.get("batch_sizes") or {}).items():
            sizes[int(k)] += v - (b.get("batch_sizes") or {}).get(k, 0)
        trig = out.triggers.setdefault(m, Counter())
        for k, v in (a.get("triggers") or {}).items():
            trig[k] += v - (b.get("triggers") or {}).get(k, 0)


def settings_facts(settings: Settings, modalities: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in modalities:
        cfg = settings.modality(m)
        out[m] = {
            "model": cfg.model,
            "device": cfg.device.device,
            "torch_threads": cfg.device.torch_threads,
            "prefetch_multiplier": cfg.device.prefetch_multiplier,
            "max_batch_size": cfg.batching.max_batch_size,
            "max_queue_delay_ms": cfg.batching.max_queue_delay_ms,
            "precision": str(getattr(settings.models[cfg.model], "precision", None) or "fp32"),
        }
    return out
