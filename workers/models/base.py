"""The model adapter interface every modality implements.

A request goes through three calls, on two threads:

1. ``prepare(inputs)`` on the worker's event-loop thread as soon as the message is in the
   prefetch window. Cheap checks and the bucket key only (a text is tokenized here so the
   batcher can bucket by token length). Raises :class:`shared.errors.InvalidInput` (or a
   subclass) for bad input; the request then fails alone, at once.
2. ``preprocess(prepared)`` on the inference thread, per request, just before its batch
   runs (image decode, resize). A :class:`~shared.errors.FleetError` fails that request alone.
3. ``run_batch(samples)`` on the inference thread, once per batch, under
   ``torch.inference_mode()`` on the worker's device and stream. Returns one JSON-able dict
   per sample, in order. An exception here is a batch fault; the engine bisects the batch to
   find the request that causes it, so one poison input fails alone.

Adapters never import Celery; the engine owns messages, acks and results.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from shared.model_kinds import ModelOptions
    from shared.settings import Settings
    from workers.models.runtime import DeviceRuntime
    from workers.models.tensors import TensorIO


@dataclass(frozen=True, slots=True)
class Prepared:
    """A validated request, ready to be bucketed.

    Attributes:
        bucket: batches only form inside one bucket (text: the token-length bucket, e.g.
            ``"len32"``; image: ``"224"``).
        length: the request's own size inside its bucket (text: tokens); used to pad a
            batch only to its longest member.
        nbytes: estimated bytes this request adds to a batch's staging tensors.
        payload: adapter-private data for ``preprocess``.
    """

    bucket: str
    length: int
    nbytes: int
    payload: Any = field(repr=False)


def require_loaded(model: Any, name: str) -> Any:
    """``model``, or :class:`~shared.errors.ModelError` if :meth:`ModelAdapter.load` has not
    set it yet (``run_batch`` before ``load``)."""
    if model is None:
        from shared.errors import ModelError

        raise ModelError(f"model {name!r}: run_batch called before load()")
    return model


def check_pixel_shapes(pixels: list[Any], want: tuple[int, ...]) -> None:
    """Raise :class:`~shared.errors.ModelError` for the first array not of shape ``want``
    (a preprocessed image is float32 ``(3, S, S)``)."""
    from shared.errors import ModelError

    for i, p in enumerate(pixels):
        if getattr(p, "shape", None) != want:
            got = getattr(p, "shape", type(p).__name__)
            raise ModelError(f"sample {i} has shape {got}, expected {want}")


class ModelAdapter(ABC):
    """Base class: one model serving one modality in one worker process.

    ``options_type`` is the options model of the kind it serves (``shared.model_kinds``):
    ``cfg`` is an instance of it. ``reports_progress``: the adapter calls
    :meth:`report_progress` (the engine routes its reports only then); ``tensor_inputs``: a
    request's inputs may hold /dev/shm refs (the engine renews their leases only then).
    """

    modality: str = ""
    reports_progress: ClassVar[bool] = False
    tensor_inputs: ClassVar[bool] = True
    tensors: TensorIO | None = None  # set by adapters whose outputs may go to /dev/shm
    options_type: ClassVar[type[ModelOptions]]

    def __init__(self, cfg: ModelOptions, settings: Settings, runtime: DeviceRuntime) -> None:
        self.cfg = cfg
        self.settings = settings
        self.runtime = runtime
        self._local = threading.local()  # each inference thread (lane) has its own sink

    @property
    def progress_sink(self) -> Callable[[int, int, int], None] | None:
        return getattr(self._local, "sink", None)

    @progress_sink.setter
    def progress_sink(self, sink: Callable[[int, int, int], None] | None) -> None:
        self._local.sink = sink

    def report_progress(self, index: int, done: int, total: int) -> None:
        """Report progress of a long request (e.g. video frames embedded so far).

        Call from ``preprocess`` (``index`` 0) or ``run_batch`` (``index`` = the sample's
        position in ``samples``). The engine turns it into a ``PROGRESS`` state in the result
        backend and a ``task-progress`` event (rate-limited); a no-op outside a worker.
        """
        if self.progress_sink is not None:
            self.progress_sink(index, done, total)

    def discard(self, results: list[dict[str, Any]]) -> None:
        """Release what ``results`` hold outside themselves when no client will read them
        (the engine's warmup runs): the /dev/shm segments of their tensor outputs. A client
        releases the segments of the results it reads; nothing else would release these
        before their lifetime ends."""
        if self.tensors is None:
            return
        from shared.tensor_wire import SHM, iter_wires

        self.tensors.release_all(list(iter_wires(results, SHM)))

    @abstractmethod
    def load(self) -> None:
        """Load weights onto ``self.runtime.device``. Called once, in the worker process."""

    @abstractmethod
    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        """Validate a request's inputs cheaply and bucket it. Raises InvalidInput."""

    def prepare_for(self, model: str | None, inputs: dict[str, Any]) -> Prepared:
        """:meth:`prepare` of a request naming ``model`` (a ``[models.<name>]`` table;
        ``None``: the modality's default). One adapter serves one model, which admission
        checked already; ``workers.models.model_set.ModelSet`` routes by it."""
        return self.prepare(inputs)

    def preprocess(self, prepared: Prepared) -> Any:
        """Turn a prepared request into a model-ready sample. Default: the payload."""
        return prepared.payload

    @abstractmethod
    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        """Run one batch; one JSON-able dict per sample, in order."""

    @abstractmethod
    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        """Real-shaped inputs for warmup: ``batch_size`` requests (in ``bucket`` if given)."""

    def torch_modules(self) -> list[Any]:
        """The ``torch.nn.Module`` objects this adapter runs (its attributes that are
        modules); the runtime puts its lane yield points in them."""
        import torch

        return [v for v in vars(self).values() if isinstance(v, torch.nn.Module)]

    def buckets(self) -> list[str]:
        """Every bucket key this adapter can produce (warmup runs each)."""
        return ["default"]

    def describe(self) -> dict[str, Any]:
        """Model facts for the startup log and stats (name, dims, weights source)."""
        return {"modality": self.modality, "kind": self.cfg.kind}
