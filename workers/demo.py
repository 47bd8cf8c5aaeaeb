"""The local end-to-end demo (``make demo``, ``python -m workers demo``): the load test, demo-sized.

:mod:`workers.loadtest` with defaults for about a minute on a laptop: a standalone ZooKeeper,
a persistent broker Redis and a records Redis of our own, three workers (prefork, threads,
prefork; two processes/threads each), 160 tasks over 6 keys mixing exclusive and shared
sections that skip or wait when busy, sent over 40 s, while one fault of each kind that needs
no ensemble or namespace strikes a worker inside a section: ``kill``, ``pause``, ``expire``,
``broker_restart`` and ``stall_before_write``, the one whose holder writes after its successor,
so the fence refuses a write in every demo (a 4 s session timeout keeps the pauses short).
Every load test option can override a default (``--help``). It ends with the
``zklock-report:`` line and exits 0 only if the report is ok.
"""

from __future__ import annotations

import argparse
import sys
from typing import Final

from celery_zklock.testing.cli import Subcommand
from workers.loadtest import LoadConfig, config_from_args, configure_parser, run_command

__all__ = ["COMMAND", "DEMO", "main"]

DEMO: Final = LoadConfig(
    tasks=160,
    keys=6,
    shared_ratio=0.3,
    skip_ratio=0.3,
    hold_ms=200,
    duration=40.0,
    workers=3,
    pools=("prefork", "threads"),
    concurrency=2,
    session_timeout=4.0,
    zk_nodes=1,
    faults={"kill": 1, "pause": 1, "expire": 1, "broker_restart": 1, "stall_before_write": 1},
    wait_timeout=10.0,
    name="demo",
)
"""The demo's defaults."""

_HELP: Final = (
    "Run the load test demo-sized on a local ZooKeeper and Redis: locked tasks on three real "
    "workers, a kill, a pause, a session expiry, a broker restart and a write stalled past its "
    "holder's session (the fence refuses it), a checked report."
)


def _configure(parser: argparse.ArgumentParser) -> None:
    configure_parser(parser, DEMO)


def _run(args: argparse.Namespace) -> int:
    return run_command(args, "demo")


COMMAND: Final = Subcommand(name="demo", help=_HELP, configure=_configure, run=_run)
"""``python -m workers demo``."""


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.demo [options]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m workers.demo", description=_HELP)
    _configure(parser)
    args = parser.parse_args(argv)
    config_from_args(args, "demo", parser)  # usage errors exit here, before anything starts
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
