"""``python -m workers [celery worker options...]``: start one fleet worker.

The single entry point of every fleet worker: compose's ``worker`` service, the demo and the
fleet launcher all run it (:func:`worker_command` builds the command line). It reads the
settings (:mod:`workers.settings`), exits with status 2 and a message naming each bad or
missing variable if they are wrong, and otherwise runs ``celery worker`` for
``workers.app:app`` in this process with the arguments of :func:`worker_argv`: the pool and
concurrency from the settings, ``--without-mingle --without-gossip --without-heartbeat`` (no
start-up sync or worker-to-worker chatter, so a worker is ready in about half a second) and
``-l info``. Extra command-line arguments are appended, so they override those (e.g.
``-n name@%h`` for the node name, ``-c 8``). The exit status is the worker's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from workers.settings import Settings, SettingsError, load_settings

__all__ = ["effective_pool", "main", "worker_argv", "worker_command"]


def worker_argv(settings: Settings, extra: Sequence[str] = ()) -> list[str]:
    """The ``celery`` arguments (starting with ``worker``) of a fleet worker."""
    return [
        "worker",
        "--pool",
        settings.pool,
        "--concurrency",
        str(settings.concurrency),
        "--without-mingle",
        "--without-gossip",
        "--without-heartbeat",
        "--loglevel",
        "info",
        *extra,
    ]


def worker_command(extra: Sequence[str] = (), *, python: str | None = None) -> list[str]:
    """The command line that starts a fleet worker as a subprocess.

    ``python`` defaults to this interpreter. The worker reads its settings from the
    subprocess's environment (``Settings.to_env()`` gives them); ``extra`` is appended to the
    ``celery worker`` arguments.
    """
    return [python or sys.executable, "-m", "workers", *extra]


def main(argv: Sequence[str] | None = None) -> int:
    """Run a worker until it is told to stop; return its exit status (2: bad settings)."""
    extra = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"python -m workers: {exc}", file=sys.stderr)
        return 2
    argv = worker_argv(settings, extra)
    # `celery worker -P gevent` monkey-patches in celery's own __main__, before anything else is
    # imported; this entry point must do the same, before the app (kazoo, redis) is imported.
    from celery import maybe_patch_concurrency

    maybe_patch_concurrency(["celery", "--pool", effective_pool(argv)])
    from workers.app import app

    # app.start() rather than app.worker_main(): the same command, but it returns the exit code.
    status = app.start(argv)
    return int(status or 0)


def effective_pool(argv: Sequence[str]) -> str:
    """The pool a ``celery worker`` command line selects: its last ``-P``/``--pool`` option."""
    pool = "prefork"
    for i, arg in enumerate(argv):
        if arg in ("-P", "--pool") and i + 1 < len(argv):
            pool = argv[i + 1]
        elif arg.startswith("--pool="):
            pool = arg.split("=", 1)[1]
        elif arg.startswith("-P") and len(arg) > 2:
            pool = arg[2:].lstrip("=")
    return pool


if __name__ == "__main__":
    sys.exit(main())
