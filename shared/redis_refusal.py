"""Which broker fault an exception stands for, as a :class:`~shared.errors.BrokerUnavailable`
reason: Redis refused the command or the credentials, the address is not Redis, or it could
not be reached.

Redis refuses a command while it answers: ``OOM`` (``maxmemory`` reached under
``noeviction``), ``MISCONF`` (it cannot persist; it refuses every write, and ``PING`` too),
``READONLY`` (the node is a replica), ``NOPERM`` (an ACL rule). Reconnecting does not help
and waiting a few seconds rarely does, so a producer reports a refusal at once, with what it
is, instead of retrying it as a lost connection (kombu's Redis transport files every
``ResponseError`` under its recoverable connection errors: ``shared.kombu_redis``). A lost
connection, a timeout or a node still loading its data is ``UNREACHABLE``.

Two faults are the configuration's, and no wait ends them either: ``AUTH``, Redis refused the
credentials (redis-py's ``AuthenticationError``, from a ``WRONGPASS`` or ``NOAUTH`` answer;
it is a ``ConnectionError``, so it is looked for before those), and ``NOT_REDIS``, the
address answers but not in Redis' protocol (redis-py's ``InvalidResponse``: an HTTP server's
``H`` as the reply type byte).

Redis-py raises a refusal as a ``ResponseError`` (its own subclass for ``OOM``, ``READONLY``,
``NOPERM``); kombu wraps it in an ``OperationalError`` whose ``__cause__`` it is; a
transaction's refusal reads ``Command # 1 (...) of pipeline caused error: ...``. The code
is found in each.
"""

from __future__ import annotations

import re

import redis
from kombu.exceptions import OperationalError

from shared.errors import BrokerUnavailable

__all__ = [
    "BROKER_FAULTS",
    "FIXES",
    "REFUSALS",
    "WORDS",
    "answer_of",
    "broker_unavailable",
    "reason_of",
    "refusal_of",
]

# What a producer's call to Redis raises when the broker, not the call, is at fault (a
# refusal, a lost connection; kombu's wrapping of either). A caller that catches these
# still checks reason_of(exc) before naming it a broker fault.
BROKER_FAULTS: tuple[type[BaseException], ...] = (redis.RedisError, OperationalError, OSError)

REFUSALS: tuple[str, ...] = BrokerUnavailable.REFUSALS

WORDS: dict[str, str] = {
    "OOM": "Redis is out of memory (maxmemory reached, no eviction) and refuses writes",
    "MISCONF": "Redis cannot persist (MISCONF: the disk under its AOF is full or failing) and "
    "refuses writes",
    "READONLY": "Redis is a read-only replica and refuses writes",
    "NOPERM": "Redis' ACL rules deny the command to this user",
    "AUTH": "Redis refused the credentials (authentication failed)",
    "NOT_REDIS": "the address answers but is not Redis",
    "UNREACHABLE": "Redis cannot be reached",
    "REFUSED": "Redis refused the command",
}

# What ends each reason, for the message a producer's caller reads (the CLI says it in its
# own words: producer.cli.diagnose). Nothing of a refused call was applied: once the cause is
# gone, the same call (the same task id) goes through.
FIXES: dict[str, str] = {
    "OOM": "let the workers drain the queues or raise Redis' maxmemory (CONFIG SET maxmemory "
    "as its admin), then send it again with the same id",
    "MISCONF": "free space on the disk under Redis' data directory (its log names the file); "
    "it takes writes again by itself, then send it again with the same id",
    "READONLY": "point the producer at the primary ([redis] host and port, or sentinels) or "
    "promote this node (REPLICAOF NO ONE), then send it again with the same id",
    "NOPERM": "restore this user's ACL rules (shared/acl.py: `fleet down` and `fleet up` "
    "write them again; an external Redis: its ACL file)",
    "AUTH": "check the user and password: the URL's (FLEET_REDIS_URL), FLEET_REDIS__USER "
    "and FLEET_REDIS__PASSWORD, or, with no password set, the role's password file in the run "
    "dir (`fleet up` writes it); then send it again with the same id",
    "NOT_REDIS": "the address answers but is not Redis: check the port (FLEET_REDIS_URL, "
    "FLEET_REDIS__HOST and FLEET_REDIS__PORT), then send it again with the same id",
    "UNREACHABLE": "check that Redis runs and answers at the configured address (`fleet "
    "status`), then send it again with the same id (it runs once)",
    "REFUSED": "see Redis' answer; send it again with the same id once that is fixed",
}

# A refusal's code inside another error's text: a pipeline's ("Command # 1 (ZADD ...) of
# pipeline caused error: MISCONF ...") or a script's ("Error running script ...: -OOM ...").
_CODE_IN_TEXT = re.compile(r"(?<![A-Za-z])-?(MISCONF|OOM|READONLY|NOPERM)\b")
_SCRIPT_NOPERM = "can't run this command"  # Redis 6's NOPERM inside a script has no code
# An AUTH refusal that redis-py left a ResponseError (a pipeline's, a wrong AUTH arity)
_AUTH_IN_TEXT = re.compile(r"(?<![A-Za-z])-?(WRONGPASS|NOAUTH)\b|invalid username-password")
_CHAIN_DEPTH = 8


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes (``__cause__``, else ``__context__``), nearest first."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < _CHAIN_DEPTH:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _refusal_code(exc: redis.ResponseError) -> str | None:
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return "OOM"
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return "READONLY"
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return "NOPERM"
    text = str(exc)
    found = _CODE_IN_TEXT.search(text)
    if found:
        return found.group(1)
    return "NOPERM" if _SCRIPT_NOPERM in text else None


def refusal_of(exc: BaseException) -> str | None:
    """The write refusal ``exc`` stands for (one of :data:`REFUSALS`), found in ``exc`` or
    what it wraps, or ``None``: any other error (a lost connection, ``NOSCRIPT``,
    ``WRONGTYPE``, a script's own error) is not Redis refusing to write. What a worker asks
    (``workers.batching.refusals``): a refusal pauses it, anything else is handled as before."""
    for e in _chain(exc):
        if isinstance(e, redis.ResponseError):
            return _refusal_code(e)
    return None


def reason_of(exc: BaseException) -> str | None:
    """The :class:`BrokerUnavailable` reason of ``exc`` (one of its ``REASONS``), or
    ``None`` when ``exc`` is not a broker fault (a bug, a refused input)."""
    if isinstance(exc, BrokerUnavailable):
        return exc.reason
    chain = _chain(exc)
    for e in chain:
        if isinstance(
            e, redis.AuthenticationError | redis.exceptions.AuthenticationWrongNumberOfArgsError
        ) or (isinstance(e, redis.ResponseError) and _AUTH_IN_TEXT.search(str(e))):
            return "AUTH"
    for e in chain:
        if isinstance(e, redis.ResponseError):
            return _refusal_code(e) or "REFUSED"
    for e in chain:
        if isinstance(e, redis.exceptions.InvalidResponse):
            return "NOT_REDIS"
    for e in chain:
        if isinstance(e, redis.ConnectionError | redis.TimeoutError | OSError):
            return "UNREACHABLE"
        if isinstance(e, OperationalError):
            return "UNREACHABLE"  # kombu's: a connection error it gave up on
    return None


def answer_of(exc: BaseException) -> str:
    """Redis' own words in ``exc``: the refusal's text (without redis-py's ``Command # 1
    (...) of pipeline caused error:``), else the connection error's."""
    chain = _chain(exc)
    found = next((e for e in chain if isinstance(e, redis.ResponseError)), None)
    if found is None:
        found = next((e for e in chain if not isinstance(e, BrokerUnavailable)), exc)
    return str(found).split(" of pipeline caused error: ")[-1]


def broker_unavailable(exc: BaseException, what: str) -> BrokerUnavailable:
    """``exc`` (a broker fault: :func:`reason_of` is not ``None``) as the coded error a
    producer raises: ``<what>: <the reason in words> (<Redis' answer>); fix: <what ends it>``
    (:data:`FIXES`)."""
    if isinstance(exc, BrokerUnavailable):
        return exc
    reason = reason_of(exc) or "UNREACHABLE"
    return BrokerUnavailable(
        f"{what}: {WORDS[reason]} ({answer_of(exc)}); fix: {FIXES[reason]}", reason=reason
    )
