"""Configuration: precedence, the --dev profile, and validation with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from ironflow.config import ConfigError, load_config


def test_defaults_are_the_seed_numbers() -> None:
    t = load_config(env={}).timings
    assert (t.heartbeat_interval_s, t.scanner_interval_s, t.reservation_expiry_s) == (30, 30, 30)
    assert (t.lease_expiry_s, t.recovery_grace_s, t.recovery_ceiling) == (90, 30, 10)
    assert (t.stale_claim_interval_s, t.stale_claim_threshold_s) == (60, 120)


def test_dev_shortens_loop_one_and_loop_two() -> None:
    t = load_config(env={}, dev=True).timings
    assert (t.heartbeat_interval_s, t.lease_expiry_s, t.scanner_interval_s, t.recovery_grace_s) == (2, 6, 1, 1)
    assert (t.stale_claim_interval_s, t.stale_claim_threshold_s) == (5, 45)


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "ironflow.yaml"
    f.write_text("port: 9200\ntimings:\n  lease_expiry_s: 120\n  recovery_grace_s: 5\n")
    env = {"IRONFLOW_LEASE_EXPIRY_S": "150", "IRONFLOW_PORT": "9300"}
    c = load_config(file=f, env=env, timing_overrides={"recovery_grace_s": 7})
    assert c.port == 9300
    assert c.timings.lease_expiry_s == 150
    assert c.timings.recovery_grace_s == 7


def test_lease_too_close_to_heartbeat_is_refused() -> None:
    with pytest.raises(ConfigError, match="lease_expiry_s=40s must be at least 2× the heartbeat"):
        load_config(env={}, timing_overrides={"lease_expiry_s": 40})


def test_non_positive_and_malformed_values_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="scanner_interval_s must be positive"):
        load_config(env={}, timing_overrides={"scanner_interval_s": 0})
    with pytest.raises(ConfigError, match="timings.lease_expiry_s='soon' is not a duration"):
        load_config(env={"IRONFLOW_LEASE_EXPIRY_S": "soon"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("timings:\n  no_such_timing: 3\n")
    with pytest.raises(ConfigError, match="no_such_timing"):
        load_config(file=bad, env={})


def test_retry_defaults_are_three_attempts_one_second_doubling_capped_at_five_minutes() -> None:
    from ironflow.protocol import RetryPolicy

    policy = RetryPolicy()
    assert policy.max_attempts == 3
    assert [policy.delay_after(attempt) for attempt in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert policy.delay_after(20) == 300.0  # 2**19 s, capped at 5 min


def test_limits_come_from_yaml_env_and_flags_in_that_order(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("limits:\n  max_slots_per_session: 50\n  max_functions_per_worker: 7\n")
    config = load_config(
        file=file,
        env={"IRONFLOW_MAX_FUNCTIONS_PER_WORKER": "9", "IRONFLOW_FUNCTION_LIVE_S": "60"},
        limit_overrides={"max_functions_per_trigger": 3},
    )
    limits = config.limits
    assert (limits.max_slots_per_session, limits.max_functions_per_worker) == (50, 9)
    assert (limits.max_functions_per_trigger, limits.function_live_s) == (3, 60.0)


@pytest.mark.parametrize(
    ("limit", "value"),
    [("max_slots_per_session", 0), ("max_slots_per_session", 10**6), ("max_functions_per_trigger", -1),
     ("function_live_s", 0), ("cron_min_interval_s", -1)],
)
def test_a_limit_out_of_range_is_refused_naming_it(limit: str, value: int) -> None:
    with pytest.raises(ConfigError, match=f"limits.{limit}"):
        load_config(env={}, limit_overrides={limit: value})


def test_history_retention_defaults_to_a_week_and_zero_means_keep_forever(tmp_path: Path) -> None:
    assert load_config(env={}).timings.history_retention_s == 7 * 24 * 3600
    assert load_config(env={}, timing_overrides={"history_retention_s": 0}).timings.history_retention_s == 0
    f = tmp_path / "ironflow.yaml"
    f.write_text("timings:\n  history_retention_s: 86400\n")
    assert load_config(file=f, env={}).timings.history_retention_s == 86400
    env = {"IRONFLOW_HISTORY_RETENTION_S": "3600"}
    assert load_config(file=f, env=env).timings.history_retention_s == 3600


def test_negative_history_retention_is_refused() -> None:
    with pytest.raises(ConfigError, match="history_retention_s must be 0 \\(off\\) or positive"):
        load_config(env={}, timing_overrides={"history_retention_s": -1})
    with pytest.raises(ConfigError, match="janitor_interval_s must be positive"):
        load_config(env={}, timing_overrides={"janitor_interval_s": 0})


def test_the_seeds_setting_names_and_duration_forms_are_accepted(tmp_path: Path) -> None:
    env = {"IRONFLOW_STALE_CLAIM_RECOVERY_INTERVAL": "1m30s", "IRONFLOW_STALE_CLAIM_THRESHOLD": "2m"}
    t = load_config(env=env, timing_overrides={"recovery_grace_s": "250ms"}).timings
    assert (t.stale_claim_interval_s, t.stale_claim_threshold_s, t.recovery_grace_s) == (90, 120, 0.25)
    f = tmp_path / "c.yaml"
    f.write_text("timings:\n  lease_expiry: 2m\n  heartbeat_interval_s: 10s\n  stale_claim_threshold: 1h\n")
    t = load_config(file=f, env={}).timings
    assert (t.lease_expiry_s, t.heartbeat_interval_s, t.stale_claim_threshold_s) == (120, 10, 3600)


def test_two_spellings_that_disagree_stop_the_node_naming_both() -> None:
    env = {"IRONFLOW_STALE_CLAIM_THRESHOLD": "2m", "IRONFLOW_STALE_CLAIM_THRESHOLD_S": "100"}
    with pytest.raises(ConfigError, match="IRONFLOW_STALE_CLAIM_THRESHOLD_S='100'.*IRONFLOW_STALE_CLAIM_THRESHOLD='2m'|IRONFLOW_STALE_CLAIM_THRESHOLD='2m'.*IRONFLOW_STALE_CLAIM_THRESHOLD_S='100'"):
        load_config(env=env)
    same = {"IRONFLOW_STALE_CLAIM_THRESHOLD": "2m", "IRONFLOW_STALE_CLAIM_THRESHOLD_S": "120"}
    assert load_config(env=same).timings.stale_claim_threshold_s == 120


@pytest.mark.parametrize("value", ["9x", "2 minutes", "m", "1m30", "-5s"])
def test_a_duration_that_does_not_parse_is_refused_naming_setting_and_value(value: str) -> None:
    with pytest.raises(ConfigError, match=f"timings.lease_expiry_s={value!r}"):
        load_config(env={"IRONFLOW_LEASE_EXPIRY_S": value})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "timings.recovery_ceiling must be positive"),
        (-1, "timings.recovery_ceiling must be positive"),
        (2.5, "Expected `int`, got `float`"),
        ("3 times", "Expected `int`, got `str`"),
    ],
)
def test_a_recovery_ceiling_that_is_not_a_positive_integer_is_refused(value: object, message: str) -> None:
    # The positivity loop and the typed decoder are the only guards: nothing
    # after them needs to re-check the ceiling.
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, timing_overrides={"recovery_ceiling": value})


def test_the_waker_lookahead_defaults_to_1s_takes_duration_forms_and_0_turns_it_off(tmp_path: Path) -> None:
    assert load_config(env={}).timings.waker_lookahead_s == 1.0
    assert load_config(env={}, dev=True).timings.waker_lookahead_s == 1.0
    assert load_config(env={"IRONFLOW_WAKER_LOOKAHEAD": "250ms"}).timings.waker_lookahead_s == 0.25
    assert load_config(env={}, timing_overrides={"waker_lookahead_s": "0"}).timings.waker_lookahead_s == 0
    f = tmp_path / "c.yaml"
    f.write_text("timings:\n  waker_lookahead: 2s\n")
    assert load_config(file=f, env={}).timings.waker_lookahead_s == 2.0


def test_a_waker_lookahead_past_half_the_reservation_expiry_or_negative_is_refused() -> None:
    # A worker that cannot hold a job is sent it at its start time, on a
    # reservation made a look-ahead earlier: the reservation must outlast it.
    with pytest.raises(ConfigError, match="waker_lookahead_s=3s must be at most half the reservation expiry"):
        load_config(env={}, dev=True, timing_overrides={"waker_lookahead_s": 3})
    assert load_config(env={}, dev=True, timing_overrides={"waker_lookahead_s": 2.5}).timings.waker_lookahead_s == 2.5
    with pytest.raises(ConfigError, match="waker_lookahead_s must be 0 \\(off\\) or positive"):
        load_config(env={}, timing_overrides={"waker_lookahead_s": -1})
