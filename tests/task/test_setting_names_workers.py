"""Every mistake named where a user meets it (issue 46, items 1 and 2), with real `celery worker`
and `celery zklock doctor` processes of tests.settingsapp: a misspelt app setting and a
misspelt environment variable each get one warning naming the right name, at worker start
(however many processes of the worker read the settings) and in doctor; a misspelt task option
stops the worker with one line naming the task and the option, no traceback; so do a misspelt
hosts setting and a hosts string with a URL scheme."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from celery_zklock.testing.celery_worker import CeleryWorker, celery_command, wait_until_answering
from tests.conftest import SESSION_TIMEOUT, empty_broker
from tests.workerproc import ROOT

SETTING_TYPO = (
    "celery-zklock: unknown setting zklock_session_timout in app.conf, ignored: "
    "did you mean zklock_session_timeout?"
)
VARIABLE_TYPO = (
    "celery-zklock: unknown environment variable ZKLOCK_SESSION_TIMOUT, ignored: "
    "did you mean ZKLOCK_SESSION_TIMEOUT?"
)
QUEUE = "settingsapp"


def environment(zk_hosts: str, redis_url: str, **extra: str) -> dict[str, str]:
    """The processes' environment: this suite's, without its ``ZKLOCK_*`` variables, and the
    app's broker and ZooKeeper."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("ZKLOCK_")}
    return {
        **base,
        "PYTHONPATH": str(ROOT),
        "SETTINGSAPP_BROKER": redis_url,
        "ZKLOCK_HOSTS": zk_hosts,
        "ZKLOCK_SESSION_TIMEOUT": str(SESSION_TIMEOUT),
        **extra,
    }


def misspelt(zk_hosts: str, redis_url: str) -> dict[str, str]:
    """An app setting and an environment variable, each misspelt."""
    return environment(
        zk_hosts,
        redis_url,
        SETTINGSAPP_CONF=json.dumps({"zklock_session_timout": 8.0}),
        ZKLOCK_SESSION_TIMOUT="8",
    )


def said(text: str) -> list[str]:
    """The lines of ``text`` that name a setting that is none (a log line has them at its end)."""
    return [line[line.index("celery-zklock: unknown") :] for line in text.splitlines()
            if "celery-zklock: unknown" in line]  # fmt: skip


def test_a_worker_warns_once_of_a_misspelt_setting_and_variable(
    zk_hosts: str, redis_url: str, tmp_path: Path
) -> None:
    """Once each, from the worker's start on: the main process (worker_init, its gate) and a
    pool process running a locked call all read the settings."""
    empty_broker(redis_url)
    sender = Celery("sender", broker=redis_url, backend=redis_url)
    worker = CeleryWorker(
        celery_command("tests.settingsapp", "prefork", 2),
        nodename="names@%h",
        queues=[QUEUE],
        log_path=tmp_path / "worker.log",
        cwd=ROOT,
        env=misspelt(zk_hosts, redis_url),
    )
    worker.spawn()
    try:
        wait_until_answering(sender, [worker], timeout=30)
        result = sender.send_task("tests.settingsapp.locked", ("k",), queue=QUEUE)
        assert result.get(timeout=30) == "k"
    finally:
        worker.stop()
    log = worker.log_text()
    print(log[-3000:])
    assert "Task tests.settingsapp.locked" in log and "succeeded" in log  # a pool process ran it
    assert sorted(said(log)) == sorted([SETTING_TYPO, VARIABLE_TYPO])


def test_doctor_names_a_misspelt_setting_and_variable_once(zk_hosts: str, redis_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.settingsapp", "zklock", "doctor"],
        cwd=ROOT, env=misspelt(zk_hosts, redis_url), capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    print(done.stdout, done.stderr)
    assert done.returncode == 0, done.stdout + done.stderr  # a WARN does not fail doctor
    assert "WARN  setting names: " + SETTING_TYPO.removeprefix("celery-zklock: ") in done.stdout
    assert "WARN  setting names: " + VARIABLE_TYPO.removeprefix("celery-zklock: ") in done.stdout
    both = done.stdout + done.stderr
    assert both.count("zklock_session_timout") == both.count("ZKLOCK_SESSION_TIMOUT") == 1
    # And the misspelt names changed nothing: the request is the right names' 4 s, not 8 s.
    assert f"session timeout requested {SESSION_TIMEOUT:g}s" in done.stdout


def refused_start(env: dict[str, str]) -> list[str]:
    """A worker of tests.settingsapp that must not start: its output's lines."""
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.settingsapp", "worker", "--pool", "solo",
         "--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "info",
         "-Q", QUEUE],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    print(output)
    assert done.returncode != 0
    assert "Traceback" not in output
    return [line for line in output.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("mistake", "task"),
    [("option", "tests.settingsapp.misspelt"), ("base", "tests.settingsapp.inherits")],
)
def test_a_misspelt_task_option_stops_the_worker_with_one_line(
    mistake: str, task: str, zk_hosts: str, redis_url: str
) -> None:
    """In the decorator (Celery makes the task's class when the worker finalizes the app, before
    any signal) or in a shared base class (seen when the task is bound)."""
    lines = refused_start(environment(zk_hosts, redis_url, SETTINGSAPP_MISTAKE=mistake))
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"celery-zklock: task {task!r}: unknown lock option 'lock_on_bussy' "
        "(did you mean 'lock_on_busy'?); the lock options are: lock_name, lock_key"
    )


def test_a_misspelt_hosts_setting_stops_the_worker_naming_it(zk_hosts: str, redis_url: str) -> None:
    env = environment(zk_hosts, redis_url, SETTINGSAPP_CONF=json.dumps({"zklock_host": zk_hosts}))
    del env["ZKLOCK_HOSTS"]
    lines = refused_start(env)
    hint = "unknown setting zklock_host in app.conf, ignored: did you mean zklock_hosts?"
    assert lines == [
        f"celery-zklock: {hint}",
        f"celery-zklock: ZooKeeper hosts are empty ({hint}): set app.conf.zklock_hosts or the "
        "ZKLOCK_HOSTS environment variable, e.g. 'zk1:2181,zk2:2181,zk3:2181'",
    ]


def test_hosts_with_a_scheme_stop_the_worker_with_the_format(zk_hosts: str, redis_url: str) -> None:
    env = environment(zk_hosts, redis_url, ZKLOCK_HOSTS=f"zk://{zk_hosts}")
    assert refused_start(env) == [
        f"celery-zklock: zklock_hosts (env ZKLOCK_HOSTS) 'zk://{zk_hosts}': a ZooKeeper "
        "connection string has no scheme (zk://); give host:port[,host:port...][/chroot], here "
        f"'{zk_hosts}'"
    ]
