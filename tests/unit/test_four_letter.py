"""The four-letter-word client and parser (:mod:`celery_zklock.zk.four_letter`), against
answers as ZooKeeper 3.8 writes them and a socket of this process (no server)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from celery_zklock.zk import four_letter

SRVR = """Zookeeper version: 3.8.4-9316c2a7a97e1666d8f4593f34dd6fc36ecc436c, built on 2024-02-12 22:16 UTC
Latency min/avg/max: 0/0.0/0
Mode: follower
Node count: 5
"""  # noqa: E501
MNTR = "zk_version\t3.8.4-9316c2a7, built on 2024-02-12 22:16 UTC\nzk_synced_followers\t2\n"
CONF = "clientPort=2181\nserver.1=127.0.0.1:2888:3888:participant\ntickTime=2000\n"


def test_each_word_is_read_with_its_separator() -> None:
    srvr = four_letter.parse("srvr", SRVR)
    assert srvr["Mode"] == "follower" and srvr["Latency min/avg/max"] == "0/0.0/0"
    assert srvr["Zookeeper version"].startswith("3.8.4-9316c2a7a97e")  # the colon of 22:16 kept
    mntr = four_letter.parse("mntr", MNTR)
    assert mntr == {"zk_version": "3.8.4-9316c2a7, built on 2024-02-12 22:16 UTC",
                    "zk_synced_followers": "2"}  # fmt: skip
    conf = four_letter.parse("conf", CONF)
    assert conf["server.1"] == "127.0.0.1:2888:3888:participant" and conf["tickTime"] == "2000"
    assert four_letter.parse("srvr", "This ZooKeeper instance is not currently serving") == {}


def test_a_word_off_the_whitelist_is_an_answer_that_says_so() -> None:
    assert four_letter.refused("mntr is not executed because it is not in the whitelist.\n")
    assert not four_letter.refused(SRVR)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


def test_ask_sends_the_word_and_reads_to_the_close(listener: socket.socket) -> None:
    asked: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            asked.append(conn.recv(4))
            conn.sendall(SRVR.encode())

    server = threading.Thread(target=serve)
    server.start()
    answer = four_letter.ask("127.0.0.1", listener.getsockname()[1], "srvr", timeout=5.0)
    server.join(5)
    assert asked == [b"srvr"] and answer == SRVR


def test_nobody_answering_is_none_within_the_timeout(listener: socket.socket) -> None:
    started = time.monotonic()
    assert four_letter.ask("127.0.0.1", listener.getsockname()[1], "ruok", timeout=0.2) is None
    assert time.monotonic() - started < 2.0  # a silent listener: the read timed out
    port = listener.getsockname()[1]
    listener.close()
    assert four_letter.ask("127.0.0.1", port, "ruok", timeout=0.2) is None  # refused
