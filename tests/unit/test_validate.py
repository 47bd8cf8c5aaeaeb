"""The shared validators: one rule per kind of setting value, the same message wherever used."""

from __future__ import annotations

import argparse
import math

import pytest

from celery_zklock.errors import ConfigurationError
from celery_zklock.testing import RedisServer, ZooKeeperOptions
from celery_zklock.zk.settings import client_config, settings_of
from celery_zklock.zk.validate import argument, positive_int, seconds, znode_path
from tests.lockutil import app_with


def test_seconds_accepts_finite_numbers_and_text_when_asked() -> None:
    assert seconds("t", 2) == 2.0
    assert seconds("t", 0.5) == 0.5
    assert seconds("t", 0, zero=True) == 0.0
    assert seconds("t", " 2.5 ", text=True) == 2.5


@pytest.mark.parametrize(
    ("value", "options", "message"),
    [
        (0, {}, "t must be a number of seconds > 0, got 0"),
        (-1, {"zero": True}, "t must be a number of seconds >= 0, got -1"),
        (True, {}, "t must be a number of seconds > 0, got True"),
        ("5", {}, "t must be a number of seconds > 0, got '5'"),
        ("soon", {"text": True}, "t must be a number of seconds > 0, got 'soon'"),
        ("-1", {"text": True}, "t must be a number of seconds > 0, got -1.0"),
        (math.inf, {}, "got inf (not finite)"),
        ("nan", {"text": True}, "got nan (not finite)"),
        (10**400, {}, "(not finite)"),
        (None, {"advice": ", or None"}, "got None, or None"),
    ],
)
def test_seconds_refuses(value: object, options: dict[str, bool], message: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        seconds("t", value, **options)  # type: ignore[arg-type]
    assert message in str(refused.value)


def test_positive_int() -> None:
    assert positive_int("n", 3) == 3
    assert positive_int("n", " 8 ", text=True) == 8
    for bad in (0, -2, 2.0, True, "3", None):
        with pytest.raises(ConfigurationError, match="n must be a whole number >= 1, got"):
            positive_int("n", bad)
    with pytest.raises(ConfigurationError, match="got 'x'"):
        positive_int("n", "x", text=True)


def test_znode_path() -> None:
    assert znode_path("p", "/zklock") == "/zklock"
    assert znode_path("p", "/a/b/") == "/a/b"
    for bad, why in (
        ("zklock", "not absolute"),
        ("/", "the root itself"),
        ("/a//b", "empty"),
        ("/a/../b", "'..'"),
        ("/a\x00", "U+0000"),
        (7, "not a string"),
    ):
        with pytest.raises(ConfigurationError, match="p must be an absolute znode path") as caught:
            znode_path("p", bad)
        assert why in str(caught.value)


def test_argument_turns_a_validator_into_an_argparse_type() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=argument(positive_int))
    parser.add_argument("--t", type=argument(seconds, zero=True))
    args = parser.parse_args(["--n", "4", "--t", "0"])
    assert (args.n, args.t) == (4, 0.0)
    assert argument(positive_int).__name__ == "positive_int"
    with pytest.raises(argparse.ArgumentTypeError, match="whole number >= 1, got 0"):
        argument(positive_int)("0")


def test_every_user_says_the_same() -> None:
    """The app settings and the stack's options share the rules (the fleet's variables too:
    tests/tools/test_fleet_settings.py)."""
    with pytest.raises(ConfigurationError, match="zklock_session_timeout must be a number of"):
        client_config({"zklock_hosts": "h:1", "zklock_session_timeout": "0"})
    assert client_config({"zklock_hosts": "h:1", "zklock_session_timeout": "2.5"}).session_timeout
    app = app_with({"zklock_root": "/apps/locks/"})
    assert settings_of(app, connection=False).root == "/apps/locks"
    app = app_with({"zklock_root": "/a//b"})
    with pytest.raises(ConfigurationError, match="zklock_root must be an absolute znode path"):
        _ = settings_of(app, connection=False).root
    with pytest.raises(ValueError, match="tick_time_ms must be a whole number >= 1, got 0"):
        ZooKeeperOptions(tick_time_ms=0)
    with pytest.raises(ValueError, match="start_attempts must be a whole number >= 1, got 0"):
        RedisServer(start_attempts=0)
