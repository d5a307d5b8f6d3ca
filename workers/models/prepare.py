"""Fill the trace cache before any worker starts: ``fleet prepare [MODALITY ...]``.

A worker's first start on a host traces its encoder and stores it (``workers.models.
trace_cache``); every later start loads the stored trace and skips building the eager model.
On Kubernetes every new pod is a first start unless the cache travels with the image, so the
Dockerfile runs this at build time, as the user the workers run as (the cache lives in that
user's ``~/.cache/mmfleet/traced``). A scale-from-zero pod then starts from the cache.

Each modality's adapter is loaded exactly as its worker loads it (the same settings, device
and key), then dropped; nothing connects to Redis.
"""

from __future__ import annotations

import time
from typing import Any

from shared.settings import MODALITIES, Settings

__all__ = ["prepare"]


def prepare(settings: Settings, modalities: list[str] | None = None) -> list[dict[str, Any]]:
    """Load each modality's model once so that its trace is stored in the trace cache.

    Args:
        settings: the fleet's settings (model config, device, precision: all in the key).
        modalities: which ones (default: every modality).

    Returns:
        Per modality: ``{"modality", "model", "device", "trace_cache", "load_s"}``, where
        ``trace_cache`` is ``"stored"`` (traced now and stored), ``"hit"`` (stored already),
        or ``"off"`` (the model is not traced: ``torchscript = false``, the cross-modal
        model, or the cache is off, ``FLEET_TRACE_CACHE=0``).

    Raises:
        KeyError: an unknown modality.
        shared.errors.ModelError: a model could not be loaded (its checkpoint is missing).
        workers.models.runtime.DeviceError: the configured device is not usable here.
    """
    from workers.models import make_adapter
    from workers.models.runtime import DeviceRuntime

    out = []
    for modality in modalities or list(MODALITIES):
        if modality not in MODALITIES:
            raise KeyError(f"unknown modality {modality!r}; expected one of {MODALITIES}")
        cfg = settings.modality(modality)
        runtime = DeviceRuntime(cfg.device)
        runtime.start()
        adapter = make_adapter(modality, settings, runtime)
        t0 = time.perf_counter()
        adapter.load()
        facts = adapter.describe()
        out.append(
            {
                "modality": modality,
                "model": cfg.model,
                "device": str(runtime.device),
                "trace_cache": facts.get("trace_cache", "off"),
                "load_s": round(time.perf_counter() - t0, 2),
            }
        )
        del adapter
    return out
