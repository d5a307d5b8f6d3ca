"""Typed fleet settings: ``configs/fleet.toml`` with ``FLEET_*`` environment overrides.

Sources, highest first: keyword arguments to :func:`load_settings`, environment variables
(``FLEET_REDIS__PORT=6400``; nested keys joined by ``__``), ``FLEET_REDIS_URL`` (the
``[redis]`` keys its ``redis://`` or ``sentinel://`` URL names: :func:`url_fields`), the TOML
file named by ``FLEET_CONFIG`` (one file or several joined by ``:``, deep-merged in
order; default ``configs/fleet.toml`` under the current directory or the nearest directory
above it that holds one, then the one beside this package's source tree in a checkout, else
the copy of it packaged in the wheel), then the defaults below.

Model names in environment variables: a shell variable name cannot hold ``-``, so in a
``FLEET_MODELS__<NAME>__<KEY>`` override ``_`` stands for ``-`` (and case does not matter):
``FLEET_MODELS__RESNET18_RANDOM__CHECKPOINT=/weights/resnet`` sets ``checkpoint`` of
``[models.resnet18-random]``. An override entry without ``kind`` must name a configured model.

The run directory (``[stack] run_dir``, default ``.run``): an absolute path is used as is; a
relative one given in ``FLEET_STACK__RUN_DIR`` is relative to the current directory; else
it is relative to the project root (the nearest directory at or above the current one with
``configs/fleet.toml`` and ``pyproject.toml``, else this package's own source tree when it is
a writable checkout), else ``$XDG_STATE_HOME/mmfleet/run`` (``~/.local/state/mmfleet/run``).
:attr:`Settings.run_dir_source` says which was used.

Secrets (Redis and Flower passwords) are never in the TOML file: they come from the
environment or from files under ``stack.run_dir`` that ``fleet up`` creates with mode 0600.

Modules: this one holds the sections, :class:`Settings` and :func:`load_settings`;
``shared.settings.redis`` the ``[redis]`` section and the credentials and URLs derived from it
(mixed into :class:`Settings`); ``shared.settings.paths`` the config files, the run directory
and secret files. Import every name from here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from shared.model_kinds import AnyModelOptions
from shared.settings.paths import (
    REPO_CONFIG,
    config_paths,
    ensure_secret,
    locate_run_dir,
    project_root,
    user_run_dir,
)
from shared.settings.redis import RedisAccess, RedisSettings, url_fields

__all__ = [
    "DELIVERIES_COVERED",
    "MIN_TTL_JANITOR_INTERVALS",
    "MODALITIES",
    "PRIORITY_NAMES",
    "REDIS_URL_VARIABLE",
    "BatchingConfig",
    "DebugSettings",
    "DeviceConfig",
    "EventSettings",
    "FlowerSettings",
    "GatewaySettings",
    "Limits",
    "MetricsSettings",
    "ModalityConfig",
    "PriorityClass",
    "RedisSettings",
    "Settings",
    "StackSettings",
    "TracingSettings",
    "TransportSettings",
    "config_paths",
    "ensure_secret",
    "load_settings",
    "locate_run_dir",
    "merge_model_aliases",
    "project_root",
    "url_fields",
    "user_run_dir",
]

MODALITIES: tuple[str, ...] = ("text", "image", "video", "xmodal")
PRIORITY_NAMES: tuple[str, ...] = ("realtime", "high", "normal", "bulk")
# A poison message is refused on its 4th delivery (workers.batching.admission.MAX_DELIVERIES + 1).
DELIVERIES_COVERED = 4
# A renewed tensor lease must outlast a janitor's renewal margin (shared.transport.lifetime:
# 2 intervals) by one interval: default_ttl_s >= this many janitor intervals.
MIN_TTL_JANITOR_INTERVALS = 3


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StackSettings(_Section):
    run_dir: Path = Path(".run")
    ready_timeout_s: float = 180.0


class FlowerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = 5555
    user: str = "fleet"
    password: str | None = None


class GatewaySettings(_Section):
    """The HTTP gateway (``fleet gateway``, ``producer.gateway``): OIP v2 REST over the fleet."""

    host: str = "127.0.0.1"  # loopback by default
    port: int = Field(default=8000, ge=0, le=65535)
    token: str | None = None  # else <run_dir>/gateway.token (0600), created on first start
    default_wait_s: float = Field(default=30.0, gt=0.0)  # sync infer without Prefer/deadline
    max_wait_s: float = Field(default=300.0, gt=0.0)  # the longest Prefer: wait=N honoured
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)  # larger: 413
    publish_threads: int = Field(default=4, ge=1)  # /dev/shm work, large inputs: off the loop
    live_cache_s: float = Field(default=1.0, ge=0.0)  # live_workers answers kept this long
    # Admission: refuse DEADLINE_UNREACHABLE only when even `admission_safety` times the
    # measured service rate cannot drain the queue ahead before the deadline.
    admission: bool = True
    admission_window_s: float = Field(default=10.0, gt=0.0)
    admission_min_samples: int = Field(default=32, ge=1)
    admission_safety: float = Field(default=2.0, ge=1.0)
    retry_after_s: int = Field(default=1, ge=1)  # Retry-After on 429 / 503
    sse_interval_s: float = Field(default=0.25, gt=0.0)  # /events: checks for a gone client


class PriorityClass(_Section):
    """A priority class: its Celery priority (0 runs first) and default timeout in seconds."""

    celery_priority: int = Field(ge=0, le=9)
    timeout_s: float = Field(ge=0.0)  # 0 means no deadline


class Limits(_Section):
    max_inline_bytes: int = 8 * 1024 * 1024
    max_text_chars: int = 20_000
    max_image_pixels: int = 40_000_000


class BatchingConfig(_Section):
    """Dynamic batching knobs (names as in Triton's ``dynamic_batching`` block)."""

    max_batch_size: int = Field(default=8, ge=1)
    preferred_batch_sizes: list[int] = Field(default_factory=lambda: [1])
    max_queue_delay_ms: float = Field(default=2.0, ge=0.0)
    length_buckets: list[int] = Field(default_factory=list)
    max_batch_bytes: int = 256 * 1024 * 1024
    max_high_waiting: int = 5
    realtime_lane: bool = False  # a second inference thread serves REALTIME requests alone
    realtime_prefetch: int = 16  # the REALTIME queue's own prefetch window (with the lane)
    realtime_budget_ms: float = 25.0  # without the lane: batch time cap while REALTIME flows
    # Buckets (shortest first) warmed before the worker says ready; the rest are warmed by
    # the idle main inference thread afterwards (workers/batching/batcher.py). A large number warms
    # all.
    warmup_buckets_before_ready: int = Field(default=2, ge=0)


class DeviceConfig(_Section):
    device: str = "cpu"
    torch_threads: int = Field(default=1, ge=1)
    interop_threads: int = Field(default=1, ge=1)
    memory_fraction: float = Field(default=0.4, gt=0.0, le=1.0)
    arena_mb: int = 64
    prefetch_multiplier: int = Field(default=16, ge=1)
    # Messages a batching worker takes from Redis per round trip, up to the window's free
    # slots (workers.consumer.channel; 1 = kombu's one BRPOP per message).
    fetch_limit: int = Field(default=64, ge=1)
    # sys.setswitchinterval for the worker process (CPython's default is 5 ms). The event
    # loop, the main and the REALTIME inference threads share the GIL; an inference thread
    # coming back from a GIL-free torch op waits up to one interval for the GIL; a shorter
    # one gives back most of that wait (see docs/decisions.md, "GIL switch interval").
    gil_switch_interval_ms: float = Field(default=0.5, gt=0.0, le=100.0)
    # With a REALTIME lane: the main lane's inference thread runs at this nice value, so a
    # core it shares with the REALTIME lane or the event loop goes to them first: a lower
    # REALTIME p99 for about the same BULK drain (see docs/decisions.md, "Main-lane nice").
    # Raising nice needs no privilege.
    main_lane_nice: int = Field(default=5, ge=0, le=19)
    # With a REALTIME lane, while REALTIME traffic flows: the main lane's batches run on a
    # thread of Linux's SCHED_IDLE class, which any normal thread (the REALTIME lane, the
    # event loop, Redis) preempts at once (workers.batching.batcher.IdleRunner). Needs no privilege.
    # Meanwhile any other busy process of normal class on the same cores starves BULK work:
    # turn it off where the worker shares its cores with such a process.
    main_lane_idle_while_realtime: bool = True


class TransportSettings(_Section):
    """Tensor transport through /dev/shm (see ``shared.transport``)."""

    shm_root: Path | None = None  # None: /dev/shm/mmfleet-<uid>
    capacity_bytes: int | None = Field(default=None, ge=0)  # None: capacity_fraction of /dev/shm
    capacity_fraction: float = Field(default=0.5, gt=0.0, le=1.0)
    default_ttl_s: float = Field(default=600.0, gt=0.0)
    shared_host: bool = True  # False: producers and workers on different hosts, inline only
    min_shm_warn_bytes: int = 256 * 1024 * 1024
    # Keep released files >= 1 MiB (this many bytes in all) and write later segments into
    # them: no new tmpfs pages per tensor (see shared.transport.pool); 0 off.
    recycle_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    # Workers keep their mappings of files a recycling producer will rewrite (page tables
    # ready for the next segment in the same file); 0 off. See shared.transport.mapcache.
    reader_cache_bytes: int = Field(default=512 * 1024 * 1024, ge=0)
    # Every worker reclaims expired, orphaned and idle files this often (workers.janitor),
    # after renewing the leases of inputs whose requests may still run; 0 turns both off.
    janitor_interval_s: float = Field(default=10.0, ge=0.0)
    # An input bound to a request (a video sent by FleetClient or the gateway) lives while its
    # request may still run (renewed by TTLs: shared.transport.lifetime), but never longer
    # than this after it was written: a segment whose request never ends still goes.
    max_ref_lifetime_s: float = Field(default=86400.0, gt=0.0)


class MetricsSettings(_Section):
    # false: workers record no metrics at all (a null implementation, no registry work) and
    # serve no /metrics, whatever port_base says; the exporter has its own exporter_port
    enabled: bool = True
    host: str = "127.0.0.1"
    port_base: int = 9101  # worker ports: base + modality index; 0: no /metrics (still recorded)
    # `fleet exporter` (queue length, demand, age; producer.ops.exporter), started by `fleet up`
    exporter_host: str = "127.0.0.1"
    exporter_port: int = Field(default=9100, ge=0, le=65535)  # 0: not started


class TracingSettings(_Section):
    """OpenTelemetry tracing (``shared.tracing``): on when an endpoint or a file is set."""

    otlp_endpoint: str = ""  # e.g. http://127.0.0.1:4318/v1/traces (OTLP over HTTP)
    file: str = ""  # one JSON span per line, appended (tests, offline reading)
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)  # traces sampled at their root


class EventSettings(_Section):
    """Celery task events (Flower's view) sent by batching workers
    (``workers.consumer.engine``)."""

    # Buffered task events go out at most this often (one PUBLISH of a task.multi list),
    # instead of once per event-loop turn: a message's arrival no longer costs a round trip.
    flush_interval_ms: float = Field(default=25.0, ge=0.0, le=1000.0)
    buffer_limit: int = Field(default=128, ge=1)  # flush at once when this many are waiting


class DebugSettings(_Section):
    fault_injection: bool = False  # honour "_inject" inputs (tests and drills only)


# A tenant's name: it is part of Redis keys and list names (shared.tenants)
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class TenantConfig(_Section):
    """One tenant's share of the fleet (``[tenants.<name>]``; ``shared.tenants``)."""

    # queued-or-running requests beyond this many are refused TENANT_QUOTA; None: no limit
    # (and no counting: the tenant's requests cost Redis nothing more)
    max_queued: int | None = Field(default=None, ge=1)
    weight: float = Field(default=1.0, gt=0.0)  # its share within a priority class
    # a bearer token of the gateway bound to this tenant: requests it authenticates are this
    # tenant's, whatever their X-Fleet-Tenant header or parameters.tenant say
    gateway_token: str | None = Field(default=None, min_length=16)


class TenancySettings(_Section):
    """How tenants share a worker (``[tenancy]``; docs/tenants.md)."""

    # fair: batches by weighted fair share across tenants within a priority class, and each
    # [tenants.*] tenant's requests wait in lists of their own, taken in turns; fifo: one list
    # per priority step, batches in arrival order (what the fleet did before tenants)
    share: Literal["fair", "fifo"] = "fair"
    default_tenant: str = Field(default="default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ModalityConfig(_Section):
    model: str  # the default model: a request that names none (its queue is the modality's)
    # More [models.<name>] tables this modality serves, each on queues of its own
    # (shared.model_routes); a worker serves them all unless `fleet worker --models` says.
    models: list[str] = Field(default_factory=list)
    max_retries: int = 3  # transient faults only; bad input is never retried
    retry_backoff_s: float = 0.05  # doubles per attempt
    max_queue_length: int = 10_000  # all priorities together; QUEUE_FULL beyond it
    max_queue_length_by_priority: dict[str, int] = Field(default_factory=dict)
    circuit_threshold: int = 5  # consecutive failed batches that open the breaker
    circuit_cooldown_s: float = 10.0
    # On SIGTERM: the running batch and what the window holds run for up to this long;
    # the rest goes back to its queue at once (a deploy is not a crash).
    soft_shutdown_timeout_s: float = Field(default=30.0, ge=0.0)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)


class Settings(RedisAccess, BaseSettings):
    """All fleet settings. Build with :func:`load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix="FLEET_", env_nested_delimiter="__", extra="ignore", frozen=True
    )

    redis: RedisSettings = Field(default_factory=RedisSettings)
    stack: StackSettings = Field(default_factory=StackSettings)
    flower: FlowerSettings = Field(default_factory=FlowerSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    priorities: dict[str, PriorityClass] = Field(default_factory=dict)
    limits: Limits = Field(default_factory=Limits)
    transport: TransportSettings = Field(default_factory=TransportSettings)
    events: EventSettings = Field(default_factory=EventSettings)
    debug: DebugSettings = Field(default_factory=DebugSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    modalities: dict[str, ModalityConfig] = Field(default_factory=dict)
    tenancy: TenancySettings = Field(default_factory=TenancySettings)
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    # One table per model; its ``kind`` picks its typed options (shared.model_kinds).
    models: dict[str, AnyModelOptions] = Field(default_factory=dict)

    @field_validator("models", mode="before")
    @classmethod
    def _env_model_names(cls, v: Any) -> Any:
        """Merge ``FLEET_MODELS__RESNET18_RANDOM__...`` into ``[models.resnet18-random]``."""
        return merge_model_aliases(v) if isinstance(v, Mapping) else v

    @field_validator("priorities")
    @classmethod
    def _all_classes(cls, v: dict[str, PriorityClass]) -> dict[str, PriorityClass]:
        missing = set(PRIORITY_NAMES) - set(v)
        if missing:
            raise ValueError(f"priority classes missing from config: {sorted(missing)}")
        return v

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, v: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        bad = [name for name in v if not TENANT_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"tenant names must match {TENANT_NAME.pattern}: {bad}")
        return v

    @model_validator(mode="after")
    def _tensors_outlive_redeliveries(self) -> Settings:
        """A request's /dev/shm input must stay valid while the request may still run: up to
        ``DELIVERIES_COVERED`` deliveries, each returned up to ``lease_s`` after its worker
        died (a crash-redelivered video would otherwise fail ``TENSOR_REF_INVALID``)."""
        need = DELIVERIES_COVERED * self.redis.lease_s
        if self.transport.default_ttl_s < need:
            raise ValueError(
                f"[transport] default_ttl_s = {self.transport.default_ttl_s:g} s is shorter than "
                f"{DELIVERIES_COVERED} leases ([redis] lease_s = {self.redis.lease_s:g} s): a "
                f"request redelivered after a crash would find its tensors gone; raise "
                f"default_ttl_s to at least {need:g} or lower lease_s"
            )
        return self

    @model_validator(mode="after")
    def _tensor_leases_renewable(self) -> Settings:
        """A bound input's lease (its TTL, renewed by the janitors) must be renewed before it
        lapses, and the lifetime cap cannot be shorter than the TTL it caps."""
        t = self.transport
        if t.max_ref_lifetime_s < t.default_ttl_s:
            raise ValueError(
                f"[transport] max_ref_lifetime_s = {t.max_ref_lifetime_s:g} s is shorter than "
                f"default_ttl_s = {t.default_ttl_s:g} s: raise max_ref_lifetime_s to at least "
                f"{t.default_ttl_s:g}"
            )
        kept = self.redis.result_expires_s
        if 0 < kept < t.default_ttl_s:
            raise ValueError(
                f"[redis] result_expires_s = {kept} s is shorter than [transport] "
                f"default_ttl_s = {t.default_ttl_s:g} s: a finished request's marker "
                f"(fleet:final:<id>) would go before its input's last lease, and the janitors "
                f"would renew that input again; raise result_expires_s"
            )
        need = MIN_TTL_JANITOR_INTERVALS * t.janitor_interval_s
        if t.default_ttl_s < need:
            raise ValueError(
                f"[transport] default_ttl_s = {t.default_ttl_s:g} s is shorter than "
                f"{MIN_TTL_JANITOR_INTERVALS} janitor intervals (janitor_interval_s = "
                f"{t.janitor_interval_s:g} s): a queued request's input could lapse between "
                f"two renewals; lower janitor_interval_s to at most "
                f"{t.default_ttl_s / MIN_TTL_JANITOR_INTERVALS:g} or raise default_ttl_s to "
                f"at least {need:g}"
            )
        return self

    @model_validator(mode="after")
    def _served_models_known(self) -> Settings:
        """Each table a modality's ``models`` lists exists, and no two of its tables share a
        served name and version (a request could not say which it means)."""
        for modality, cfg in self.modalities.items():
            seen: dict[tuple[str, str], str] = {}
            for key in dict.fromkeys([cfg.model, *cfg.models]):
                opts = self.models.get(key)
                if opts is None:
                    if key == cfg.model:
                        continue  # the default model: checked where it is loaded
                    known = ", ".join(sorted(self.models)) or "none"
                    raise ValueError(
                        f"[modalities.{modality}] models names {key!r}, which is no "
                        f"[models.<name>] table (configured: {known})"
                    )
                served = (opts.served_name or key, opts.version)
                if served in seen:
                    raise ValueError(
                        f"[modalities.{modality}]: [models.{seen[served]}] and [models.{key}] "
                        f"are both {served[0]!r} version {served[1]}; give one another version"
                    )
                seen[served] = key
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = TomlConfigSettingsSource(settings_cls, toml_file=config_paths(), deep_merge=True)
        return (init_settings, env_settings, RedisUrlSource(settings_cls), toml)

    # -- derived values ---------------------------------------------------------------
    @cached_property
    def _located_run_dir(self) -> tuple[Path, str]:
        return locate_run_dir(
            self.stack.run_dir,
            explicit="FLEET_STACK__RUN_DIR" in {k.upper() for k in os.environ},
            cwd=Path.cwd(),
            package_root=REPO_CONFIG.parent.parent,
            user_dir=user_run_dir(os.environ),
        )

    @property
    def run_dir(self) -> Path:
        """The stack's run directory, absolute (see the module docstring for how it is found)."""
        return self._located_run_dir[0]

    @property
    def run_dir_source(self) -> str:
        """Where :attr:`run_dir` came from, in words (for messages)."""
        return self._located_run_dir[1]

    def gateway_token(self) -> str:
        """The gateway's bearer token: ``FLEET_GATEWAY__TOKEN``, else ``<run_dir>/gateway.token``
        (created with mode 0600 on first use, like the Redis password)."""
        if self.gateway.token:
            return self.gateway.token
        return ensure_secret(self.run_dir / "gateway.token")

    def flower_password(self) -> str:
        if self.flower.password:
            return self.flower.password
        return (self.run_dir / "flower.password").read_text().strip()

    def modality(self, name: str) -> ModalityConfig:
        """The config of one modality.

        Raises:
            KeyError: the modality is not configured.
        """
        return self.modalities[name]


REDIS_URL_VARIABLE = "FLEET_REDIS_URL"


"""The variable whose URL names the fleet's Redis (:class:`RedisUrlSource`)."""


_URL_VARIABLE = TypeAdapter(
    dict[str, Annotated[dict[str, Any], BeforeValidator(url_fields)]],
    config=ConfigDict(hide_input_in_errors=True),  # the URL may hold a password
)


class RedisUrlSource(PydanticBaseSettingsSource):
    """``FLEET_REDIS_URL`` (any case): the ``[redis]`` keys its URL names
    (:func:`shared.settings.redis.url_fields`: host, port, db, credentials; or the sentinels,
    the master name and the sentinels' password). Below the ``FLEET_REDIS__<KEY>``
    variables (a key one of them sets wins), above the TOML files.

    Raises:
        pydantic.ValidationError: a URL :func:`url_fields` refuses (its location the variable).
    """

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # the whole source is read at once (__call__)

    def __call__(self) -> dict[str, Any]:
        url = next((v for k, v in os.environ.items() if k.upper() == REDIS_URL_VARIABLE), None)
        if not url:
            return {}
        fields = _URL_VARIABLE.validate_python({REDIS_URL_VARIABLE: url})
        return {"redis": fields[REDIS_URL_VARIABLE]}


def _norm_model_name(name: str) -> str:
    return name.replace("-", "_").lower()


def merge_model_aliases(models: Mapping[str, Any]) -> dict[str, Any]:
    """Fold override entries into the model they name, ``-`` and ``_`` being equivalent.

    An entry with ``kind`` defines a model; an entry without one (what an environment
    variable such as ``FLEET_MODELS__RESNET18_RANDOM__CHECKPOINT`` produces) overrides keys
    of the defined model whose name matches it up to ``-``/``_`` and case; its values win.

    Raises:
        ValueError: an override matches no defined model, or two defined models have names
            that differ only in ``-``/``_`` or case.
    """
    defined: dict[str, str] = {}
    for name, entry in models.items():
        if not isinstance(entry, Mapping) or "kind" in entry:
            key = _norm_model_name(name)
            if key in defined and defined[key] != name:
                raise ValueError(
                    f"models {defined[key]!r} and {name!r} differ only in '-'/'_' or case"
                )
            defined[key] = name
    out: dict[str, Any] = {n: e for n, e in models.items() if _norm_model_name(n) in defined}
    for name, entry in models.items():
        target = defined.get(_norm_model_name(name))
        if target is None:
            known = ", ".join(sorted(defined.values())) or "none"
            raise ValueError(
                f"model override {name!r} names no configured model (configured: {known}); "
                f"in FLEET_MODELS__<NAME>__<KEY>, write the name with '_' for '-'"
            )
        if target != name:
            out[target] = _deep_merge(dict(out[target]), entry)
            out.pop(name, None)
    return out


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), Mapping):
            base[k] = _deep_merge(dict(base[k]), v)
        else:
            base[k] = v
    return base


def load_settings(**overrides: Any) -> Settings:
    """Load settings from the TOML file and environment; ``overrides`` win over both."""
    return Settings(**overrides)
