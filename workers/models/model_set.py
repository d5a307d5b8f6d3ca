"""Several models in one worker: :class:`ModelSet`, an adapter that routes each request to
the model it names, and the check that the set fits the worker's memory partition.

A worker that serves one model uses that model's adapter as it is. A worker serving several
(``fleet worker text --models minilm,bge-small``) holds one :class:`ModelSet` over their
adapters, each loaded once, and the engine sees one adapter:

- :meth:`ModelSet.prepare_for` (admission) prepares a request with the adapter of the model
  its envelope names (``None``: the modality's default) and prefixes the bucket with the
  model's table name, ``bge-small|len32``. Batches never mix buckets
  (``workers.batching.batcher``), so a batch only ever holds requests of one model, and the
  batcher's latency model learns each model's buckets apart.
- :meth:`ModelSet.preprocess` and :meth:`ModelSet.run_batch` hand the batch to that model's
  adapter; each request's result comes from the model it named.
- warmup: :meth:`ModelSet.buckets` lists every model's buckets, the models taking turns
  (each model's shortest first), so ``warmup_buckets_before_ready`` warms each model's
  shortest buckets before ready.

Memory (:func:`check_set_fits`): the models share the worker's device partition
(``[modalities.<m>.device] memory_fraction`` of the GPU's memory, of the host's on the CPU:
``workers.models.hf_partition``). After each model loads, the parameters and buffers of every
model loaded so far, plus the activation budget (``max_batch_bytes`` per inference lane),
must fit it; the first model that does not is refused with ``MODEL_TOO_LARGE`` naming every
size, and the worker does not start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.errors import DeviceError, ModelNotFound
from workers.models.base import ModelAdapter, Prepared
from workers.models.hf_partition import (
    _DTYPE_BYTES,
    ModelTooLarge,
    partition_bytes,
    weight_params,
)

if TYPE_CHECKING:
    from workers.models.runtime import DeviceRuntime

__all__ = ["BUCKET_SEP", "ModelSet", "adapter_bytes", "check_set_fits", "module_bytes"]

BUCKET_SEP = "|"  # between a model's table name and its adapter's bucket


class _ForModel(dict[str, Any]):
    """Example inputs (warmup) that know the model they were made for."""

    model: str = ""


class ModelSet(ModelAdapter):
    """One adapter over several models of one modality (see the module docstring).

    Args:
        adapters: table name -> its adapter (built, not loaded), in the worker's order.
        default: the modality's default model's table (a request naming none), or ``None``
            when this worker does not serve it.
        runtime: the worker's device runtime (shared by every model).
        activation_bytes: the activation budget the fit check reserves (every lane's
            ``max_batch_bytes``).
    """

    tensor_inputs = True  # set per instance below
    reports_progress = False

    def __init__(
        self,
        adapters: dict[str, ModelAdapter],
        default: str | None,
        runtime: DeviceRuntime,
        activation_bytes: int = 0,
    ) -> None:
        if not adapters:
            raise ValueError("a model set needs at least one model")
        first = next(iter(adapters.values()))
        self.adapters = adapters
        self.default = default
        self.runtime = runtime
        self.settings = first.settings
        self.cfg = first.cfg
        self.modality = first.modality
        self.activation_bytes = activation_bytes
        self.tensor_inputs = any(a.tensor_inputs for a in adapters.values())  # type: ignore[misc]
        self.reports_progress = any(a.reports_progress for a in adapters.values())  # type: ignore[misc]
        self._local = threading.local()
        self.loaded_bytes: dict[str, int] = {}

    # -- routing ------------------------------------------------------------------------
    def route(self, model: str | None) -> str:
        """The table of the model a request naming ``model`` runs on.

        Raises:
            ModelNotFound: this worker does not serve it.
        """
        name = self.default if model is None else model
        if name is None or name not in self.adapters:
            served = ", ".join(self.adapters)
            raise ModelNotFound(
                f"model {model or 'default'!r} is not served by this worker (it serves {served})"
            )
        return name

    @staticmethod
    def split(bucket: str | None) -> tuple[str | None, str | None]:
        """``(table, the adapter's bucket)`` of a set's bucket."""
        if bucket is None:
            return None, None
        table, sep, inner = bucket.partition(BUCKET_SEP)
        return (table, inner) if sep else (None, bucket)

    # -- the adapter contract -----------------------------------------------------------
    def load(self) -> None:
        for table, adapter in self.adapters.items():
            adapter.load()
            self.loaded_bytes[table] = adapter_bytes(adapter)
            check_set_fits(self.loaded_bytes, self.activation_bytes, self.runtime)

    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        return self.prepare_for(getattr(inputs, "model", None) or None, inputs)

    def prepare_for(self, model: str | None, inputs: dict[str, Any]) -> Prepared:
        table = self.route(model)
        p = self.adapters[table].prepare(inputs)
        return Prepared(f"{table}{BUCKET_SEP}{p.bucket}", p.length, p.nbytes, (table, p))

    def preprocess(self, prepared: Prepared) -> Any:
        table, inner = prepared.payload
        return table, self.adapters[table].preprocess(inner)

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        tables = {t for t, _ in samples}
        if len(tables) != 1:  # the batcher never mixes buckets; a bug if it did
            raise RuntimeError(f"a batch mixes models {sorted(tables)}")
        table = tables.pop()
        self._local.last = table
        return self.adapters[table].run_batch([s for _, s in samples])

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        table, inner = self.split(bucket)
        table = table or self.default or next(iter(self.adapters))
        out = []
        for one in self.adapters[table].example_inputs(batch_size, inner):
            tagged = _ForModel(one)
            tagged.model = table
            out.append(tagged)
        return out

    def buckets(self) -> list[str]:
        per_model = [
            [f"{table}{BUCKET_SEP}{b}" for b in adapter.buckets()]
            for table, adapter in self.adapters.items()
        ]
        out: list[str] = []
        for i in range(max(len(b) for b in per_model)):
            out += [b[i] for b in per_model if i < len(b)]
        return out

    def torch_modules(self) -> list[Any]:
        return [m for a in self.adapters.values() for m in a.torch_modules()]

    def discard(self, results: list[dict[str, Any]]) -> None:
        table = getattr(self._local, "last", None)
        adapters = [self.adapters[table]] if table in self.adapters else self.adapters.values()
        for adapter in adapters:
            adapter.discard(results)

    @property
    def progress_sink(self) -> Callable[[int, int, int], None] | None:
        return getattr(self._local, "sink", None)

    @progress_sink.setter
    def progress_sink(self, sink: Callable[[int, int, int], None] | None) -> None:
        self._local.sink = sink
        for adapter in self.adapters.values():
            adapter.progress_sink = sink

    def describe(self) -> dict[str, Any]:
        return {
            "modality": self.modality,
            "default": self.default,
            "models": {t: a.describe() for t, a in self.adapters.items()},
        }


def adapter_bytes(adapter: ModelAdapter) -> int:
    """The weight bytes of a loaded adapter: the larger of its modules' parameters and
    buffers (:func:`module_bytes`) and its weights' size at their precision (the folder's
    ``*.safetensors``/``*.bin``, ``workers.models.hf_partition``): a traced model loaded
    from the trace cache is frozen, its weights constants that no ``parameters()`` lists."""
    measured = module_bytes(adapter.torch_modules())
    facts = adapter.describe()
    known = int(facts.get("weight_bytes") or getattr(adapter, "weight_bytes", 0) or 0)
    weights = facts.get("weights")
    if not known and isinstance(weights, str) and Path(weights).is_dir():
        try:
            params = weight_params(Path(weights))
        except DeviceError:
            params = 0
        known = params * _DTYPE_BYTES.get(str(facts.get("precision", "fp32")), 4)
    return max(measured, known)


def module_bytes(modules: list[Any]) -> int:
    """Bytes of the parameters and buffers of ``modules`` (each tensor counted once)."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            ptr = tensor.data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            total += tensor.numel() * tensor.element_size()
    return total


def check_set_fits(
    loaded: dict[str, int],
    activation_bytes: int,
    runtime: DeviceRuntime,
    partition: tuple[int, str] | None = None,
) -> int:
    """The bytes the models ``loaded`` (table -> weight bytes) and the activation budget
    need, if they fit the worker's partition (``partition``: its bytes and description;
    default from ``runtime``'s device and ``memory_fraction``).

    Raises:
        ModelTooLarge: they do not fit (the message names each model's size).
    """
    if partition is None:
        dev = runtime.device
        partition = partition_bytes(dev.type, runtime.cfg.memory_fraction, dev.index or 0)
    part, where = partition
    need = sum(loaded.values()) + activation_bytes
    if need > part:
        sizes = ", ".join(f"{t} {_mib(n)}" for t, n in loaded.items())
        raise ModelTooLarge(
            f"models {', '.join(loaded)} do not fit this worker's memory partition: their "
            f"weights ({sizes}) and the activation budget ({_mib(activation_bytes)}: "
            f"max_batch_bytes per inference lane) need {_mib(need)}, above the partition of "
            f"{_mib(part)} ({where}); serve them on separate workers (fleet worker --models) "
            f"or raise memory_fraction"
        )
    return need


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
