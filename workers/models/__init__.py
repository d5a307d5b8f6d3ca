"""Model adapters, one module per modality, picked by the model config's ``kind``."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.settings import Settings
    from workers.models.base import ModelAdapter
    from workers.models.runtime import DeviceRuntime

# kind -> "module:Class"; imported lazily so a text worker never imports the video decoder.
ADAPTERS: dict[str, str] = {
    "minilm": "workers.models.text:TextAdapter",
    "resnet": "workers.models.image:ImageAdapter",
    "video": "workers.models.video:VideoAdapter",
    "xmodal": "workers.models.xmodal:XModalAdapter",
}


def make_adapter(modality: str, settings: Settings, runtime: DeviceRuntime) -> ModelAdapter:
    """Build (not load) the adapter configured for ``modality``.

    Raises:
        KeyError: the modality, its model, or the model's kind is not configured/known.
    """
    model_cfg = settings.models[settings.modality(modality).model]
    module, cls = ADAPTERS[model_cfg.kind].split(":")
    adapter_cls = getattr(import_module(module), cls)
    return adapter_cls(model_cfg, settings, runtime)
