"""Redis' refusals as ``BROKER_UNAVAILABLE`` reasons (``shared.redis_refusal``), the CLI's
words for them (``producer.cli.diagnose``) and the gateway's body (pure logic)."""

from __future__ import annotations

import json

import pytest
import redis
from kombu.exceptions import OperationalError

from producer.cli.base import ExitCode, exit_code_for
from producer.cli.diagnose import REFUSED, REFUSING, broker_message, classify
from producer.gateway.render import fleet_error_response
from shared.errors import BrokerUnavailable, error_from_code
from shared.kombu_redis import Transport
from shared.redis_refusal import answer_of, broker_unavailable, reason_of

OOM = redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
MISCONF = redis.ResponseError("MISCONF Errors writing to the AOF file: No space left on device")


def wrapped(inner: BaseException) -> OperationalError:
    """As kombu raises it: ``OperationalError`` from the redis-py error."""
    try:
        raise OperationalError(str(inner)) from inner
    except OperationalError as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (OOM, "OOM"),
        (MISCONF, "MISCONF"),
        (
            redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
            "READONLY",
        ),
        (redis.exceptions.NoPermissionError("no permissions to run the 'lpush' command"), "NOPERM"),
        (wrapped(MISCONF), "MISCONF"),  # kombu's wrapping of a channel's first PING
        (
            redis.ResponseError("Command # 1 (SET k v) of pipeline caused error: MISCONF x"),
            "MISCONF",
        ),
        (redis.ResponseError("WRONGTYPE Operation against a key"), "REFUSED"),
        (redis.ConnectionError("Error 111 connecting. Connection refused."), "UNREACHABLE"),
        (redis.exceptions.BusyLoadingError("Redis is loading the dataset"), "UNREACHABLE"),
        (wrapped(ConnectionRefusedError(111, "refused")), "UNREACHABLE"),
        (ValueError("a bug"), None),
    ],
)
def test_reason_of(exc: BaseException, reason: str | None) -> None:
    assert reason_of(exc) == reason


def test_the_coded_error_carries_reason_and_redis_answer() -> None:
    err = broker_unavailable(wrapped(OOM), "could not publish")
    assert (err.code, err.reason) == ("BROKER_UNAVAILABLE", "OOM")
    assert err.message.startswith("could not publish: Redis is out of memory")
    assert "used memory > 'maxmemory'" in err.message
    assert err.to_dict() == {
        "code": "BROKER_UNAVAILABLE",
        "message": err.message,
        "type": "BrokerUnavailable",
        "reason": "OOM",
    }
    assert broker_unavailable(err, "again") is err
    assert (
        answer_of(redis.ResponseError("Command # 2 (LPUSH q m) of pipeline caused error: OOM no"))
        == "OOM no"
    )


@pytest.mark.parametrize(
    ("exc", "fix"),
    [
        (wrapped(OOM), "raise Redis' maxmemory"),
        (redis.ResponseError("MISCONF Errors writing to the AOF file"), "free space on the disk"),
        (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), "primary"),
        (redis.exceptions.NoPermissionError("no permissions"), "ACL rules"),
        (redis.ConnectionError("Error 111 connecting. Connection refused."), "runs and answers"),
        (redis.ResponseError("WRONGTYPE Operation against a key"), "Redis' answer"),
    ],
)
def test_the_coded_error_says_the_fix_of_its_reason(exc: BaseException, fix: str) -> None:
    err = broker_unavailable(exc, "could not publish")
    cause, _, said = err.message.partition("; fix: ")
    assert cause.startswith("could not publish: Redis") and fix in said, err.message


def test_a_rebuilt_error_has_a_reason_and_the_usual_args() -> None:
    err = error_from_code("BROKER_UNAVAILABLE", "from elsewhere")
    assert isinstance(err, BrokerUnavailable) and err.reason == "UNREACHABLE"
    assert err.args == ("from elsewhere", "BROKER_UNAVAILABLE")


def test_the_cli_exits_3_with_cause_and_fix_for_each_refusal() -> None:
    assert exit_code_for("BROKER_UNAVAILABLE") == ExitCode.STACK
    facts = {"address": "127.0.0.1:6390", "run_dir": "/r", "run_dir_from": "(test)"}
    for kind in REFUSING:
        lines = broker_message(kind, user="producer", detail="what Redis said", **facts)
        first, fix = lines.splitlines()
        assert "127.0.0.1:6390" in first and "what Redis said" in first, lines
        assert fix.startswith("  ") and len(fix) > 20, lines
        assert classify(BrokerUnavailable("x", reason=kind)) == kind
    assert classify(wrapped(MISCONF)) == "MISCONF"
    assert classify(redis.ConnectionError("Error 111 connecting. Connection refused.")) == REFUSED


def test_the_gateway_body_names_the_reason_with_retry_after() -> None:
    resp = fleet_error_response(BrokerUnavailable("refused", reason="READONLY"), 2)
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "2"
    assert json.loads(resp.body) == {
        "error": "refused",
        "code": "BROKER_UNAVAILABLE",
        "reason": "READONLY",
    }


def test_the_producer_transport_retries_lost_connections_not_refusals() -> None:
    conn_errors = Transport.recoverable_connection_errors
    assert redis.ConnectionError in conn_errors and redis.TimeoutError in conn_errors
    assert not any(issubclass(redis.ResponseError, e) for e in conn_errors)
    assert Transport.recoverable_channel_errors == ()
