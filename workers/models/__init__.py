"""Model adapters, one module per modality, picked by the model config's ``kind``.

Which adapter serves a kind is written in ``shared.model_kinds.KINDS`` (the one table of
model kinds, with each kind's options); :func:`make_adapter` imports it from there the
first time it is needed, so a text worker never imports the video decoder.
"""

from __future__ import annotations

from functools import cache
from importlib import import_module
from typing import TYPE_CHECKING

from shared.model_kinds import KINDS

if TYPE_CHECKING:
    from shared.settings import Settings
    from workers.models.base import ModelAdapter
    from workers.models.runtime import DeviceRuntime


@cache
def adapter_class(kind: str) -> type[ModelAdapter]:
    """The adapter class of model ``kind``, imported from its ``"module:Class"`` path.

    Raises:
        KeyError: ``kind`` is not in ``shared.model_kinds.KINDS``.
        TypeError: the path names something that is not an adapter of the kind's options.
    """
    from workers.models.base import ModelAdapter

    entry = KINDS[kind]
    module, name = entry.adapter.split(":")
    cls = getattr(import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, ModelAdapter)):
        raise TypeError(f"model kind {kind!r}: {entry.adapter} is not a ModelAdapter subclass")
    if cls.options_type is not entry.options:
        raise TypeError(
            f"model kind {kind!r}: {entry.adapter}.options_type is "
            f"{cls.options_type.__name__}, the kind's options are {entry.options.__name__}"
        )
    return cls


def make_adapter(
    modality: str, settings: Settings, runtime: DeviceRuntime, model: str | None = None
) -> ModelAdapter:
    """Build (not load) the adapter of ``model`` (a ``[models.<name>]`` table; default: the
    one configured for ``modality``).

    Raises:
        KeyError: the modality, its model, or the model's kind is not configured/known.
    """
    model_cfg = settings.models[model or settings.modality(modality).model]
    return adapter_class(model_cfg.kind)(model_cfg, settings, runtime)


def make_models(
    modality: str, settings: Settings, runtime: DeviceRuntime, tables: list[str]
) -> ModelAdapter:
    """Build (not load) what serves the models ``tables`` of ``modality``: the one model's
    adapter, or a :class:`~workers.models.model_set.ModelSet` over several.

    Raises:
        KeyError: a model or its kind is not configured/known.
    """
    cfg = settings.modality(modality)
    if tables == [cfg.model]:
        return make_adapter(modality, settings, runtime)
    from workers.models.model_set import ModelSet

    adapters = {t: make_adapter(modality, settings, runtime, t) for t in tables}
    default = cfg.model if cfg.model in adapters else None
    budget = cfg.batching.max_batch_bytes * runtime.lanes
    return ModelSet(adapters, default, runtime, activation_bytes=budget)
