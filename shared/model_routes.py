"""Which models a modality serves, what a request's model name means, and where it travels.

A modality serves its default model (``[modalities.<m>] model``) and the tables its
``models`` list names. Each is a ``[models.<table>]`` table answering to a *served name*
(its ``served_name``, else the table's own name) and a *version* (``version``, default
``"1"``): two tables may be versions 1 and 2 of one served name.

A request names a model by served name (or by table name), with or without a version
(:func:`resolve`): no model = the modality's default; a served name without a version = its
highest version (Triton's default version policy, ``latest``); anything else is refused
``MODEL_NOT_FOUND``. The envelope then carries the table name (``TaskEnvelope.model``), which
workers, queues, liveness and metrics key by.

Queues: the default model keeps the modality's own queues (``text``, ``text.realtime``), so
a producer that names no model (celery-node, an older client) reaches it unchanged; every
other model has a pair of its own, ``text@<table>`` and ``text@<table>.realtime``
(``shared.schema.model_queue_name``). A worker consumes the queues of the models it serves,
so a worker serving one model never sees another's requests, and a queue's length is its
model's demand (``docs/decisions.md``, "Routing by model": why a queue per model and not
one queue per modality with per-model batches).

Pure logic: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared import schema
from shared.errors import ModelNotFound
from shared.settings import MODALITIES, Settings

__all__ = [
    "Routes",
    "ServedModel",
    "catalog",
    "pick",
    "resolve",
    "served_by_name",
    "worker_models",
    "worker_queues",
]


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model a modality serves.

    Attributes:
        table: its ``[models.<table>]`` name (what envelopes, queues and metrics carry).
        name: the name requests use (``served_name``, else ``table``).
        version: its version (digits).
        modality: the modality serving it.
        default: the modality's default model (its queues are the modality's own).
        kind: its model kind.
    """

    table: str
    name: str
    version: str
    modality: str
    default: bool
    kind: str = ""

    @property
    def queue(self) -> str:
        """Its queue for every class but REALTIME."""
        return schema.model_queue_name(self.modality, None if self.default else self.table)

    @property
    def realtime_queue(self) -> str:
        return schema.realtime_queue_name(self.queue)

    @property
    def route_model(self) -> str | None:
        """The model part of its queue names (``None``: the modality's own queues)."""
        return None if self.default else self.table


def catalog(settings: Settings, modality: str) -> list[ServedModel]:
    """The models ``modality`` serves, its default first, then its ``models`` in order.
    A table that is not configured is left out (the worker refuses to start on it)."""
    cfg = settings.modalities.get(modality)
    if cfg is None:
        return []
    out: list[ServedModel] = []
    for table in dict.fromkeys([cfg.model, *cfg.models]):
        opts = settings.models.get(table)
        if opts is None:
            continue
        name = opts.served_name or table
        out.append(ServedModel(table, name, opts.version, modality, table == cfg.model, opts.kind))
    return out


def served_by_name(models: Iterable[ServedModel]) -> dict[str, list[ServedModel]]:
    """Served name -> its versions, highest first."""
    out: dict[str, list[ServedModel]] = {}
    for m in models:
        out.setdefault(m.name, []).append(m)
    for versions in out.values():
        versions.sort(key=lambda m: int(m.version), reverse=True)
    return out


def pick(models: list[ServedModel], name: str | None, version: str | None = None) -> ServedModel:
    """The model of ``models`` (one modality's :func:`catalog`) that ``name`` and ``version``
    name: no name = the default (at ``version`` if given, among the default's versions); a
    served name = that version, else its highest; else a table name (at its own version).

    Raises:
        ModelNotFound: nothing answers to it (the message lists what is served).
    """
    if version is not None:
        version = str(version)
    if not models:
        raise ModelNotFound(f"no model is served for {name or 'this modality'!r}")
    if name is None:
        default = next((m for m in models if m.default), models[0])
        if version is None or version == default.version:
            return default
        name = default.name
    by_name = served_by_name(models)
    versions = by_name.get(name)
    if versions is None:
        versions = [m for m in models if m.table == name]
    if versions:
        if version is None:
            return versions[0]
        for m in versions:
            if m.version == version:
                return m
        have = ", ".join(m.version for m in versions)
        raise ModelNotFound(f"model {name!r} has no version {version!r} (versions: {have})")
    modality = models[0].modality
    raise ModelNotFound(f"unknown model {name!r} for {modality}; served: {_list(by_name)}")


def resolve(
    settings: Settings, modality: str, name: str | None, version: str | None = None
) -> ServedModel:
    """:func:`pick` among the models ``modality`` serves (raises as it does)."""
    models = catalog(settings, modality)
    if not models:
        raise ModelNotFound(f"modality {modality!r} serves no configured model")
    return pick(models, name, version)


def _list(by_name: dict[str, list[ServedModel]]) -> str:
    return ", ".join(
        f"{n} (version{'s' if len(v) > 1 else ''} {', '.join(m.version for m in v)})"
        for n, v in sorted(by_name.items())
    )


def worker_models(settings: Settings, modality: str, wanted: str = "") -> list[ServedModel]:
    """The models a worker of ``modality`` serves: ``wanted`` (comma-separated table names,
    ``fleet worker --models``) or, when empty, every model the modality serves.

    Raises:
        ModelNotFound: ``wanted`` names a table the modality does not serve.
    """
    models = catalog(settings, modality)
    names = [w.strip() for w in wanted.split(",") if w.strip()]
    if not names:
        return models
    tables = {m.table: m for m in models}
    unknown = [n for n in names if n not in tables]
    if unknown:
        served = ", ".join(tables) or "none"
        raise ModelNotFound(
            f"--models names {unknown[0]!r}, not a model the {modality} modality serves "
            f"(its [modalities.{modality}] model and models: {served})"
        )
    return [tables[n] for n in dict.fromkeys(names)]


def worker_queues(
    models: Iterable[ServedModel], realtime_apart: bool
) -> tuple[list[str], list[str]]:
    """``(main queues, REALTIME queues)`` a worker serving ``models`` consumes; without a
    REALTIME lane (``realtime_apart`` false) the REALTIME queues are among the main ones."""
    models = list(models)
    main = [m.queue for m in models]
    realtime = [m.realtime_queue for m in models]
    if realtime_apart:
        return main, realtime
    return [q for m in models for q in (m.queue, m.realtime_queue)], []


class Routes:
    """A producer's routing table for one (frozen) settings: which model a request reaches
    and which queue and Celery priority its message takes. Made once per settings and kept
    by the client, so a submit looks routes up instead of walking the settings.
    """

    #: resolved (modality, name, version) triples kept at most (names come from callers)
    MAX_RESOLVED = 1024

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        prios = {p.label: p.celery_priority(settings) for p in schema.Priority}
        #: (modality, priority label, model table or ``None``: the default) -> (queue,
        #: Celery priority), for every triple
        self.queues: dict[tuple[str, str, str | None], tuple[str, int]] = {}
        self._route_models: dict[tuple[str, str], str | None] = {}
        for modality in MODALITIES:
            models: list[tuple[str | None, str | None]] = [(None, None)]
            for m in catalog(settings, modality):
                models.append((m.table, m.route_model))
                self._route_models[(modality, m.table)] = m.route_model
            for table, route in models:
                for label, prio in prios.items():
                    queue = schema.queue_for(modality, label, route)
                    self.queues[(modality, label, table)] = (queue, prio)
        self._resolved: dict[tuple[str, str | None, str | None], ServedModel] = {}

    def served(
        self, modality: str, model: str | None = None, version: str | None = None
    ) -> ServedModel:
        """The model a request of ``modality`` naming ``model``/``version`` reaches
        (:func:`resolve`).

        Raises:
            ModelNotFound: the modality serves no such model (or version).
        """
        key = (modality, model, version)
        found = self._resolved.get(key)
        if found is None:
            found = resolve(self.settings, modality, model, version)
            if len(self._resolved) < self.MAX_RESOLVED:
                self._resolved[key] = found
        return found

    def route_model(self, modality: str, table: str) -> str | None:
        """The model part of the queue names of ``modality``'s model ``table`` (a
        ``[models.<name>]`` table, as envelopes carry it; ``None``: the modality's own
        queues).

        Raises:
            ModelNotFound: the modality serves no such table.
        """
        key = (modality, table)
        if key in self._route_models:
            return self._route_models[key]
        return self.served(modality, table).route_model
