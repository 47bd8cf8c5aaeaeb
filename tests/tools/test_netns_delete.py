"""``Namespace.delete`` takes a link that is already gone as deleted, and nothing else.

Deleting a namespace destroys its links a moment later, so ``ip link delete`` of a host end can
find it gone: ``Cannot find device`` when it is gone before ip looks it up, ``RTNETLINK answers:
No such device`` when it goes between the lookup and the delete (CI failed so once at double load,
in the all-faults ensemble run's clean-up). The ``ip`` commands are stubbed: this is the
clean-up's logic, not the kernel's.
"""

from __future__ import annotations

import pytest

from workers import netns
from workers.netns import Namespace, NetnsError


def stub_ip(monkeypatch: pytest.MonkeyPatch, link_delete_error: str) -> list[tuple[str, ...]]:
    calls: list[tuple[str, ...]] = []

    def ip(*args: str) -> str:
        calls.append(args)
        if args[:2] == ("link", "delete"):
            raise NetnsError(f"`ip {' '.join(args)}` failed (2): {link_delete_error}")
        return ""

    monkeypatch.setattr(netns, "_ip", ip)
    monkeypatch.setattr(netns.shutil, "which", lambda _name: None)  # no iptables rules to drop
    return calls


@pytest.mark.parametrize(
    "said", ['Cannot find device "zrt1h"', "RTNETLINK answers: No such device"]
)
def test_a_link_already_gone_counts_as_deleted(monkeypatch: pytest.MonkeyPatch, said: str) -> None:
    calls = stub_ip(monkeypatch, said)
    Namespace(tag="t1", block=200).delete()
    assert [c for c in calls if c[:2] == ("link", "delete")] == [
        ("link", "delete", "zrt1h"),
        ("link", "delete", "zzt1h"),
    ]


def test_any_other_failure_to_delete_a_link_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    stub_ip(monkeypatch, "RTNETLINK answers: Operation not permitted")
    with pytest.raises(NetnsError, match="Operation not permitted"):
        Namespace(tag="t2", block=201).delete()
