"""The fleet's ``ZKLOCK_*`` settings (``workers.settings``) are checked by the library's shared
validators (celery_zklock.zk.validate): the same rule and the same words as the app settings
(tests/unit/test_validate.py)."""

from __future__ import annotations

import math

import pytest

from workers.settings import Settings, SettingsError


def test_the_fleet_settings_use_the_shared_rules() -> None:
    with pytest.raises(SettingsError, match="ZKLOCK_SESSION_TIMEOUT must be a number of seconds"):
        Settings("h:1", "redis://h/0", "redis://h/0", "redis://h/0", session_timeout=math.nan)
    assert Settings("h:1", "redis://h", "redis://h", "redis://h", zk_root="/x/").zk_root == "/x"
