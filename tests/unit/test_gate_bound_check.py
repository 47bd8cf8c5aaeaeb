"""``doctor``'s gate bound check: a held message must go back to the broker before the broker
hands it out again; RabbitMQ's consumer_timeout is not told to clients, so doctor says it."""

from __future__ import annotations

from celery_zklock.ops.commands.checks import gate_bound_check
from tests.lockutil import app_with


def test_the_default_bound_passes_below_the_visibility_timeout() -> None:
    check = gate_bound_check(app_with({"broker_url": "redis://r:6379/0"}))
    assert check.status == "PASS" and "2880s" in check.detail and "3600s" in check.detail


def test_a_bound_at_or_past_the_visibility_timeout_fails_naming_the_setting() -> None:
    conf = {
        "broker_url": "redis://r:6379/0",
        "broker_transport_options": {"visibility_timeout": 60},
        "zklock_gate_max_hold": 60,
    }
    check = gate_bound_check(app_with(conf))
    assert check.status == "FAIL" and "zklock_gate_max_hold" in check.detail


def test_rabbitmq_is_told_to_keep_it_below_consumer_timeout() -> None:
    check = gate_bound_check(
        app_with({"broker_url": "amqp://guest@r//", "zklock_gate_max_hold": 300})
    )
    assert check.status == "INFO" and "consumer_timeout" in check.detail and "300s" in check.detail


def test_no_gate_no_bound() -> None:
    assert gate_bound_check(app_with({"zklock_gate": False})).status == "INFO"
