"""The mutual-exclusion witness: checker on hand-written histories, writer across processes."""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import ForkContext, SpawnContext
from multiprocessing.synchronize import Event as EventType
from multiprocessing.synchronize import Lock as LockType
from pathlib import Path

import pytest

from celery_zklock.testing.exclusion import Exclusion
from celery_zklock.testing.witness import Overlap, Witness, check_witness


def _history(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "witness.log"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# --- checker on hand-written histories ---------------------------------------------------------


def test_sequential_writers_are_clean(tmp_path: Path) -> None:
    path = _history(
        tmp_path,
        "enter a write",
        "exit a write",
        "enter b write",
        "exit b write",
        "enter a write",
        "exit a write",
    )
    report = check_witness(path)
    assert report.sections == 3
    assert report.max_readers == 0
    assert report.overlaps == []
    assert report.unfinished == []
    assert report.ok


def test_overlapping_writers_are_reported(tmp_path: Path) -> None:
    path = _history(
        tmp_path,
        "enter a write",
        "enter b write",
        "exit a write",
        "exit b write",
    )
    report = check_witness(path)
    assert report.overlaps == [Overlap(line_no=2, holder="b", mode="write", inside=("a",))]
    assert report.sections == 2
    assert not report.ok


def test_writer_entering_among_readers_is_reported(tmp_path: Path) -> None:
    path = _history(
        tmp_path,
        "enter r1 read",
        "enter r2 read",
        "enter w write",
        "exit w write",
        "exit r1 read",
        "exit r2 read",
    )
    report = check_witness(path)
    assert report.overlaps == [Overlap(line_no=3, holder="w", mode="write", inside=("r1", "r2"))]
    assert report.max_readers == 2


def test_reader_inside_writer_is_reported(tmp_path: Path) -> None:
    path = _history(
        tmp_path,
        "enter r1 read",
        "enter w write",  # overlap 1: writer while a reader is inside
        "exit r1 read",
        "enter r2 read",  # overlap 2: reader while the writer is inside
        "exit r2 read",
        "exit w write",
    )
    report = check_witness(path)
    assert report.overlaps == [
        Overlap(line_no=2, holder="w", mode="write", inside=("r1",)),
        Overlap(line_no=4, holder="r2", mode="read", inside=("w",)),
    ]


def test_readers_together_are_fine(tmp_path: Path) -> None:
    path = _history(
        tmp_path,
        "enter r1 read",
        "enter r2 read",
        "enter r3 read",
        "exit r2 read",
        "exit r1 read",
        "exit r3 read",
        "enter w write",
        "exit w write",
        "enter r4 read",
        "exit r4 read",
    )
    report = check_witness(path)
    assert report.ok
    assert report.sections == 5
    assert report.max_readers == 3


def test_unfinished_section_is_reported(tmp_path: Path) -> None:
    path = _history(
        tmp_path,
        "enter a write",
        "exit a write",
        "enter r1 read",
        "enter r2 read",
        "exit r1 read",
    )
    report = check_witness(path)
    assert report.unfinished == ["r2"]
    assert report.sections == 2
    assert report.overlaps == []
    assert not report.ok


def test_empty_file_is_an_empty_report(tmp_path: Path) -> None:
    path = tmp_path / "empty.log"
    path.touch()
    report = check_witness(path)
    assert (report.sections, report.max_readers, report.overlaps, report.unfinished) == (
        0,
        0,
        [],
        [],
    )


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["exit a write"], "without enter"),
        (["enter a write", "exit b write"], "without enter"),
        (["enter a read", "exit a write"], "entered as read"),
        (["enter a write", "enter a write"], "entered again"),
        (["enter a exclusive"], "malformed"),
        (["enter a"], "malformed"),
        (["enter  a write"], "malformed"),
        (["leave a write"], "malformed"),
        ([""], "malformed"),
    ],
)
def test_broken_histories_raise(tmp_path: Path, lines: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_witness(_history(tmp_path, *lines))


def test_truncated_last_line_raises(tmp_path: Path) -> None:
    path = tmp_path / "witness.log"
    path.write_text("enter a write\nexit a wr", encoding="utf-8")
    with pytest.raises(ValueError, match="newline"):
        check_witness(path)


# --- writer -----------------------------------------------------------------------------------


def test_section_writes_exit_when_the_body_raises(tmp_path: Path) -> None:
    path = tmp_path / "witness.log"
    witness = Witness(path)
    with pytest.raises(RuntimeError), witness.section("h1", "write"):
        raise RuntimeError("boom")
    with witness.section("h2", "read"):
        pass
    witness.close()
    assert path.read_text(encoding="utf-8").splitlines() == [
        "enter h1 write",
        "exit h1 write",
        "enter h2 read",
        "exit h2 read",
    ]


@pytest.mark.parametrize(("holder", "mode"), [("a b", "write"), ("", "read"), ("a", "shared")])
def test_writer_rejects_ids_and_modes_it_cannot_encode(
    tmp_path: Path, holder: str, mode: str
) -> None:
    witness = Witness(tmp_path / "witness.log")
    with pytest.raises(ValueError):
        witness.enter(holder, mode)  # type: ignore[arg-type]
    assert not (tmp_path / "witness.log").exists()


PROCESSES = 6
SECTIONS_EACH = 300
# Long ids make each line a few hundred bytes, so torn or interleaved writes would show.
LONG = "x" * 240


def _append_sections(witness: Witness, worker: int, lock: LockType | None) -> None:
    for i in range(SECTIONS_EACH):
        holder = f"p{worker}-{i}-{LONG}"
        if lock is None:
            with witness.section(holder, "read"):
                pass
        else:
            with lock, witness.section(holder, "write"):
                pass


@pytest.mark.parametrize(
    "ctx",
    [
        # Only spawn: forking a pytest process that already runs other tests' kazoo threads
        # can deadlock the child. spawn pickles the Witness: only its path travels.
        pytest.param(multiprocessing.get_context("spawn"), id="spawn"),
    ],
)
def test_concurrent_writers_give_a_well_formed_file(
    tmp_path: Path, ctx: ForkContext | SpawnContext
) -> None:
    path = tmp_path / "witness.log"
    witness = Witness(path)
    procs = [
        ctx.Process(target=_append_sections, args=(witness, n, None)) for n in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2 * PROCESSES * SECTIONS_EACH
    report = check_witness(path)  # raises on any torn or interleaved line
    assert report.sections == PROCESSES * SECTIONS_EACH
    assert report.ok
    assert report.max_readers >= 1


def test_real_lock_across_processes_leaves_no_overlap(tmp_path: Path) -> None:
    path = tmp_path / "witness.log"
    ctx = multiprocessing.get_context("spawn")
    lock = ctx.Lock()
    witness = Witness(path)
    procs = [ctx.Process(target=_append_sections, args=(witness, n, lock)) for n in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    report = check_witness(path)
    assert report.ok
    assert report.sections == 3 * SECTIONS_EACH


def _hold_until(witness: Witness, holder: str, entered: EventType, leave: EventType) -> None:
    with witness.section(holder, "write"):
        entered.set()
        leave.wait(30)


def test_overlap_between_processes_is_caught(tmp_path: Path) -> None:
    """Two processes forced to be inside together: the checker must say so."""
    path = tmp_path / "witness.log"
    ctx = multiprocessing.get_context("spawn")
    witness = Witness(path)
    a_in, b_in, leave = ctx.Event(), ctx.Event(), ctx.Event()
    a = ctx.Process(target=_hold_until, args=(witness, "a", a_in, leave))
    b = ctx.Process(target=_hold_until, args=(witness, "b", b_in, leave))
    a.start()
    assert a_in.wait(30)
    b.start()
    assert b_in.wait(30)
    leave.set()
    for p in (a, b):
        p.join(timeout=30)
        assert p.exitcode == 0
    report = check_witness(path)
    assert report.overlaps == [Overlap(line_no=2, holder="b", mode="write", inside=("a",))]
    assert report.sections == 2


# --- the overlap rule, as the fleet's checker uses it ----------------------------------------


def test_exclusion_keeps_keys_apart_and_closes_a_dead_process() -> None:
    inside: Exclusion[int] = Exclusion()  # a section keeps its process id
    assert inside.enter("k1", "r1", False, 1) == []
    assert inside.enter("k1", "r2", False, 2) == []  # readers together
    assert inside.enter("k2", "w1", True, 1) == []  # another key
    assert inside.enter("k1", "w2", True, 3) == [("r1", 1), ("r2", 2)]
    assert inside.enter("k1", "r3", False, 3) == [("w2", 3)]  # a reader overlaps writers only
    assert inside.shared("k1") == 3
    with pytest.raises(ValueError, match="'r1' entered again while inside key 'k1'"):
        inside.enter("k1", "r1", False, 1)
    assert sorted(inside.close(lambda pid: pid == 1)) == [1, 1]  # r1 (k1) and w1 (k2)
    assert inside.holders("k1") == ["r2", "w2", "r3"] and inside.holders("k2") == []
    assert inside.exit("k1", "w2") == 3
    assert inside.exit("k1", "w2") is None
    assert list(inside) == [("r2", 2), ("r3", 3)]
