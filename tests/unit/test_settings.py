"""``shared.settings``: configs/fleet.toml, FLEET_* overrides, secrets and the Redis URL."""

from __future__ import annotations

import stat
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from pydantic import ValidationError

from shared.settings import config_paths, ensure_secret, load_settings

REPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "fleet.toml"


pytestmark = pytest.mark.usefixtures("no_fleet_env")  # FLEET_* from the shell must not leak in


def write_config(path: Path, *, drop_priority: str | None = None, redis_port: int = 7001) -> Path:
    prios = {"realtime": (0, 0.1), "high": (2, 0.5), "normal": (5, 1.5), "bulk": (9, 0.0)}
    lines = [f"[redis]\nport = {redis_port}\n"]
    for name, (cp, t) in prios.items():
        if name != drop_priority:
            lines.append(f"[priorities.{name}]\ncelery_priority = {cp}\ntimeout_s = {t}\n")
    lines.append('[modalities.text]\nmodel = "tiny"\n[modalities.text.batching]\n')
    lines.append("max_batch_size = 4\n")
    path.write_text("\n".join(lines))
    return path


# -- the shipped file -------------------------------------------------------------------


def test_fleet_toml_loads_with_its_values() -> None:
    s = load_settings()
    assert s.redis.port == 6390
    assert s.redis.host == "127.0.0.1"
    assert s.redis.password is None
    assert set(s.priorities) == {"realtime", "high", "normal", "bulk"}
    assert s.modality("text").model == "minilm"
    assert s.modality("text").batching.max_batch_size == 32
    assert s.modality("text").batching.length_buckets == [
        8,
        12,
        16,
        20,
        24,
        28,
        32,
        40,
        48,
        64,
        96,
        128,
        256,
    ]
    assert s.modality("image").batching.max_queue_delay_ms == 2.0
    assert s.limits.max_inline_bytes == 8 * 1024 * 1024
    assert s.models["minilm"].kind == "minilm"


def test_default_config_path_is_the_repo_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_CONFIG.parent.parent)
    assert [p.resolve() for p in config_paths()] == [REPO_CONFIG]


def test_repo_file_is_used_from_another_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    assert config_paths() == [REPO_CONFIG]
    assert load_settings().modality("text").batching.max_batch_size == 32


def test_unknown_modality_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        load_settings().modality("audio")


# -- overrides --------------------------------------------------------------------------


def test_env_overrides_nested_modality_key_and_keeps_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE", "16")
    text = load_settings().modality("text")
    assert text.batching.max_batch_size == 16
    assert text.batching.max_queue_delay_ms == 4.0
    assert text.batching.length_buckets[:3] == [8, 12, 16]
    assert text.model == "minilm"
    assert text.device.prefetch_multiplier == 256


def test_env_overrides_redis_port_and_keeps_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_REDIS__PORT", "6400")
    s = load_settings()
    assert s.redis.port == 6400
    assert s.redis.host == "127.0.0.1"
    assert s.redis.visibility_timeout_s == 3600


def test_metrics_are_on_in_the_shipped_file_and_off_with_one_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert load_settings().metrics.enabled is True
    monkeypatch.setenv("FLEET_METRICS__ENABLED", "false")
    s = load_settings()
    assert s.metrics.enabled is False
    assert s.metrics.port_base == 9101  # the port stays configured; metrics_port ignores it
    monkeypatch.setenv("FLEET_METRICS__ENABLED", "maybe")
    with pytest.raises(ValidationError, match="enabled"):
        load_settings()


def test_keyword_overrides_win_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_REDIS__PORT", "6400")
    s = load_settings(redis={"port": 6500})
    assert s.redis.port == 6500
    assert s.redis.visibility_timeout_s == 3600


def test_invalid_env_value_is_a_validation_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE", "0")
    with pytest.raises(ValidationError, match="max_batch_size"):
        load_settings()


def test_fleet_config_names_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "other.toml", redis_port=7001)
    monkeypatch.setenv("FLEET_CONFIG", str(cfg))
    s = load_settings()
    assert config_paths() == [cfg]
    assert s.redis.port == 7001
    assert s.priorities["high"].celery_priority == 2
    assert s.modality("text").model == "tiny"
    assert s.modality("text").batching.max_batch_size == 4
    assert "image" not in s.modalities


def test_env_wins_over_fleet_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLEET_CONFIG", str(write_config(tmp_path / "other.toml")))
    monkeypatch.setenv("FLEET_REDIS__PORT", "7002")
    assert load_settings().redis.port == 7002


def test_missing_priority_class_is_a_validation_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg = write_config(tmp_path / "no-bulk.toml", drop_priority="bulk")
    monkeypatch.setenv("FLEET_CONFIG", str(cfg))
    with pytest.raises(ValidationError, match="bulk"):
        load_settings()


def test_celery_priority_outside_0_9_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="celery_priority"):
        load_settings(priorities={"high": {"celery_priority": 10, "timeout_s": 1.0}})


def test_settings_are_frozen() -> None:
    s = load_settings()
    with pytest.raises(ValidationError):
        s.limits = s.limits  # type: ignore[misc]


# -- secrets ----------------------------------------------------------------------------


def test_redis_password_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "redis.password").write_text("from-file\n")
    monkeypatch.setenv("FLEET_REDIS__PASSWORD", "from-env")
    assert load_settings(stack={"run_dir": tmp_path}).redis_password() == "from-env"


def test_redis_password_from_run_dir_file(tmp_path: Path) -> None:
    (tmp_path / "redis.password").write_text("from-file\n")
    assert load_settings(stack={"run_dir": tmp_path}).redis_password() == "from-file"


def test_redis_password_missing_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_settings(stack={"run_dir": tmp_path}).redis_password()


def test_ensure_secret_creates_a_0600_file_once(tmp_path: Path) -> None:
    path = tmp_path / "run" / "redis.password"
    first = ensure_secret(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first) == 32
    assert path.read_text().strip() == first
    mtime = path.stat().st_mtime_ns
    assert ensure_secret(path) == first
    assert path.stat().st_mtime_ns == mtime


def test_ensure_secret_keeps_an_existing_secret(tmp_path: Path) -> None:
    path = tmp_path / "redis.password"
    path.write_text("chosen-by-operator\n")
    assert ensure_secret(path) == "chosen-by-operator"


def test_ensure_secret_gives_different_secrets_to_different_files(tmp_path: Path) -> None:
    assert ensure_secret(tmp_path / "a") != ensure_secret(tmp_path / "b")


def test_redis_url_quotes_special_characters_in_password() -> None:
    password = "p@ss:w/rd%#?"
    url = load_settings(redis={"password": password, "port": 6401, "db": 2}).redis_url()
    assert url == "redis://:p%40ss%3Aw%2Frd%25%23%3F@127.0.0.1:6401/2"
    parts = urlsplit(url)
    assert unquote(parts.password or "") == password
    assert (parts.hostname, parts.port, parts.path) == ("127.0.0.1", 6401, "/2")


def test_overlay_files_deep_merge_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    overlay = REPO_CONFIG.parent / "overlays" / "gpu.toml"
    monkeypatch.setenv("FLEET_CONFIG", f"{REPO_CONFIG}:{overlay}")
    s = load_settings()
    assert s.modality("image").device.device == "cuda:0"  # from the overlay
    assert s.modality("image").batching.max_batch_size == 32  # from the overlay
    assert s.modality("image").model == "efficientnet-lite0"  # kept from the base file
    assert s.modality("text").max_retries == 5  # kept from the base file


def test_missing_config_file_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FLEET_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(FileNotFoundError, match=r"nope\.toml"):
        load_settings()


def test_sentinels_turn_the_url_into_kombus_sentinel_form() -> None:
    s = load_settings(
        redis={
            "user": "producer",
            "password": "p@ss",
            "db": 3,
            "sentinels": ["127.0.0.1:26379", "10.0.0.2:26380"],
        }
    )
    assert s.ha
    assert s.sentinel_addresses() == [("127.0.0.1", 26379), ("10.0.0.2", 26380)]
    assert s.redis_url("producer") == (
        "sentinel://producer:p%40ss@127.0.0.1:26379/3;sentinel://producer:p%40ss@10.0.0.2:26380/3"
    )


def test_without_sentinels_the_url_is_the_plain_one() -> None:
    s = load_settings(redis={"password": "pw", "port": 6401})
    assert not s.ha
    assert s.redis_url() == "redis://:pw@127.0.0.1:6401/0"


def test_sentinels_come_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_REDIS__SENTINELS", '["127.0.0.1:26379", "127.0.0.1:26380"]')
    assert load_settings().redis.sentinels == ["127.0.0.1:26379", "127.0.0.1:26380"]


@pytest.mark.parametrize("bad", ["127.0.0.1", ":26379", "host:port", "host:70000"])
def test_a_sentinel_that_is_not_host_port_is_refused(bad: str) -> None:
    with pytest.raises(ValidationError, match="host:port"):
        load_settings(redis={"sentinels": [bad]})


def test_the_sentinel_password_comes_from_the_setting_or_the_run_dir(tmp_path: Path) -> None:
    (tmp_path / "redis-sentinel.password").write_text("from-file\n")
    s = load_settings(stack={"run_dir": tmp_path}, redis={"sentinels": ["127.0.0.1:1"]})
    assert s.sentinel_password() == "from-file"
    s = load_settings(
        stack={"run_dir": tmp_path},
        redis={"sentinels": ["127.0.0.1:1"], "sentinel_password": "set"},
    )
    assert s.sentinel_password() == "set"
