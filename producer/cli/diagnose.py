"""Why the stack or broker is not usable, in one or two lines with the fix (exit 3).

:func:`broker_problem` connects once (:func:`probe_client`: a 0.5 s connect timeout, 2 s
for an answer, no retries, so an unreachable Redis is reported at once) with the
credentials a command would use and tells apart: no stack started in the run dir (no
password file), nothing listening (connection refused), credentials refused
(authentication: the message names where the password came from), an address that answers
but not as Redis (another service's port), no answer (timeout). The wording is
:func:`broker_message`'s, pure logic, unit-tested.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from producer.cli.base import CliProblem, ExitCode
from shared.settings import MODALITIES, REDIS_URL_VARIABLE, Settings

NOT_STARTED = "not-started"
REFUSED = "refused"
AUTH = "auth"
NOT_REDIS = "not-redis"
TIMEOUT = "timeout"
OTHER = "other"
# Redis answers and refuses (shared.redis_refusal): each kind is its BrokerUnavailable reason
OOM, MISCONF, READONLY, NOPERM = "OOM", "MISCONF", "READONLY", "NOPERM"
REFUSING = (OOM, MISCONF, READONLY, NOPERM)


def broker_message(
    kind: str,
    *,
    address: str,
    run_dir: str,
    run_dir_from: str,
    user: str | None = None,
    password_from: str = "",
    redis_pid_alive: bool | None = None,
    detail: str = "",
) -> str:
    """The message for a failure of ``kind`` (one of the module's constants);
    ``password_from`` names where a password set for the fleet came from
    (:func:`password_source`), empty when it is the stack's password file."""
    where = f"{run_dir} ({run_dir_from})"
    if kind == NOT_STARTED:
        return (
            f"no stack has been started in the run dir {where}: it holds no Redis password.\n"
            "  start one with `make up` (or `fleet up`), or set FLEET_STACK__RUN_DIR to the run "
            "dir of a running stack (FLEET_REDIS__PASSWORD for an external Redis)"
        )
    if kind == AUTH:
        who = f"user {user!r}" if user else "the default user"
        fix = (
            f"the password in {password_from} does not match: fix it, or leave it out to use "
            f"the stack's password files in {run_dir}"
            if password_from
            else f"the password files in {where} are not this Redis's: `fleet down` and "
            "`fleet up` again, or point FLEET_STACK__RUN_DIR at the stack's own run dir"
        )
        return (
            f"Redis at {address} refused the credentials of {who} (authentication failed).\n  {fix}"
        )
    if kind == REFUSED:
        if redis_pid_alive is False:
            state = f"the stack's Redis in {where} is not running (see its logs/redis.log)"
        else:
            state = f"no stack is up there (run dir {where})"
        return (
            f"cannot reach Redis at {address}: connection refused; {state}.\n"
            "  start it with `make up` (or `fleet up`); if it runs elsewhere, set "
            "FLEET_REDIS__HOST / FLEET_REDIS__PORT"
        )
    if kind == NOT_REDIS:
        return (
            f"the address {address} answers but is not Redis ({detail}).\n"
            "  check the port: FLEET_REDIS__PORT / FLEET_REDIS__HOST, or the port in "
            f"{REDIS_URL_VARIABLE} (`fleet status` shows the stack's Redis)"
        )
    if kind == TIMEOUT:
        return (
            f"Redis at {address} did not answer in time ({detail}).\n"
            "  is it stopped (SIGSTOP) or overloaded? `fleet status` shows the stack's processes"
        )
    if kind in REFUSING:
        return refusal_message(kind, address=address, run_dir=run_dir, user=user, detail=detail)
    return f"Redis at {address} is not usable: {detail}\n  `fleet status` shows the stack"


def refusal_message(
    kind: str, *, address: str, run_dir: str, user: str | None = None, detail: str = ""
) -> str:
    """Redis answers and refuses (``kind`` in :data:`REFUSING`): what, and what frees it.
    Nothing was sent: the same command again succeeds once the cause is gone."""
    said = f" ({detail})" if detail else ""
    if kind == OOM:
        return (
            f"Redis at {address} is out of memory and refuses writes{said}; nothing was sent.\n"
            "  let the workers drain the queues, or raise its maxmemory (redis.conf, or "
            "CONFIG SET maxmemory as its admin); `fleet status` shows the stack"
        )
    if kind == MISCONF:
        return (
            f"Redis at {address} cannot persist and refuses writes{said}; nothing was sent.\n"
            f"  free space on the disk under its data directory ({run_dir}/redis for a local "
            "stack; its log says which file); it accepts writes again by itself"
        )
    if kind == READONLY:
        return (
            f"Redis at {address} is a read-only replica and refuses writes{said}; nothing was "
            "sent.\n  point FLEET_REDIS__HOST / FLEET_REDIS__PORT at the primary (behind "
            "Sentinel: FLEET_REDIS__SENTINELS), or promote it (REPLICAOF NO ONE)"
        )
    who = f"user {user!r}" if user else "this user"
    return (
        f"Redis at {address} denies a command to {who} (an ACL rule){said}; nothing was sent.\n"
        "  restore the role's rules (shared/acl.py): `fleet down` and `fleet up` write them "
        "again; for an external Redis, fix its ACL file"
    )


def classify(exc: BaseException) -> str:
    """The kind of a Redis failure (redis-py and kombu exceptions, ``BrokerUnavailable``): a
    refusal (:data:`REFUSING`) or a connection failure."""
    import redis

    from shared.redis_refusal import reason_of

    reason = reason_of(exc)
    if reason in REFUSING:
        return str(reason)
    if reason == "AUTH":
        return AUTH
    if reason == "NOT_REDIS":
        return NOT_REDIS
    text = str(exc)
    if isinstance(exc, redis.AuthenticationError) or any(
        w in text for w in ("WRONGPASS", "NOAUTH", "invalid username-password", "AUTH")
    ):
        return AUTH
    if isinstance(exc, redis.TimeoutError | TimeoutError) or "timed out" in text.lower():
        return TIMEOUT
    if isinstance(exc, ConnectionRefusedError) or "refused" in text.lower():
        return REFUSED
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        kind = classify(cause)
        if kind != OTHER:
            return kind
    return OTHER


CONNECT_TIMEOUT_S = 0.5  # loopback or LAN: a connection takes milliseconds
ANSWER_TIMEOUT_S = 2.0


def probe_client(settings: Settings, user: str | None, password: str) -> Any:
    """A redis-py client for one-shot CLI probes: short timeouts and no retries (redis-py's
    default retries a refused connection with backoff for seconds)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    if settings.ha:
        from shared.redis_client import sentinel_master

        return sentinel_master(
            settings,
            user,
            password,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=ANSWER_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
    return redis.Redis(
        host=settings.redis.host,
        port=settings.redis.port,
        db=settings.redis.db,
        username=user,
        password=password,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=ANSWER_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),
    )


def password_source(settings: Settings, env: Any = None) -> str:
    """Where the fleet's Redis password came from, as the user set it: the variable
    (``FLEET_REDIS__PASSWORD`` wins over ``FLEET_REDIS_URL``'s password), else the config
    file's ``[redis] password``; ``""`` when none is set (the stack's password files)."""
    if not settings.redis.password:
        return ""
    from shared.settings.redis import url_fields

    env = os.environ if env is None else env
    names = {k.upper(): v for k, v in env.items()}
    if "FLEET_REDIS__PASSWORD" in names:
        return "FLEET_REDIS__PASSWORD"
    url = names.get(REDIS_URL_VARIABLE)
    if url:
        with contextlib.suppress(ValueError):
            if url_fields(url).get("password"):
                return REDIS_URL_VARIABLE
    return "the config file's [redis] password"


def broker_problem(settings: Settings, role: str = "producer") -> str | None:
    """Connect once as ``role`` and PING; ``None`` when Redis answers, else the message."""
    from producer.stack.local import Stack

    facts: dict[str, Any] = {
        "address": f"{settings.redis.host}:{settings.redis.port}",
        "run_dir": str(settings.run_dir),
        "run_dir_from": settings.run_dir_source,
        "password_from": password_source(settings),
    }
    try:
        user, password = settings.redis_credentials(role)
    except FileNotFoundError:
        return broker_message(NOT_STARTED, **facts)
    client = probe_client(settings, user, password)
    try:
        client.ping()
        return None
    except Exception as exc:
        kind = classify(exc)
        stack = Stack(settings)
        alive = stack.alive("redis") if (stack.pids / "redis.pid").exists() else None
        return broker_message(
            kind, user=user, redis_pid_alive=alive, detail=f"{type(exc).__name__}: {exc}", **facts
        )
    finally:
        client.close()


def require_broker(settings: Settings, role: str = "producer") -> None:
    """Raises:
    CliProblem: Redis is not usable with ``role``'s credentials (exit 3)."""
    problem = broker_problem(settings, role)
    if problem:
        raise CliProblem(problem, ExitCode.STACK)


def broker_lost(settings: Settings, exc: BaseException) -> CliProblem:
    """A broker error in the middle of a command (exit 3): a refusal says what Redis refused
    (a probe would pass: Redis answers ``PING`` out of memory), else diagnosed again."""
    from shared.redis_refusal import answer_of

    kind = classify(exc)
    if kind in REFUSING:
        user = None
        with contextlib.suppress(FileNotFoundError):
            user = settings.redis_credentials("producer")[0]
        message = refusal_message(
            kind,
            address=f"{settings.redis.host}:{settings.redis.port}",
            run_dir=str(settings.run_dir),
            user=user,
            detail=answer_of(exc),
        )
        return CliProblem(message, ExitCode.STACK)
    problem = broker_problem(settings) or (
        f"lost the connection to Redis at {settings.redis.host}:{settings.redis.port} "
        f"({type(exc).__name__}: {exc}); try again, or see `fleet status`"
    )
    return CliProblem(problem, ExitCode.STACK)


def broker_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the broker, not the request, failed (``BrokerUnavailable``
    first: it is a ``FleetError`` too)."""
    from kombu.exceptions import OperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import InvalidResponse, ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from shared.errors import BrokerUnavailable
    from shared.kombu_redis import CredentialsRefused

    return (
        BrokerUnavailable,
        OperationalError,
        RedisConnectionError,
        RedisTimeoutError,
        ResponseError,
        InvalidResponse,
        CredentialsRefused,
        ConnectionError,
    )


def no_worker_message(
    modality: str, live: dict[str, list[str]], queued: bool, model: str | None = None
) -> str:
    """Nobody consumes ``modality``'s queue (``model``: that model's, a table name): say
    so, what is live, and how to start one."""
    others = ", ".join(f"{m} ({len(n)})" for m, n in live.items() if n) or "none"
    then = (
        "queued anyway: it runs when a worker starts, unless its deadline passes first "
        "(--priority bulk has none; or set --timeout-s)"
        if queued
        else "not sent (pass --queue-anyway to queue it for a worker started later)"
    )
    if model is not None:
        return (
            f"no live worker serves model '{model}' of '{modality}' (live workers: {others}); "
            f"{then}.\n  start one: `fleet worker {modality} --models {model}`"
        )
    return (
        f"no live worker consumes the '{modality}' queue (live workers: {others}); {then}.\n"
        f"  start one: `fleet up --modalities {modality}` (or `fleet worker {modality}`)"
    )


def live_nodes(
    settings: Settings, client: Any, modality: str, model: str | None = None
) -> list[str]:
    """``modality``'s live worker nodes (fresh heartbeat; ``model``: those serving that
    table), less those this run dir started whose process is gone
    (``Stack.dead_worker_nodes``). One round trip."""
    from producer.stack.local import Stack

    dead = Stack(settings).dead_worker_nodes()
    return [n for n in client.live_workers(modality, model) if n not in dead]


def live_summary(settings: Settings, client: Any) -> dict[str, list[str]]:
    """Live worker node names per modality (one round trip each), as :func:`live_nodes`."""
    return {m: live_nodes(settings, client, m) for m in MODALITIES}
