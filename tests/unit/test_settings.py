"""Settings: explicit argument > PDFLOW_* > SGLANG_* > default; bad values name their source."""

from __future__ import annotations

import pytest

from pdflow.core.protocol.policy import AllocationPolicy, Timeouts
from pdflow.io.settings import (
    Settings,
    SettingsError,
    load_settings,
    pdflow_variable,
    timeouts_from,
)


def test_defaults_without_environment() -> None:
    settings = load_settings({})
    assert settings == Settings()
    assert (settings.bootstrap_port, settings.bootstrap_timeout, settings.waiting_timeout) == (
        8998, 300.0, 300.0
    )
    assert (settings.heartbeat_interval, settings.heartbeat_max_failure) == (5.0, 2)
    assert (settings.transfer_queues, settings.transport_protocol) == (4, "tcp")
    assert settings.allocation_policy is AllocationPolicy.EARLY
    assert settings.bootstrap_token is None
    assert (settings.control_max_sockets, settings.control_max_peers,
            settings.control_max_early_pages) == (512, 1024, 1 << 20)  # fmt: skip
    assert settings.control_max_layout_bytes == 64 << 10
    assert settings.control_max_early_pages_per_decode is None  # a quarter of the budget


def test_resource_limits_come_from_pdflow_variables() -> None:
    env = {"PDFLOW_CONTROL_MAX_SOCKETS": "64", "PDFLOW_CONTROL_MAX_PEERS": "8",
           "PDFLOW_CONTROL_MAX_EARLY_PAGES": "4096",
           "PDFLOW_CONTROL_MAX_LAYOUT_BYTES": "131072",
           "PDFLOW_CONTROL_MAX_EARLY_PAGES_PER_DECODE": "1024"}  # fmt: skip
    settings = load_settings(env)
    assert (settings.control_max_sockets, settings.control_max_peers,
            settings.control_max_early_pages) == (64, 8, 4096)  # fmt: skip
    assert settings.control_max_layout_bytes == 131072
    assert settings.control_max_early_pages_per_decode == 1024
    with pytest.raises(SettingsError, match="PDFLOW_CONTROL_MAX_SOCKETS='0'"):
        load_settings({"PDFLOW_CONTROL_MAX_SOCKETS": "0"})


def test_precedence_explicit_then_pdflow_then_sglang() -> None:
    env = {
        "PDFLOW_WAITING_TIMEOUT": "12",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "99",
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "45",
        "SGLANG_DISAGGREGATION_QUEUE_SIZE": "8",
        "PDFLOW_BOOTSTRAP_PORT": "9000",
    }
    settings = load_settings(env, bootstrap_port=9100)
    assert settings.bootstrap_port == 9100
    assert settings.waiting_timeout == 12.0
    assert settings.bootstrap_timeout == 45.0
    assert settings.transfer_queues == 8
    assert load_settings(env).bootstrap_port == 9000


def test_sglang_floors_apply_to_sglang_values_only() -> None:
    env = {
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5",
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "0",
    }
    settings = load_settings(env)
    assert (settings.heartbeat_interval, settings.heartbeat_max_failure) == (2.0, 1)
    fast = load_settings({"PDFLOW_HEARTBEAT_INTERVAL": "0.5"}, heartbeat_max_failure=1)
    assert fast.heartbeat_interval == 0.5
    assert load_settings(env, heartbeat_interval=0.1).heartbeat_interval == 0.1


def test_booleans_choices_and_empty_variables() -> None:
    env = {
        "PDFLOW_CHECKSUM": "yes", "PDFLOW_TRACE": "off", "PDFLOW_TRANSPORT_PROTOCOL": "RDMA",
        "PDFLOW_ALLOCATION_POLICY": "prefill_complete", "PDFLOW_BOOTSTRAP_TOKEN": "",
        "PDFLOW_TRACE_DIR": "/tmp/traces", "PDFLOW_TRACE_MAX_BYTES": "1024",
    }
    settings = load_settings(env)
    assert settings.checksum is True and settings.trace_enabled is False
    assert settings.transport_protocol == "rdma"
    assert settings.allocation_policy is AllocationPolicy.PREFILL_COMPLETE
    assert settings.bootstrap_token is None  # empty means unset
    assert (settings.trace_dir, settings.trace_max_bytes) == ("/tmp/traces", 1024)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"PDFLOW_BOOTSTRAP_PORT": "abc"}, "PDFLOW_BOOTSTRAP_PORT='abc': 'abc' is not an integer"),
        ({"PDFLOW_BOOTSTRAP_PORT": "70000"}, "PDFLOW_BOOTSTRAP_PORT='70000'"),
        ({"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "-3"},
         "SGLANG_DISAGGREGATION_WAITING_TIMEOUT='-3': -3.0 must be a positive number"),
        ({"SGLANG_DISAGGREGATION_QUEUE_SIZE": "four"}, "SGLANG_DISAGGREGATION_QUEUE_SIZE"),
        ({"PDFLOW_CHECKSUM": "maybe"}, "PDFLOW_CHECKSUM='maybe': 'maybe' is not a boolean"),
        ({"PDFLOW_TRANSPORT_PROTOCOL": "udp"}, "must be one of tcp, rdma"),
        ({"PDFLOW_ALLOCATION_POLICY": "late"}, "not an allocation policy"),
        ({"PDFLOW_TRACE_MAX_BYTES": "0"}, "PDFLOW_TRACE_MAX_BYTES='0'"),
        ({"PDFLOW_SMALL_ROOM_STAGING_BYTES": "65537"}, "must be bytes in [0, 65536] (0: off)"),
        ({"PDFLOW_SMALL_ROOM_STAGING_BYTES": "-1"}, "PDFLOW_SMALL_ROOM_STAGING_BYTES='-1'"),
    ],
)
def test_bad_environment_values_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env)
    assert needle in str(info.value)


def test_bad_explicit_arguments_name_the_argument() -> None:
    with pytest.raises(SettingsError, match="argument bootstrap_port"):
        load_settings({}, bootstrap_port=-1)
    with pytest.raises(SettingsError, match="argument waiting_timeout"):
        load_settings({}, waiting_timeout=0)
    with pytest.raises(TypeError, match="unknown setting"):
        load_settings({}, bootstrap_prot=1)


def test_a_bad_pdflow_value_is_not_masked_by_a_good_sglang_one() -> None:
    env = {"PDFLOW_WAITING_TIMEOUT": "soon", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30"}
    with pytest.raises(SettingsError, match="PDFLOW_WAITING_TIMEOUT"):
        load_settings(env)


def test_timeouts_and_secret_token() -> None:
    settings = load_settings({"PDFLOW_BOOTSTRAP_TOKEN": "hunter2"}, bootstrap_timeout=7.5)
    assert timeouts_from(settings) == Timeouts(bootstrap_timeout=7.5, waiting_timeout=300.0)
    assert settings.bootstrap_token == "hunter2"
    assert "hunter2" not in repr(settings) and "bootstrap_token='***'" in repr(settings)


def test_environment_default_is_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDFLOW_TRANSFER_QUEUES", "6")
    assert load_settings().transfer_queues == 6
    assert pdflow_variable("trace_enabled") == "PDFLOW_TRACE"
