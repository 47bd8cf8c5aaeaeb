"""The lock tests' own helpers (tests/lockutil.py), on a real ZooKeeper."""

from __future__ import annotations

import pytest
from kazoo.client import KazooClient

from tests.lockutil import children


def test_children_of_a_parent_reaped_while_it_is_read_are_none(
    zk_client: KazooClient, lock_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty lock's parent is a container the server reaps at any moment, also between two
    requests of one look. Reaped right after an ``exists`` saw it, it has no children; before
    the fix the look raised NoNodeError (test_lock_recovery failed so once, at double load)."""
    path = f"{lock_root}/k"
    zk_client.create(f"{path}/node", makepath=True)
    assert children(zk_client, path) == ["node"]
    exists = zk_client.exists

    def exists_then_reaped(*args: object, **kwargs: object) -> object:
        stat = exists(*args, **kwargs)  # type: ignore[arg-type]
        zk_client.delete(path, recursive=True)  # the reaper, right after the look
        return stat

    monkeypatch.setattr(zk_client, "exists", exists_then_reaped)
    zk_client.delete(f"{path}/node")  # empty now, as a released lock's parent
    assert children(zk_client, path) == []
    assert children(zk_client, f"{lock_root}/never-made") == []
