"""A Redis URL instead of a config file: ``url_fields`` (what ``FleetClient.from_url`` and
``FLEET_REDIS_URL`` read), the variable's place among the settings' sources, and the
defaults packaged for a client installed outside a checkout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from producer.cli.base import recorded_overrides
from producer.client import AsyncFleetClient, FleetClient
from shared.settings import config_paths, load_settings, url_fields
from shared.settings import paths as settings_paths

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("no_fleet_env")  # FLEET_* from the shell must not leak in


def test_a_redis_url_names_host_port_db_and_credentials() -> None:
    assert url_fields("redis://producer:p%40ss%3Aw@10.0.0.5:6390/2") == {
        "host": "10.0.0.5",
        "port": 6390,
        "db": 2,
        "user": "producer",
        "password": "p@ss:w",
        "sentinels": [],
    }
    # Redis' own defaults where the URL says nothing; no credentials named: none set
    assert url_fields("redis://cache.internal") == {
        "host": "cache.internal",
        "port": 6379,
        "db": 0,
        "sentinels": [],
    }
    assert url_fields("redis://:only-a-password@h:1")["password"] == "only-a-password"


def test_the_url_the_settings_write_reads_back_as_the_same_settings() -> None:
    s = load_settings(redis={"host": "10.1.2.3", "port": 7000, "db": 1, "password": "p/w@x"})
    again = load_settings(redis=url_fields(s.redis_url("producer")))
    assert again.redis_url("producer") == s.redis_url("producer")
    assert (again.redis.host, again.redis.port, again.redis.db) == ("10.1.2.3", 7000, 1)
    assert again.redis.password == "p/w@x"


def test_a_sentinel_url_names_the_sentinels_master_and_their_password() -> None:
    url = (
        "sentinel://producer:pw@s1:26379;sentinel://producer:pw@s2:26380;"
        "sentinel://s3/0?master_name=fleet-a&sentinel_password=sp%21"
    )
    assert url_fields(url) == {
        "sentinels": ["s1:26379", "s2:26380", "s3:26379"],
        "db": 0,
        "user": "producer",
        "password": "pw",
        "master_name": "fleet-a",
        "sentinel_password": "sp!",
    }
    s = load_settings(redis=url_fields(url))
    assert s.ha and s.sentinel_addresses() == [("s1", 26379), ("s2", 26380), ("s3", 26379)]
    assert s.sentinel_password() == "sp!" and s.redis.master_name == "fleet-a"
    # what the settings write (kombu's form) reads back
    assert url_fields(s.redis_url("producer"))["sentinels"] == s.redis.sentinels


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("rediss://:secret@h:6390", "expected redis://"),
        ("unix:///tmp/redis.sock", "expected redis://"),
        ("redis://:secret@h:port/0", "numeric port"),
        ("redis://:secret@h:6390/zero", "numeric db"),
        ("redis://:secret@:6390", "needs a host"),
        ("redis://:secret@h:6390/0?master_name=x", "takes no query"),
        ("sentinel://a:secret@s1;sentinel://b:secret@s2", "different users"),
        ("sentinel://s1/1;sentinel://s2/2", "different dbs"),
        ("sentinel://s1?sentinel_pasword=secret", "unknown query key 'sentinel_pasword'"),
        ("redis://a;redis://b", "expected redis://"),
        ("", "empty"),
    ],
)
def test_a_url_of_another_form_is_refused_without_its_password(url: str, words: str) -> None:
    with pytest.raises(ValueError) as err:
        url_fields(url)
    assert words in str(err.value)
    assert "secret" not in str(err.value)


def test_fleet_redis_url_sets_the_redis_keys_below_the_fleet_redis_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_REDIS_URL", "redis://producer:pw@10.0.0.5:6400/3")
    s = load_settings()
    assert (s.redis.host, s.redis.port, s.redis.db) == ("10.0.0.5", 6400, 3)
    assert s.redis_credentials("producer") == ("producer", "pw")
    assert s.redis.lease_s == 10  # the rest: the config file's
    monkeypatch.setenv("FLEET_REDIS__PORT", "6500")  # a key's own variable wins
    assert load_settings().redis.port == 6500
    assert load_settings(redis={"port": 6600}).redis.port == 6600  # keywords win over both


def test_a_bad_fleet_redis_url_is_a_configuration_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_REDIS_URL", "redis://producer:secret@h:x/0")
    with pytest.raises(ValidationError) as err:
        load_settings()
    (error,) = err.value.errors()
    assert error["loc"] == ("FLEET_REDIS_URL",) and "numeric port" in error["msg"]
    assert "secret" not in str(err.value)  # neither in the message nor as the input


def test_from_url_builds_either_client_without_a_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_REDIS__PASSWORD", "from-env")
    sync = FleetClient.from_url("redis://producer@10.9.8.7:6391/0")
    aio = AsyncFleetClient.from_url("redis://producer:pw@10.9.8.7:6391/0")
    try:
        assert sync.settings.redis_credentials("producer") == ("producer", "from-env")
        assert aio.settings.redis_url("producer") == "redis://producer:pw@10.9.8.7:6391/0"
        assert isinstance(sync, FleetClient) and isinstance(aio, AsyncFleetClient)
    finally:
        sync.close()
        aio.app.close()


def test_a_recorded_stack_address_yields_to_fleet_redis_url() -> None:
    state = {"redis": {"host": "127.0.0.1", "port": 6400}, "flower": {"port": 5556}}
    assert recorded_overrides(state, {"FLEET_REDIS_URL": "redis://h:1/0"}) == {
        "flower": {"port": 5556}
    }
    assert recorded_overrides(state, {})["redis"] == {"host": "127.0.0.1", "port": 6400}


def test_without_a_checkout_the_packaged_defaults_are_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An installed wheel has no configs/fleet.toml beside its source: it reads the copy
    packaged in shared/settings (in a checkout, a link to configs/fleet.toml)."""
    packaged = settings_paths.PACKAGED_CONFIG
    assert packaged.read_bytes() == (REPO / "configs" / "fleet.toml").read_bytes()
    monkeypatch.chdir(tmp_path)
    assert config_paths() == [settings_paths.REPO_CONFIG]  # a checkout: its own file, as before
    monkeypatch.setattr(settings_paths, "REPO_CONFIG", tmp_path / "gone" / "fleet.toml")
    assert config_paths() == [packaged]
    s = load_settings()
    assert set(s.priorities) == {"realtime", "high", "normal", "bulk"}
    assert set(s.modalities) == {"text", "image", "video", "xmodal"}


def test_the_packaged_defaults_are_package_data() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"shared.settings" = ["fleet.toml"]' in pyproject
    link = REPO / "shared" / "settings" / "fleet.toml"
    assert link.is_symlink() and os.readlink(link) == "../../configs/fleet.toml"
