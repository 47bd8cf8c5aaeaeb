"""A run's critical sections on one time axis, after Jepsen's timeline, as inline SVG.

:func:`build_timeline` replays a run's section events (:mod:`workers.record`) into one
:class:`Section` per lock acquisition, with the fault records and what the checker found
(overlaps, accepted stale writes) attached; :func:`timeline_svg` draws it: one band per lock key,
one horizontal bar per section, coloured by worker. Within a key's band a section takes the
first row free when it entered (:func:`assign_rows`), so a key held exclusively keeps to one
row, shared holders stack, and two holders that overlapped stand one above the other.
:func:`select_keys` keeps a long run legible by drawing the busiest keys and every key a
violation or a fault touched. The page around it (legend, notes) is :mod:`workers.report`'s.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from html import escape
from typing import Final, TypeAlias

from workers.checker import SectionOverlap
from workers.record import FORCED_LOSS_KINDS, FaultRecord, Mode, SectionEvent

__all__ = [
    "PALETTE",
    "FaultMark",
    "OverlapSpan",
    "Section",
    "Timeline",
    "assign_rows",
    "build_timeline",
    "natural_key",
    "nice_step",
    "section_counts",
    "select_keys",
    "stack_labels",
    "timeline_svg",
    "worker_colours",
]

PALETTE: Final = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#b07aa1",
    "#76b7b2",
    "#edc948",
    "#9c755f",
    "#ff9da7",
    "#86bcb6",
    "#bab0ac",
)
"""Worker colours (Tableau 10 without its red, which marks violations and lost locks here)."""

MAX_ROWS: Final = 8
"""Rows per key band; a section that would need a further row is drawn over the last one."""

WIDTH: Final = 1160
GUTTER: Final = 150  # room for the key labels, left of the plot
RIGHT: Final = 14
ROW_H: Final = 11
ROW_GAP: Final = 3
SHARED_INSET: Final = 2  # a shared (read) section's bar is this much thinner top and bottom
BAND_PAD: Final = 5
AXIS_H: Final = 26
LABEL_H: Final = 15  # one row of fault labels above the plot
CHAR_W: Final = 6.3  # approximate width of one 11 px sans-serif character, to stagger labels

_XScale: TypeAlias = Callable[[float], float]

_HOLDING: Final = re.compile(r"\bholding (\S+)")
"""How :mod:`workers.faults` names the key of the section a fault was aimed at, in its target."""


# ------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Section:
    """One critical section, times in seconds since the timeline's start.

    ``end`` is the exit or the kill; None if neither was recorded (``ending`` is then
    ``"open"``). ``ending`` is the exit's outcome (``"ok"``, ``"lost"``, ``"error:<Type>"``;
    ``"ok"`` for an exit recorded without one) or ``"killed"``. ``refused`` and ``stale`` are
    the times of its fenced writes the fence refused, and of those it accepted that the checker
    found stale. ``hits`` are the ``(kind, time)`` of ``paused``/``expired``/``killed`` events
    for its process while it was inside. ``overlap`` is ``"violation"`` if it took part in an
    overlap the checker counts as a violation, else ``"revoked"`` if in a revoked one, else
    None.
    """

    key: str
    holder: str
    mode: Mode
    worker: str
    pid: int
    token: int
    enter: float
    end: float | None
    ending: str
    refused: tuple[float, ...] = ()
    stale: tuple[float, ...] = ()
    hits: tuple[tuple[str, float], ...] = ()
    overlap: str | None = None


@dataclass(frozen=True)
class FaultMark:
    """One fault record, its time in seconds since the timeline's start."""

    kind: str
    at: float
    target: str
    ran: bool
    detail: str


@dataclass(frozen=True)
class OverlapSpan:
    """The time an overlap lasted on ``key``: from the entering section's enter until it or
    the last conflicting section inside ended, whichever came first."""

    key: str
    start: float
    end: float
    violation: bool
    text: str


@dataclass(frozen=True)
class Timeline:
    """Everything :func:`timeline_svg` draws. ``start`` is the wall-clock time (``time.time()``)
    of t = 0; ``end`` the time of the last record, in seconds since ``start``; ``fault_keys``
    the keys of sections a fault acted on."""

    start: float
    end: float
    sections: tuple[Section, ...]
    faults: tuple[FaultMark, ...]
    overlaps: tuple[OverlapSpan, ...]
    fault_keys: frozenset[str] = field(default_factory=frozenset)

    def keys(self) -> list[str]:
        """Every key with a section, in :func:`natural_key` order."""
        return sorted({s.key for s in self.sections}, key=natural_key)

    def workers(self) -> list[str]:
        """Every worker (hostname) with a section, in :func:`natural_key` order."""
        return sorted({s.worker for s in self.sections}, key=natural_key)

    def must_show(self) -> set[str]:
        """Keys never left out: a violation, an accepted stale write, or a fault acted there."""
        return {s.key for s in self.sections if s.overlap == "violation" or s.stale} | set(
            self.fault_keys
        )

    def notable(self) -> set[str]:
        """Keys shown before merely busy ones: a lost, killed or failed section, a refused
        write or a revoked overlap."""
        return {
            s.key
            for s in self.sections
            if s.ending not in ("ok", "open") or s.refused or s.overlap is not None
        }


@dataclass
class _Open:
    enter: SectionEvent
    refused: list[float] = field(default_factory=list)
    stale: list[float] = field(default_factory=list)
    hits: list[tuple[str, float]] = field(default_factory=list)
    end: float | None = None
    ending: str = "open"


def build_timeline(
    events: Sequence[SectionEvent],
    faults: Sequence[FaultRecord] = (),
    overlaps: Sequence[SectionOverlap] = (),
    stale_writes: Sequence[SectionEvent] = (),
    start: float | None = None,
) -> Timeline:
    """The sections of ``events`` (in their list order), with ``faults`` and the checker's
    ``overlaps`` and ``stale_writes`` (:class:`workers.checker.RunReport`'s) attached.

    ``start`` is the wall-clock time of t = 0 (e.g. the first submission); by default the
    earliest event or fault. Records the checker calls malformed (a second enter, an exit or a
    write without an open enter) are left out, as the checker leaves them out of its replay.
    """
    times = [e.time for e in events] + [f.time for f in faults]
    origin = start if start is not None else min(times, default=0.0)
    stale_ids = {(e.holder, e.time) for e in stale_writes}
    sections: dict[str, _Open] = {}
    inside: dict[str, _Open] = {}
    for event in events:
        at = event.time - origin
        if event.kind == "enter":
            if event.holder not in sections:
                sections[event.holder] = inside[event.holder] = _Open(event)
        elif event.kind == "exit":
            closing = inside.pop(event.holder, None)
            if closing is not None:
                closing.end, closing.ending = at, event.outcome or "ok"
        elif event.kind == "write":
            writer = inside.get(event.holder) or sections.get(event.holder)
            if writer is None:
                continue
            if not event.accepted:
                writer.refused.append(at)
            elif (event.holder, event.time) in stale_ids:
                writer.stale.append(at)
        elif event.kind == "killed" or event.kind in FORCED_LOSS_KINDS:
            for holder, section in list(inside.items()):
                if (section.enter.hostname, section.enter.pid) == (event.hostname, event.pid):
                    section.hits.append((event.kind, at))
                    if event.kind == "killed":
                        section.end, section.ending = at, "killed"
                        del inside[holder]
    built = {
        holder: Section(
            key=s.enter.key,
            holder=holder,
            mode=s.enter.mode,
            worker=s.enter.hostname or "?",
            pid=s.enter.pid,
            token=s.enter.token,
            enter=s.enter.time - origin,
            end=s.end,
            ending=s.ending,
            refused=tuple(s.refused),
            stale=tuple(s.stale),
            hits=tuple(s.hits),
        )
        for holder, s in sections.items()
    }
    end = max((t - origin for t in times), default=0.0)
    spans, marks = _overlap_spans(overlaps, built, end)
    fault_keys = {s.key for s in built.values() if s.hits}
    for fault in faults:
        named = _HOLDING.search(fault.target) if fault.ran else None
        if named is not None:
            fault_keys.add(named.group(1))
    return Timeline(
        start=origin,
        end=end,
        sections=tuple(
            replace(s, overlap=marks[s.holder]) if s.holder in marks else s for s in built.values()
        ),
        faults=tuple(
            FaultMark(f.kind, f.time - origin, f.target, f.ran, f.detail)
            for f in sorted(faults, key=lambda f: f.time)
        ),
        overlaps=tuple(spans),
        fault_keys=frozenset(fault_keys),
    )


def _overlap_spans(
    overlaps: Sequence[SectionOverlap], sections: Mapping[str, Section], end: float
) -> tuple[list[OverlapSpan], dict[str, str]]:
    spans: list[OverlapSpan] = []
    marks: dict[str, str] = {}
    for overlap in overlaps:
        label = "violation" if not overlap.revoked else "revoked"
        entering = sections.get(overlap.entering)
        inside = [sections[h] for h in overlap.inside if h in sections]
        for holder in (overlap.entering, *overlap.inside):
            if marks.get(holder) != "violation":
                marks[holder] = label
        if entering is None or not inside:
            continue
        until = min(
            _end(entering, end), max(_end(s, end) for s in inside)
        )  # the overlap lasts while the entering section and one of those inside both are
        spans.append(
            OverlapSpan(
                key=overlap.key,
                start=entering.enter,
                end=max(until, entering.enter),
                violation=not overlap.revoked,
                text=(
                    f"{'violation' if not overlap.revoked else 'revoked overlap'}: "
                    f"{overlap.entering} ({overlap.entering_mode}) entered {overlap.key} while "
                    f"{', '.join(overlap.inside)} held it"
                ),
            )
        )
    return spans, marks


def _end(section: Section, default: float) -> float:
    return section.end if section.end is not None else default


# ------------------------------------------------------------------------------------ layout


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key putting ``key-2`` before ``key-10``: digit runs compare as numbers."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text) if part
    )


def assign_rows(
    intervals: Sequence[tuple[float, float | None]], max_rows: int = MAX_ROWS
) -> list[int]:
    """Row of each ``(start, end)`` interval (``end`` None: still open, never ends), in input
    order: taken by start time, each goes to the lowest row whose previous interval ended at or
    before its start, so intervals in one row never overlap. When all ``max_rows`` rows are
    busy it goes to the row that frees first (drawn over it: the only case rows overlap).
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    rows: list[int] = [0] * len(intervals)
    free_at: list[float] = []  # per row, when its last interval ends
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], i))
    for index in order:
        start, end = intervals[index]
        finish = math.inf if end is None else max(end, start)
        row = next((r for r, t in enumerate(free_at) if t <= start), None)
        if row is not None:
            free_at[row] = finish
        elif len(free_at) < max_rows:
            row = len(free_at)
            free_at.append(finish)
        else:
            row = min(range(len(free_at)), key=lambda r: free_at[r])
            free_at[row] = max(free_at[row], finish)
        rows[index] = row
    return rows


def select_keys(
    counts: Mapping[str, int],
    must: Iterable[str] = (),
    notable: Iterable[str] = (),
    limit: int = 12,
) -> tuple[list[str], list[str]]:
    """``(shown, left_out)``, both in :func:`natural_key` order.

    Every key of ``must`` (those of ``counts`` only) is shown, even beyond ``limit``; the rest
    of the ``limit`` goes first to the keys of ``notable``, then to the keys with the highest
    ``counts`` (ties: natural order).
    """
    must_set = set(must) & set(counts)
    notable_set = set(notable)
    ranked = sorted(
        (k for k in counts if k not in must_set),
        key=lambda k: (k not in notable_set, -counts[k], natural_key(k)),
    )
    room = max(0, limit - len(must_set))
    shown = must_set | set(ranked[:room])
    return (
        sorted(shown, key=natural_key),
        sorted((k for k in counts if k not in shown), key=natural_key),
    )


def worker_colours(workers: Iterable[str]) -> dict[str, str]:
    """A colour of :data:`PALETTE` per worker, given in :func:`natural_key` order of the names
    (the same names always get the same colours); past ten workers the palette repeats."""
    ordered = sorted(set(workers), key=natural_key)
    return {w: PALETTE[i % len(PALETTE)] for i, w in enumerate(ordered)}


def nice_step(span: float, target: int = 10) -> float:
    """A tick step of 1, 2 or 5 times a power of ten giving about ``target`` ticks over
    ``span`` (> 0)."""
    raw = span / max(target, 1)
    if raw <= 0 or not math.isfinite(raw):
        return 1.0
    power = 10.0 ** math.floor(math.log10(raw))
    return next((m * power for m in (1, 2, 5) if m * power >= raw), 10 * power)


# ----------------------------------------------------------------------------------- drawing


def timeline_svg(timeline: Timeline, keys: Sequence[str]) -> str:
    """An inline ``<svg>`` of ``timeline``'s sections on ``keys`` (in that order, one band
    each) with every fault as a labelled vertical line; sections, overlaps, writes and faults
    carry their particulars in ``<title>`` tooltips. Colours and marks follow
    :func:`worker_colours` and the classes of :mod:`workers.report`'s style sheet.
    """
    colours = {w: PALETTE.index(c) for w, c in worker_colours(timeline.workers()).items()}
    by_key: dict[str, list[Section]] = {k: [] for k in keys}
    for section in timeline.sections:
        if section.key in by_key:
            by_key[section.key].append(section)
    span = max(timeline.end, 1e-3)
    plot_w = WIDTH - GUTTER - RIGHT

    def x(at: float) -> float:
        return GUTTER + plot_w * min(max(at, 0.0), span) / span

    label_rows = stack_labels(
        [(x(f.at), x(f.at) + 2 + len(_fault_label(f)) * CHAR_W) for f in timeline.faults]
    )
    top = 8 + LABEL_H * (max(label_rows, default=-1) + 1)
    parts: list[str] = []
    bands: list[str] = []
    y = top
    for band, key in enumerate(keys):
        sections = sorted(by_key[key], key=lambda s: (s.enter, s.holder))
        rows = assign_rows([(s.enter, s.end) for s in sections])
        height = 2 * BAND_PAD + (max(rows, default=0) + 1) * (ROW_H + ROW_GAP) - ROW_GAP
        bands.append(
            f'<rect class="band{band % 2}" x="0" y="{y}" width="{WIDTH}" height="{height}"/>'
            f'<text class="key" x="{GUTTER - 8}" y="{y + BAND_PAD + ROW_H - 1}" '
            f'text-anchor="end"><title>{escape(key)}: {len(sections)} sections</title>'
            f'{escape(_clip(key, 18))} <tspan class="count">{len(sections)}</tspan></text>'
        )
        for overlap in timeline.overlaps:
            if overlap.key == key:
                x0 = x(overlap.start)
                parts.append(
                    f'<rect class="{"violation" if overlap.violation else "revoked"}" '
                    f'x="{x0 - 2:.1f}" y="{y}" width="{max(x(overlap.end) - x0, 0) + 4:.1f}" '
                    f'height="{height}"><title>{escape(overlap.text)}</title></rect>'
                )
        for section, row in zip(sections, rows, strict=True):
            parts.append(
                _bar(section, y + BAND_PAD + row * (ROW_H + ROW_GAP), colours, x, timeline.end)
            )
        y += height
    bottom = y
    parts.extend(_faults(timeline.faults, label_rows, x, top, bottom))
    axis = _axis(span, x, top, bottom)
    height = bottom + AXIS_H
    return (
        f'<svg class="timeline" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        f'role="img" aria-label="timeline of the critical sections per lock key">'
        f"{''.join(bands)}{axis}{''.join(parts)}</svg>\n"
    )


def _bar(
    section: Section,
    y: float,
    colours: Mapping[str, int],
    x: _XScale,
    run_end: float,
) -> str:
    end = _end(section, run_end)
    x0, x1 = x(section.enter), x(end)
    width = max(x1 - x0, 1.2)
    classes = f"s w{colours.get(section.worker, 0)}"
    if section.mode == "shared":
        classes += " shared"
    if section.ending == "open":
        classes += " open"
    if section.overlap == "violation":
        classes += " inviolation"
    tip = (
        f"{section.key} {section.mode}: {section.holder} on {section.worker} pid {section.pid}, "
        f"token {section.token}; entered at {section.enter:.3f} s, "
        + (
            f"still inside at the end ({end - section.enter:.3f} s)"
            if section.end is None
            else f"{section.ending} at {end:.3f} s after {end - section.enter:.3f} s"
        )
        + "".join(f"; {kind} at {at:.3f} s" for kind, at in section.hits)
        + "".join(f"; fenced write refused at {at:.3f} s" for at in section.refused)
        + "".join(f"; stale write accepted at {at:.3f} s" for at in section.stale)
        + (f"; {section.overlap} overlap" if section.overlap else "")
    )
    inset = SHARED_INSET if section.mode == "shared" else 0
    out = [
        f'<rect class="{classes}" x="{x0:.2f}" y="{y + inset}" width="{width:.2f}" '
        f'height="{ROW_H - 2 * inset}"><title>{escape(tip)}</title></rect>'
    ]
    cap = {
        "ok": None,
        "open": None,
        "lost": "cap-lost",
        "preempted": "cap-lost",
        "killed": "cap-killed",
    }.get(section.ending, "cap-error")
    if cap is not None:
        out.append(
            f'<rect class="{cap}" x="{x0 + width - 3:.2f}" y="{y - 2}" width="3" '
            f'height="{ROW_H + 4}"/>'
        )
    for kind, at in section.hits:
        if kind != "killed":  # a kill is the black cap already
            out.append(
                f'<rect class="hit" x="{x(at) - 1:.2f}" y="{y - 3}" width="2" '
                f'height="{ROW_H + 6}"><title>{kind} at {at:.3f} s</title></rect>'
            )
    mid = y + ROW_H / 2
    for at in section.refused:
        cx = x(at)
        out.append(
            f'<path class="refused" d="M{cx - 5:.1f} {mid - 7:.1f}h10l-5 8z">'
            f"<title>fenced write refused at {at:.3f} s (token {section.token})</title></path>"
        )
    for at in section.stale:
        cx = x(at)
        out.append(
            f'<path class="stale" d="M{cx:.1f} {mid - 6:.1f}l5 6-5 6-5-6z">'
            f"<title>stale write accepted at {at:.3f} s (token {section.token})</title></path>"
        )
    return "".join(out)


def _faults(
    faults: Sequence[FaultMark], rows: Sequence[int], x: _XScale, top: float, bottom: float
) -> list[str]:
    out = []
    for fault, row in zip(faults, rows, strict=True):
        fx = x(fault.at)
        label_y = 8 + LABEL_H * row + 10
        kind = "fault" if fault.ran else "fault notrun"
        tip = (
            f"{fault.kind} at {fault.at:.3f} s"
            + (f" on {fault.target}" if fault.target else "")
            + (": " if fault.ran else ": NOT RUN: ")
            + fault.detail
        )
        out.append(
            f'<g class="{kind}"><title>{escape(tip)}</title>'
            f'<line x1="{fx:.1f}" y1="{label_y + 3}" x2="{fx:.1f}" y2="{bottom}"/>'
            f'<text x="{fx + 2:.1f}" y="{label_y}">{escape(_fault_label(fault))}</text></g>'
        )
    return out


def _fault_label(fault: FaultMark) -> str:
    return fault.kind if fault.ran else f"{fault.kind} (not run)"


def stack_labels(spans: Sequence[tuple[float, float]], gap: float = 4.0) -> list[int]:
    """Row of each label spanning ``(x0, x1)``, in input order: the lowest row in which it
    keeps ``gap`` clear of every label placed there before it."""
    placed: list[list[tuple[float, float]]] = []
    rows = []
    for x0, x1 in spans:
        row = next(
            (
                r
                for r, taken in enumerate(placed)
                if all(x1 + gap <= a or b + gap <= x0 for a, b in taken)
            ),
            len(placed),
        )
        if row == len(placed):
            placed.append([])
        placed[row].append((x0, x1))
        rows.append(row)
    return rows


def _axis(span: float, x: _XScale, top: float, bottom: float) -> str:
    step = nice_step(span)
    ticks = []
    for i in range(int(span / step + 1e-9) + 1):
        at = i * step
        tx = x(at)
        ticks.append(
            f'<line class="grid" x1="{tx:.1f}" y1="{top}" x2="{tx:.1f}" y2="{bottom}"/>'
            f'<text x="{tx:.1f}" y="{bottom + 14}" text-anchor="middle">{at:g}</text>'
        )
    return "".join(ticks) + (
        f'<text x="{GUTTER - 8}" y="{bottom + 14}" text-anchor="end">seconds</text>'
    )


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def section_counts(timeline: Timeline) -> Counter[str]:
    """Sections per key."""
    return Counter(s.key for s in timeline.sections)
