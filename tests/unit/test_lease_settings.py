"""Lease timing derived from ``[redis] lease_s`` and the kombu options it becomes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.settings import RedisSettings
from workers.consumer.lease import lease_transport_options


@pytest.mark.parametrize("lease_s", [1.0, 3.0, 10.0, 60.0])
def test_a_dead_workers_messages_are_returned_within_the_lease(lease_s: float) -> None:
    r = RedisSettings(lease_s=lease_s)
    # Last renewal at most one period before the death, then the expiry, then one scan.
    assert r.lease_renew_s + r.lease_expiry_s + r.lease_scan_s <= lease_s + 1e-9
    # A live worker renews several times before its entries could expire.
    assert r.lease_expiry_s >= 3 * r.lease_renew_s


def test_the_scan_is_never_slower_than_the_configured_restore_interval() -> None:
    assert RedisSettings(lease_s=60, restore_scan_interval_s=2).lease_scan_s == 2


def test_kombu_gets_the_expiry_as_visibility_and_a_mutex_that_lapses_with_the_lease() -> None:
    class S:
        redis = RedisSettings(lease_s=10)

    opts = lease_transport_options(S())  # type: ignore[arg-type]
    assert opts["visibility_timeout"] == S.redis.lease_expiry_s
    assert opts["unacked_restore_interval"] == S.redis.lease_scan_s
    # kombu's default mutex (300 s) would stall every restore after a death holding it.
    assert opts["unacked_mutex_expire"] == 10


def test_a_lease_under_a_second_is_refused() -> None:
    with pytest.raises(ValidationError):
        RedisSettings(lease_s=0.5)


def test_tensors_that_would_expire_before_a_redelivery_are_refused_at_load() -> None:
    from shared.settings import load_settings

    with pytest.raises(ValidationError, match="default_ttl_s = 30 s is shorter than 4 leases"):
        load_settings(redis={"lease_s": 10}, transport={"default_ttl_s": 30})
    assert load_settings(redis={"lease_s": 10}, transport={"default_ttl_s": 40}).redis.lease_s == 10
