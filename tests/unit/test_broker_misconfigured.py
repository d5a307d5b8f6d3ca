"""A producer pointed at Redis with the wrong credentials (``AUTH``) or at a port that is not
Redis (``NOT_REDIS``): which exception is which ``BROKER_UNAVAILABLE`` reason
(``shared.redis_refusal``), that no retry layer retries a refused login
(``shared.kombu_redis``), and the CLI's words (``producer.cli.diagnose``). Pure logic: the
exceptions are built as redis-py raises them. Before, a refused login was ``UNREACHABLE``
("check that Redis runs"), an HTTP port's answer a raw ``InvalidResponse``, and the CLI named
``FLEET_REDIS__PASSWORD`` whatever variable held the password."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from kombu.exceptions import OperationalError
from redis.retry import Retry

from producer.cli.diagnose import AUTH, NOT_REDIS, broker_message, classify, password_source
from shared.errors import BrokerUnavailable
from shared.ha import ProducerSentinelTransport
from shared.kombu_redis import AuthNotRetried, CredentialsRefused, Transport
from shared.redis_refusal import broker_unavailable, reason_of
from shared.settings import load_settings

WRONGPASS = redis.AuthenticationError(
    "invalid username-password pair or user is disabled."
)  # what redis-py's parser makes of "-WRONGPASS invalid username-password pair ..."
NOAUTH = redis.AuthenticationError("Authentication required.")
HTTP = redis.exceptions.InvalidResponse('Protocol error, got "H" as reply type byte')


def caused(outer: BaseException, inner: BaseException) -> BaseException:
    """``outer`` raised ``from inner`` (kombu's wrapping, :class:`CredentialsRefused`)."""
    try:
        raise outer from inner
    except BaseException as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (WRONGPASS, "AUTH"),
        (NOAUTH, "AUTH"),
        (caused(OperationalError(str(WRONGPASS)), WRONGPASS), "AUTH"),  # kombu's wrapping
        (caused(CredentialsRefused(str(WRONGPASS)), WRONGPASS), "AUTH"),
        (redis.exceptions.AuthenticationWrongNumberOfArgsError("wrong number of args"), "AUTH"),
        (redis.ResponseError("WRONGPASS invalid username-password pair"), "AUTH"),
        (HTTP, "NOT_REDIS"),
        (caused(OperationalError(str(HTTP)), HTTP), "NOT_REDIS"),
        # unchanged: a lost connection, a refusal
        (redis.ConnectionError("Error 111 connecting. Connection refused."), "UNREACHABLE"),
        (redis.exceptions.NoPermissionError("no permissions to run the 'lpush' command"), "NOPERM"),
    ],
)
def test_reason_of(exc: BaseException, reason: str) -> None:
    assert reason_of(exc) == reason


@pytest.mark.parametrize(
    ("exc", "reason", "says", "fix"),
    [
        (WRONGPASS, "AUTH", "refused the credentials", "FLEET_REDIS__PASSWORD"),
        (HTTP, "NOT_REDIS", "is not Redis", "check the port"),
    ],
)
def test_the_coded_error_names_reason_and_fix(
    exc: BaseException, reason: str, says: str, fix: str
) -> None:
    err = broker_unavailable(exc, "could not publish")
    assert (err.code, err.reason) == ("BROKER_UNAVAILABLE", reason)
    cause, _, said = err.message.partition("; fix: ")
    assert says in cause and str(exc) in cause and fix in said, err.message
    assert "runs and answers" not in said  # UNREACHABLE's fix
    assert reason in BrokerUnavailable.REASONS


class _Refused:
    """A connection whose login Redis refuses (what redis-py's connect raises)."""

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        raise WRONGPASS


class _RefusedLogin(AuthNotRetried, _Refused):
    pass


def test_a_refused_login_is_raised_as_an_error_no_retry_layer_retries() -> None:
    with pytest.raises(CredentialsRefused) as got:
        _RefusedLogin().connect_check_health()
    assert got.value.__cause__ is WRONGPASS and reason_of(got.value) == "AUTH"
    # kombu retries its transport's connection errors; redis-py its Retry's supported errors
    for transport in (Transport, ProducerSentinelTransport):
        assert not isinstance(got.value, transport.recoverable_connection_errors)
        assert not isinstance(got.value, transport.recoverable_channel_errors)
        assert issubclass(transport.Channel.connection_class, AuthNotRetried)
    assert not isinstance(got.value, Retry(None, 3)._supported_errors)  # type: ignore[arg-type]
    # a lost connection stays a connection error, retried as before
    assert issubclass(redis.ConnectionError, Transport.recoverable_connection_errors)


def test_the_cli_tells_auth_and_not_redis_apart() -> None:
    assert classify(caused(CredentialsRefused(str(WRONGPASS)), WRONGPASS)) == AUTH
    assert classify(BrokerUnavailable("x", reason="AUTH")) == AUTH
    assert classify(HTTP) == NOT_REDIS
    facts = {"address": "127.0.0.1:8000", "run_dir": "/r", "run_dir_from": "(test)"}
    first, fix = broker_message(NOT_REDIS, detail=str(HTTP), **facts).splitlines()
    assert "127.0.0.1:8000 answers but is not Redis" in first and "check the port" in fix


@pytest.mark.parametrize(
    ("env", "source"),
    [
        ({"FLEET_REDIS_URL": "redis://producer:wrongpw@127.0.0.1:6390/0"}, "FLEET_REDIS_URL"),
        ({"FLEET_REDIS__USER": "producer", "FLEET_REDIS__PASSWORD": "pw"}, "FLEET_REDIS__PASSWORD"),
        (  # the variable's key wins over the URL's
            {
                "FLEET_REDIS_URL": "redis://producer:a@127.0.0.1:6390/0",
                "FLEET_REDIS__PASSWORD": "b",
            },
            "FLEET_REDIS__PASSWORD",
        ),
        ({"FLEET_REDIS_URL": "redis://127.0.0.1:6390/0"}, ""),  # the run dir's password file
        ({}, ""),
    ],
)
def test_the_auth_message_names_the_variable_that_set_the_password(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], source: str
) -> None:
    for name in ("FLEET_REDIS_URL", "FLEET_REDIS__PASSWORD", "FLEET_REDIS__USER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert password_source(load_settings()) == source
    facts = {"address": "127.0.0.1:6390", "run_dir": "/r", "run_dir_from": "(test)"}
    message = broker_message(AUTH, user="producer", password_from=source, **facts)
    if source:
        assert f"the password in {source} does not match" in message
    if source == "FLEET_REDIS_URL":
        assert "FLEET_REDIS__PASSWORD" not in message
