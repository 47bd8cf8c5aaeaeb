"""The HTML report as a browser draws it: a real page from a small synthetic run, rendered by
headless Chromium at 1280 x 900, must show its timeline (the screenshot is not blank and has
every worker's colour) and must not overflow sideways.

No ZooKeeper or Redis: the run is made up (:func:`synthetic_run`), realistic enough for the
checker: four keys, three workers, exclusive and shared sections, a pause that ends with one
section losing its lock and its fenced write refused, and a kill whose task is redelivered.
"""

from __future__ import annotations

import html
import json
import os
import random
import re
import shutil
import struct
import subprocess
import time
import zlib
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from workers.checker import RunReport, TaskOutcome, check_run
from workers.record import FaultRecord, Mode, SectionEvent
from workers.report import write_reports
from workers.timeline import worker_colours

WINDOW = (1280, 900)
CHROMIUM_TIMEOUT = 120.0
T0 = 1_750_000_000.0


# ------------------------------------------------------------------------------- a made-up run


@dataclass
class SyntheticRun:
    """A run's records as the load test collects them, and the checker's report of them."""

    submitted: dict[str, float]
    outcomes: dict[str, TaskOutcome]
    events: list[SectionEvent]
    faults: list[FaultRecord]
    report: RunReport


@dataclass
class _Planned:
    task_id: str
    key: str
    mode: Mode
    host: str
    pid: int
    enter: float
    exit: float | None
    """None: killed inside (a ``killed`` event closes it)."""
    outcome: str | None = "ok"
    refused: bool = False


WORKERS = (("w1@fleet", (101, 102)), ("w2@fleet", (202,)), ("w3@fleet", (302, 303)))
"""Worker node names and the pids that run their task bodies (a prefork worker has two); the
faults' holders are pids 201 (paused) and 301 (killed), which run nothing else."""


def synthetic_run(keys: int = 4, seconds: float = 20.0, seed: int = 7) -> SyntheticRun:
    """Sections over ``keys`` keys for ``seconds`` seconds by three workers, plus, on
    ``key-1``, a holder paused by a fault at 7 s whose successor enters at 8.5 s (a revoked
    overlap) and which, resumed, has its write refused and exits ``lost`` at 12 s; and on
    ``key-2`` a holder killed at 14.5 s whose task is redelivered at 15 s."""
    rng = random.Random(seed)
    plans: list[_Planned] = []
    quiet = {"key-1": (5.5, 13.0), "key-2": (13.5, 15.6)}  # the faults' stage

    def worker() -> tuple[str, int]:
        host, pids = rng.choice(WORKERS)
        return host, rng.choice(pids)

    for k in range(keys):
        key = f"key-{k}"
        at = rng.uniform(0.0, 0.6)
        while at < seconds:
            if key in quiet and quiet[key][0] - 0.8 < at < quiet[key][1]:
                at = quiet[key][1]
                continue
            if rng.random() < 0.3:  # a few readers together
                for _ in range(rng.randint(2, 3)):
                    start = at + rng.uniform(0.0, 0.15)
                    plans.append(
                        _Planned(f"t{len(plans)}", key, "shared", *worker(), start,
                                 start + rng.uniform(0.2, 0.6))
                    )  # fmt: skip
            else:
                hold = rng.uniform(0.1, 0.3) if rng.random() < 0.9 else rng.uniform(0.8, 1.5)
                plans.append(_Planned(f"t{len(plans)}", key, "exclusive", *worker(), at, at + hold))
            at = max(p.exit or 0.0 for p in plans if p.key == key) + rng.uniform(0.01, 0.4)
    paused = _Planned("t-paused", "key-1", "exclusive", "w2@fleet", 201, 6.0, 12.0, "lost", True)
    successor = _Planned("t-after", "key-1", "exclusive", "w1@fleet", 101, 8.5, 8.8)
    killed = _Planned("t-killed", "key-2", "exclusive", "w3@fleet", 301, 14.0, None)
    redelivered = _Planned("t-killed", "key-2", "exclusive", "w1@fleet", 102, 15.0, 15.3)
    plans += [paused, successor, killed, redelivered]

    tokens = {id(p): n for n, p in enumerate(sorted(plans, key=lambda p: p.enter), start=100)}
    timed: list[tuple[float, int, SectionEvent]] = []  # (time, order at one time, event)
    last_accepted: dict[str, int] = {}
    for plan in sorted(plans, key=lambda p: p.enter):
        token = tokens[id(plan)]
        enter = SectionEvent("enter", plan.task_id, plan.key, plan.mode, token,
                             hostname=plan.host, pid=plan.pid,
                             node=f"/zklock/{plan.key}/n{token}", time=T0 + plan.enter)  # fmt: skip
        timed.append((enter.time, 1, enter))
        if plan.exit is not None:
            at = T0 + plan.exit
            exit_ = replace(enter, kind="exit", time=at, outcome=plan.outcome)
            timed.append((exit_.time, 3, exit_))
            if plan.mode == "exclusive":  # readers only read: the one refused write is planned
                write = replace(enter, kind="write", time=at - 0.01, accepted=not plan.refused)
                timed.append((write.time, 2, write))
    for kind, host, pid, at in (
        ("paused", "w2@fleet", 201, 7.0),
        ("killed", "w3@fleet", 301, 14.5),
    ):
        event = SectionEvent(kind, "", "", "exclusive", 0, hostname=host, pid=pid, time=T0 + at,  # type: ignore[arg-type]
                             session_timeout=2.0 if kind == "paused" else None)  # fmt: skip
        timed.append((event.time, 0, event))
    events = []
    for _, _, event in sorted(timed, key=lambda item: (item[0], item[1])):
        if event.kind == "write":  # the fence's view: the highest token accepted so far
            event = replace(event, previous_token=last_accepted.get(event.key))
            if event.accepted:
                last_accepted[event.key] = max(event.token, last_accepted.get(event.key, 0))
        events.append(event)

    faults = [
        FaultRecord(
            "pause", T0 + 7.0,
            f"w2@fleet pid 201 (threads main process) holding key-1 (exclusive, token "
            f"{tokens[id(paused)]}, task t-paused, session 0x1000a2b3c4d0001)", True,
            "SIGSTOP until the server expired its session (10.4 s), then SIGCONT; the holder "
            "resumed, lost its lock and its fenced write was refused",
        ),
        FaultRecord(
            "kill", T0 + 14.5,
            f"w3@fleet pid 301 (prefork pool process) holding key-2 (exclusive, token "
            f"{tokens[id(killed)]}, task t-killed, session 0x1000a2b3c4d0002)", True,
            "SIGKILL; the pool replaced the process and the message was requeued at once",
        ),
    ]  # fmt: skip
    first_enter: dict[str, float] = {}
    for plan in sorted(plans, key=lambda p: p.enter):
        first_enter.setdefault(plan.task_id, plan.enter)
    submitted = {
        task: T0 + max(0.0, at - min(rng.lognormvariate(-3.0, 1.2), 3.0))
        for task, at in first_enter.items()
    }
    outcomes = {task: TaskOutcome(task, "SUCCESS") for task in submitted}
    outcomes["t-paused"] = TaskOutcome(
        "t-paused", "FAILURE", reason="LockLost: the session of the lock on key-1 expired"
    )
    report = check_run(
        submitted=submitted, outcomes=outcomes, events=events, faults=faults, leftover_nodes=0
    )
    return SyntheticRun(submitted, outcomes, events, faults, report)


# ---------------------------------------------------------------------------------- chromium


def _chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        if os.geteuid() == 0:
            pytest.fail("chromium is missing: .ci/system-deps installs it (Debian's chromium)")
        pytest.skip("chromium is not installed and, not being root, we cannot install it")
    return found


def _run_chromium(chromium: str, profile: Path, page: Path, *extra: str) -> str:
    """Run headless Chromium on ``page`` with ``extra`` arguments; return its stdout."""
    done = subprocess.run(
        [
            chromium,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            *extra,
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=CHROMIUM_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


_PROBE = """<script>
(function () {
  var root = document.documentElement, width = window.innerWidth, wide = [];
  document.querySelectorAll("body *").forEach(function (e) {
    if (e.closest(".scroll")) return;  // a table may scroll inside its own box
    var right = e.getBoundingClientRect().right, name = e.tagName + "." + e.getAttribute("class");
    if (right > width + 0.5) wide.push(name + " ends at " + right);
    else if (e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX === "visible")
      wide.push(name + " spills " + e.scrollWidth + " > " + e.clientWidth);
  });
  var probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = JSON.stringify(
    {scrollWidth: root.scrollWidth, innerWidth: width, wide: wide.slice(0, 10)});
  document.body.appendChild(probe);
})();
</script>"""


def _png_pixels(path: Path) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Width, height and RGB pixels of an 8-bit RGB or RGBA non-interlaced PNG (what Chromium
    writes), decoded with zlib alone."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, bytearray(), b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert (depth, interlace) == (8, 0) and colour in (2, 6), f"unexpected PNG {header!r}"
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(bytes(idat)), width * bpp
    previous = bytearray(stride)
    pixels: list[tuple[int, int, int]] = []
    for y in range(height):
        start = y * (stride + 1)
        kind, row = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        if kind == 1:
            for i in range(bpp, stride):
                row[i] = (row[i] + row[i - bpp]) & 0xFF
        elif kind == 2:
            row = bytearray((a + b) & 0xFF for a, b in zip(row, previous, strict=True))
        elif kind == 3:
            for i in range(stride):
                left = row[i - bpp] if i >= bpp else 0
                row[i] = (row[i] + ((left + previous[i]) >> 1)) & 0xFF
        elif kind == 4:
            for i in range(stride):
                a = row[i - bpp] if i >= bpp else 0
                b, c = previous[i], previous[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                row[i] = (row[i] + pred) & 0xFF
        else:
            assert kind == 0, f"unknown PNG filter {kind}"
        pixels.extend(zip(row[0::bpp], row[1::bpp], row[2::bpp], strict=True))
        previous = row
    return width, height, pixels


def _rgb(colour: str) -> tuple[int, int, int]:
    value = int(colour.lstrip("#"), 16)
    return value >> 16, (value >> 8) & 0xFF, value & 0xFF


# ------------------------------------------------------------------------------------- tests


def test_the_synthetic_run_has_what_the_page_must_show() -> None:
    run = synthetic_run()
    r = run.report
    assert (r.violations, r.revoked_overlaps, r.stale_writes_accepted) == (0, 1, 0)
    assert (r.revocations, r.writes_refused, r.killed_sections, r.failed) == (1, 1, 1, 1)
    assert r.malformed == ()
    assert len({e.key for e in run.events if e.key}) == 4
    assert len({e.hostname for e in run.events}) == 3
    assert len(run.faults) == 2


def test_the_report_renders_in_chromium_without_overflow(tmp_path: Path) -> None:
    chromium = _chromium()
    run = synthetic_run()
    page = write_reports(
        run.report,
        tmp_path / "out",
        events=run.events,
        faults=run.faults,
        start=min(run.submitted.values()),
    )["html"]
    text = page.read_text()
    for reference in ("<script", "<link", "<img", "src=", "href=", "url(", "@import", "//"):
        assert reference not in text, f"the page must work offline, it has {reference!r}"

    began = time.monotonic()
    probe = tmp_path / "probe.html"
    probe.write_text(text.replace("</body>", _PROBE + "\n</body>"))
    dom = _run_chromium(chromium, tmp_path / "profile-dom", probe, "--dump-dom")
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found is not None, f"the probe did not run: {dom[-500:]}"
    measured = json.loads(html.unescape(found.group(1)))
    assert measured["innerWidth"] == WINDOW[0], measured
    assert measured["scrollWidth"] <= measured["innerWidth"], (
        f"the page overflows sideways: {measured}"
    )
    assert measured["wide"] == [], f"elements past the right edge: {measured['wide']}"

    shot = tmp_path / "report.png"
    _run_chromium(chromium, tmp_path / "profile-shot", page, f"--screenshot={shot}")
    took = time.monotonic() - began
    width, height, pixels = _png_pixels(shot)
    assert (width, height) == WINDOW
    colours = Counter(pixels)
    non_white = len(pixels) - colours[(255, 255, 255)]
    assert len(colours) > 50, f"only {len(colours)} colours: a blank page?"
    assert non_white > 0.05 * len(pixels), f"only {non_white} non-white pixels"
    # Every worker's bars are drawn in its palette colour, and the lost lock's cap in red.
    for worker, colour in worker_colours(h for h, _ in WORKERS).items():
        assert colours[_rgb(colour)] >= 30, f"{worker}'s colour {colour} is not on screen"
    assert colours[_rgb("#d50000")] >= 10, "no lost-lock or refused-write mark on screen"
    print(f"rendered and measured in {took:.1f} s; screenshot {shot}")
