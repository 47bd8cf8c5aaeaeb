"""The gate: a locked ``wait`` task's message whose lock is busy waits in the worker's main
process, not in a pool slot, and goes to the pool when the lock can be granted.

The gate sits in front of the consumer's ``on_task_request`` (the call that hands a request to
the pool, after Celery's ETA and rate-limit handling). A request of a ``ZkLockTask`` whose call
waits when busy (``on_busy="wait"``) is looked up by its lock path; if the lock could be granted
now it goes on at once, else it is *held*: received and not acknowledged, like an ETA message
(the worker's prefetch is raised by one so it keeps fetching; past ``zklock_gate_max_held``
held messages a locked message waits in the broker instead, sent again with a short ETA).
Held messages go to the pool in arrival order per key, when the lock's own predicate
(:mod:`celery_zklock.worker.gate.line`) says a new contender would be granted; the pool run then
takes its lock exactly as without the gate, so the gate decides only *when* to dispatch: mutual
exclusion, the lease clock and revocation stay in the run. One children watch per key per
worker, whatever the number of held messages; all ZooKeeper answers are handled on the
consumer's own thread (:attr:`Gate._soon`).

A held message leaves the gate by itself in three cases, checked every :data:`RECHECK_EVERY`
seconds against its instants (:class:`~celery_zklock.worker.gate.line.Held`), with no timer per
message (kombu's timer keeps a cancelled entry, and the request it references, until its due time):

- its ``lock_timeout`` (counted from when it reached the gate) ran out: to the pool at the
  first free slot, whose run applies ``lock_on_timeout`` at once (as the outage budget and a
  failed read send messages on: never into a busy pool, where it could sit past the broker's
  bound; held until a slot frees or the bound comes);
- the broker's redelivery bound (:class:`~celery_zklock.zk.settings.GateConfig`, counted from the
  worker's receipt of the message, ETA waits included) came: back to the broker with every
  message behind it on its key, in order (:mod:`celery_zklock.worker.gate.giveback`), never into a
  pool that may be busy past the bound;
- it was revoked, or its ``expires`` passed: it ends REVOKED as Celery ends such a request.

While the gate's client is disconnected from ZooKeeper, locked calls ride the outage out here
(:mod:`celery_zklock.task.sendback`): held calls stay held, and new ones of any busy policy whose
``lock_on_unavailable`` is ``wait`` are held in their key's line, until ZooKeeper answers (then
each line goes on as before; a call that does not wait when busy goes to the pool at its turn)
or until the outage budget (``zklock_outage_budget``) has passed since the call met the outage:
then it goes to the pool at the first free slot, stamped so that its run applies the
``unavailable`` policy. A read that fails while connected hands the key's held messages to the
pool, as slots free. When the consumer stops
(warm shutdown, broker connection lost) held messages go back to the broker in order where it
allows that (Redis), else they are left unacknowledged and the broker hands them out again.
The gate writes nothing into a task's result: a held call is seen through its
``task-lock-waiting`` event, ``celery zklock locks`` and the ``zklock_gate_held`` gauge.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Final

from celery.worker import state as worker_state
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import KazooState, WatchedEvent

from celery_zklock.errors import ConfigurationError
from celery_zklock.locks.contenders import first_blocker, queue_of
from celery_zklock.locks.identity import parse_identity
from celery_zklock.task import sendback, visibility
from celery_zklock.task.metrics import count_held
from celery_zklock.task.options import (
    BEHIND_ITSELF_FIELD,
    CALL_OPTION,
    PATHS_FIELD,
    RECEIPT_FIELD,
    RECEIVED_OPTION,
    LockedCall,
)
from celery_zklock.task.task import ZkLockTask
from celery_zklock.worker.gate.giveback import give_back, send_later
from celery_zklock.worker.gate.line import Held, KeyLine, attempt_of, may_enter
from celery_zklock.zk import outages
from celery_zklock.zk.client import get_client
from celery_zklock.zk.settings import GateConfig, settings_of

logger = logging.getLogger("celery_zklock.gate")

RECHECK_EVERY: Final = 0.05
"""Seconds between looks at the runs the gate sent to the pool (ended: the next may go)."""
REVOKED_LOOK_EVERY: Final = 1.0
"""Seconds between looks at every held message's revocation when the worker's set of revoked
ids did not visibly change (at its size limit an addition does not change its length)."""
SENT_BACK_SETTLE: Final = 0.2
"""Seconds a call its run sent back waits at the gate before it may go to the pool: the calls
sent back with it (due at the same instant, their ETAs a few milliseconds apart) come in
meanwhile, and the line takes them by when each first reached a gate."""
OVER_CAP_DELAY: Final = 1.0
"""Seconds a locked message waits in the broker (its ETA) when it came over the gate's cap on
held messages (``zklock_gate_max_held``), before it comes to a gate again."""
RECONNECT_EVERY: Final = 5.0
"""Seconds between the gate's attempts to connect when ZooKeeper was unreachable at start."""


class Gate:
    """The gate of one worker's consumer; see the module docstring. Every method but
    :meth:`held_by_key` runs on the consumer's thread."""

    def __init__(self, consumer: Any, config: GateConfig) -> None:
        self.consumer = consumer
        self.config = config
        self.lines: dict[str, KeyLine] = {}
        self.client: KazooClient | None = None
        self.root = ""
        """The app's ``zklock_root``, read with the client (the gate works only with both)."""
        self._entries: list[Any] = []
        self._away_since: float | None = None
        """When the gate's client last lost its connection (None while connected)."""
        self._next_due = float("inf")
        self._revoked_seen = (0, 0.0)
        self._given_back: dict[tuple[str, int], tuple[float, float]] = {}
        """(Task id, retries) -> (when it first reached this gate, when to forget that) of
        messages given back at the broker bound with a ``lock_timeout``: back here, their
        timeout goes on from the first arrival instead of starting again. A retry is another
        attempt, which waits its own ``lock_timeout``."""
        self._started = threading.Event()
        self._wanting: list[tuple[float, str]] = []
        """Heap of (its head's due, path) of the lines whose head waits only for a pool slot:
        the first to get the slot a run frees (:meth:`_on_tick`)."""
        self._wanting_paths: set[str] = set()
        self._hub: Any = None
        self._inbox: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        # kombu's hub takes callbacks from other threads safely (and wakes for them) since its
        # call_soon got a lock; before that (kombu 5.3) the gate's own inbox, read by _recheck.
        threadsafe_hub = hasattr(consumer.hub, "_ready_lock")
        self._soon: Callable[..., Any] = consumer.call_soon if threadsafe_hub else self._to_inbox
        """``_soon(fn, *args)`` runs ``fn(*args)`` on the consumer's thread (called from
        kazoo's threads)."""

    _handle: Callable[[Any], Any]
    """The consumer's ``on_task_request``, that the gate is in front of (set by :meth:`wrap`)."""

    def wrap(self, handle: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Put the gate in front of ``handle``, the consumer's ``on_task_request``."""
        self._handle = handle
        return self.on_task_request

    held = 0
    """Messages held now (kept as they come and go: it is read for every message)."""

    @property
    def wanting_a_slot(self) -> int:
        """Keys whose first held message may go now and waits only for a pool slot."""
        return len(self._wanting_paths)

    def held_by_key(self) -> dict[str, list[tuple[str, str, float]]]:
        """``{lock path: [(task id, task name, seconds held), ...]}`` (for operators): the
        messages held now, each key's in line order, the order they go to the pool."""
        now = time.time()
        report = {}
        for path, line in list(self.lines.items()):
            held = list(line.held)
            if held:
                report[path] = [(h.request.id, h.request.name, now - h.due) for h in held]
        return report

    # -- consumer life --------------------------------------------------------------------
    def start(self) -> None:
        """The consumer (re)started: connect in the background (messages pass until then)."""
        self._started.set()
        if self.client is None:
            threading.Thread(target=self._connect, name="zklock-gate-connect", daemon=True).start()
        self._entries.append(self.consumer.timer.call_repeatedly(RECHECK_EVERY, self._recheck))
        self._hub = getattr(self.consumer, "hub", None)  # None: a worker without kombu's loop
        if self._hub is not None:
            self._hub.on_tick.add(self._on_tick)

    def stop(self) -> None:
        """The consumer stops: held messages go back to the broker in order where it allows
        (:func:`~celery_zklock.worker.gate.giveback.give_back`), else stay unacknowledged (the
        broker hands them out again)."""
        self._started.clear()
        for entry in self._entries:
            entry.cancel()
        self._entries = []
        self._inbox.clear()
        if self._hub is not None:
            self._hub.on_tick.discard(self._on_tick)
        self._wanting, self._wanting_paths = [], set()
        lines, self.lines, self.held = list(self.lines.values()), {}, 0
        for line in lines:
            for held in line.held:
                count_held(held.request.name, -1)
            give_back([held.request for held in line.held])

    def _connect(self) -> None:
        settings = settings_of(self.consumer.app)
        warned = False
        while self._started.is_set():
            try:
                self.root = settings.root
                client = get_client(settings.client)
            except ConfigurationError as exc:
                logger.error("celery-zklock gate: off (%s)", exc)
                return
            except Exception as exc:
                if not warned:
                    outages.warn_unreachable(
                        settings.client, exc, "locked tasks go straight to the pool until it "
                        "answers, where each run sends its call back to wait for it "
                        "(lock_on_unavailable)",
                    )  # fmt: skip
                    warned = True
                time.sleep(RECONNECT_EVERY)
                continue
            client.add_listener(self._on_state)
            self.client = client
            return

    # -- messages -------------------------------------------------------------------------
    def on_task_request(self, request: Any) -> Any:
        """The consumer's ``on_task_request`` behind the gate. A request the gate does not hold
        (:meth:`_gated`) goes on at once, and so does a locked call past its outage budget
        (stamped, for its run) and one that may enter its lock now, into a free pool slot, with
        nothing of its key held. Any other is held at its place in its key's line, whose
        contender queue is then read if it is not watched; unless it is past the broker's bound
        already (given back) or over the cap on held messages (sent to wait in the broker; held
        without raising the prefetch if the broker does not take it)."""
        gated = self._gated(request)
        if gated is None:
            return self._handle(request)
        call, waits = gated
        path, kind, timeout = call.path, call.kind, call.options.timeout
        now = time.time()
        away_since = self._away_since
        rides_out = call.options.on_unavailable == "wait"
        go = False  # past the outage budget, or not riding it out: the run applies `unavailable`
        if away_since is not None:
            since = _outage_since(request, away_since)
            past_budget = now - since >= self.config.outage_budget
            if past_budget or not rides_out:
                if past_budget:
                    _stamped(request, since)
                if self._pool_free() + 1 > 0:  # this request is counted as in the pool already
                    return self._handle(request)
                go = True
        line = self.lines.get(path)
        if line is None:
            line = self.lines[path] = KeyLine(path)
        connected = away_since is None and self.client is not None and self.client.connected
        received = request.request_dict.get(RECEIPT_FIELD)
        if not isinstance(received, (int, float)):
            received = now
        due = self._given_back.pop(attempt_of(request), (now, now))[0]
        first = sendback.first_due(request)  # sent back by a run: its place is its first one's
        due = due if first is None else min(due, first)
        held = Held(request, kind, due, bound_at=received + self.config.max_hold)
        held.waits, held.go, held.rides_out = waits, go, rides_out
        if first is not None:
            held.not_before = now + SENT_BACK_SETTLE
        if timeout is not None and waits:
            held.timeout_at = due + timeout
        # A call sent back (the throttle, an outage) does not go at once: others sent back with
        # it, due at the same instant, are taken in first, and the first made goes first.
        if first is None and not line.held and line.queue is not None and line.watched:
            line.forget_ended(worker_state.reserved_requests)
            free = self._pool_free() + 1  # this request is counted as in the pool already
            if free > 0 and may_enter(kind, line.queue, line.sent.values()):
                return self._dispatch(line, held, was_held=False)
        if held.bound_at <= now:  # past the broker's bound already (a long ETA): not held
            logger.info(
                "celery-zklock gate: 1 message(s) of %s past the broker's redelivery bound on "
                "arrival (an ETA later than it) go back to the broker: %s",
                path,
                request.id,
            )
            give_back([request])
            return None
        if self.held < self.config.max_held:  # held in the worker, which fetches on meanwhile
            self.consumer.qos.increment_eventually()
            held.raised_prefetch = True
        elif self._send_later(path, held):  # over the cap: it waits in the broker instead
            if line.idle:
                self.lines.pop(path, None)
            return None
        # A call its run sent back takes its place by when it first reached a gate; one given
        # back at the broker's bound re-enters behind the calls received meanwhile.
        if first is None:
            line.held.append(held)
        else:
            line.add(held)
        self._next_due = min(self._next_due, held.next_at)
        self.held += 1
        count_held(request.name, 1)
        if line.holder is not None:
            line.note_copies((held,))
            self._tell_held(line, held)
        if go:
            self._want_slot(line)
        if connected and not line.reading and (line.queue is None or not line.watched):
            self._read(line)
        return None

    def _gated(self, request: Any) -> tuple[LockedCall, bool] | None:
        """The resolved call of a request the gate holds, and whether it waits when busy: a
        ``wait`` call, and while ZooKeeper is away any locked call that rides an outage out;
        None for any other (not locked, the gate not started, arguments the key cannot take:
        the pool run decides, and fails with the reason)."""
        task = request.task
        if self.client is None or not isinstance(task, ZkLockTask):
            return None
        fields = request.request_dict
        try:
            spec = task._zklock_compile(task.name)
            overrides = fields.get(CALL_OPTION)
            overrides = overrides if isinstance(overrides, Mapping) else None
            options = spec.for_call(overrides)
            waits = options.on_busy == "wait"
            if not waits and (self._away_since is None or options.on_unavailable != "wait"):
                return None
            call = spec.resolve(self.root, request.args, request.kwargs, options)
        except Exception:
            return None
        if len(call.paths) != 1:
            return None  # several keys: taken together by the run, never held here
        fields[PATHS_FIELD] = [list(call.paths), fields.get("retries", 0)]  # the run's paths
        return call, waits

    def _send_later(self, path: str, held: Held) -> bool:
        """Over the cap on held messages: ``held`` waits in the broker, sent again with an ETA
        of :data:`OVER_CAP_DELAY` (at most a quarter of the broker bound), keeping its place
        in its key's line (:func:`~celery_zklock.worker.gate.giveback.send_later`)."""
        delay = min(OVER_CAP_DELAY, self.config.max_hold / 4)
        if not send_later(held.request, delay, held.due):
            return False  # held here all the same, without raising the prefetch
        logger.info(
            "celery-zklock gate: over its cap of %d held message(s) (zklock_gate_max_held), 1 "
            "message(s) of %s go back to the broker for %.2fs: %s",
            self.config.max_held,
            path,
            delay,
            held.request.id,
        )
        return True

    def _release_hold(self, held: Held) -> None:
        """``held`` leaves the gate (to the pool or the broker): its prefetch and gauge."""
        if held.raised_prefetch:
            self.consumer.qos.decrement_eventually()
            held.raised_prefetch = False
        self.held -= 1
        count_held(held.request.name, -1)

    def _dispatch(self, line: KeyLine, held: Held, was_held: bool = True) -> Any:
        request = held.request
        if was_held:
            self._release_hold(held)
        request.request_dict[RECEIVED_OPTION] = [held.due, attempt_of(request)[1]]
        if held.behind_itself:
            request.request_dict[BEHIND_ITSELF_FIELD] = True
        line.sent[request] = held.kind
        return self._handle(request)

    def _pool_free(self) -> int:
        """Pool slots no request of this worker occupies or waits for: its pool's size less
        the requests it reserved that are not held here (Celery keeps at most its prefetch in
        the pool; messages held here and then sent on must not queue behind busy slots, where
        they would sit unacknowledged past the broker's bound)."""
        size = getattr(getattr(self.consumer, "pool", None), "limit", None) or 1
        return int(size) - (len(worker_state.reserved_requests) - self.held)

    def _advance(self, line: KeyLine) -> None:
        line.forget_ended(worker_state.reserved_requests)
        now = time.time()
        while (held := line.next_ready(now)) is not None:
            if self._pool_free() <= 0:  # never into a busy pool, past the broker's bound
                self._want_slot(line)
                break
            line.held.remove(held)
            self._dispatch(line, held)
        if line.idle:
            self.lines.pop(line.path, None)
        elif line.held and line.queue is not None:
            self._name_holder(line)

    def _want_slot(self, line: KeyLine) -> None:
        if self._hub is not None and line.path not in self._wanting_paths:
            self._wanting_paths.add(line.path)
            heapq.heappush(self._wanting, (line.held[0].due, line.path))

    def _on_tick(self) -> None:
        """At each turn of the consumer's loop (after it handled what the pool returned): the
        slots runs freed go to the lines waiting for one, first due first, at once rather
        than at the next :meth:`_recheck`."""
        wanting = self._wanting
        while wanting and self._pool_free() > 0:
            _, path = heapq.heappop(wanting)
            self._wanting_paths.discard(path)
            line = self.lines.get(path)
            if line is not None and line.held:
                self._advance(line)

    def _tell_held(self, line: KeyLine, held: Held) -> None:
        """The ``task-lock-waiting`` event for ``held``, naming the line's holder."""
        held.told = True
        visibility.held(held.request, line.path, line.holder or None)

    def _name_holder(self, line: KeyLine) -> None:
        """Read who the head of the line waits for (the node's identity), once per holder,
        then tell every held message of the line that it waits, naming it."""
        assert line.queue is not None
        blocker = first_blocker(line.queue, line.held[0].kind)
        client = self.client
        if blocker is None or blocker.name == line.blocker or client is None:
            return
        line.blocker, path = blocker.name, line.path
        try:
            answer = client.get_async(f"{path}/{blocker.name}")
        except Exception:
            return
        answer.rawlink(partial(self._soon, self._named, path, blocker.name))

    def _named(self, path: str, node: str, result: Any) -> None:
        line = self.lines.get(path)
        if line is None or line.blocker != node:
            return
        try:
            data, _ = result.get_nowait()
        except Exception:
            data = None  # gone already, or ZooKeeper failed: the holder stays unnamed
        identity = parse_identity(data)
        line.holder, line.named = identity.task_id or "", node
        line.holder_retries = identity.retries
        line.note_copies(line.held)
        for held in line.held:
            if not held.told:
                self._tell_held(line, held)

    def _act_on_due(self) -> None:
        """Every held message whose instant came leaves the gate (see the module docstring):
        revoked or expired ones end REVOKED, timed-out ones go to the pool, and lines whose
        broker bound came go back to the broker."""
        now = time.time()
        revoked = worker_state.revoked
        seen = (len(revoked), now)
        look_revoked = seen[0] != self._revoked_seen[0] or now - self._revoked_seen[1] > (
            REVOKED_LOOK_EVERY
        )
        if not look_revoked and now < self._next_due:
            return
        if look_revoked:
            self._revoked_seen = seen
        away_since = self._away_since
        self._next_due = (
            float("inf") if away_since is None else away_since + self.config.outage_budget
        )
        if self._given_back:  # fetched by another worker, or never again: forget in time
            for attempt, (_, forget_at) in list(self._given_back.items()):
                if forget_at <= now:
                    del self._given_back[attempt]
        for line in list(self.lines.values()):
            if look_revoked or any(h.request.expires for h in line.held):
                for held in [h for h in line.held if _revoked(h.request)]:
                    line.held.remove(held)
                    self._release_hold(held)
            if away_since is not None:  # past the outage budget, or not riding it out: goes
                for held in line.held:
                    if held.go:
                        continue
                    since = _outage_since(held.request, away_since)
                    if now - since >= self.config.outage_budget:
                        _stamped(held.request, since)
                        held.go = True
                    elif not held.rides_out:
                        held.go = True
            # While ZooKeeper is away no lock_timeout runs out (it is never taken for a busy lock).
            to_broker = line.take_due(now, timeouts=away_since is None)
            if line.going:  # the run applies lock_on_timeout or `unavailable`, at a free slot
                self._advance(line)
            for held in to_broker:
                self._release_hold(held)
            if to_broker:
                logger.info(
                    "celery-zklock gate: %d message(s) of %s held up to the broker's "
                    "redelivery bound go back to the broker: %s",
                    len(to_broker),
                    line.path,
                    " ".join(held.request.id for held in to_broker),
                )
                for held in to_broker:
                    if held.timeout_at is not None:
                        forget_at = held.timeout_at + self.config.max_hold
                        self._given_back[attempt_of(held.request)] = (held.due, forget_at)
                give_back([held.request for held in to_broker])
            for held in line.held:
                self._next_due = min(self._next_due, held.next_at)
            if line.idle:
                self.lines.pop(line.path, None)

    def _hand_over(self, line: KeyLine) -> None:
        """ZooKeeper cannot answer for this key: every held message goes to the pool as slots
        free, where the run's ``unavailable`` policy applies."""
        for held in line.held:
            held.go = True
        line.queue, line.watched, line.reading, line.read_again = None, False, False, False
        self._advance(line)

    # -- ZooKeeper ------------------------------------------------------------------------
    def _read(self, line: KeyLine) -> None:
        client = self.client
        if client is None or not client.connected:
            return None  # read when connected again, or handed over when the outage lasts
        line.reading = True
        path = line.path
        try:
            answer = client.get_children_async(path, watch=self._on_watch)
        except Exception:
            return self._hand_over(line)
        answer.rawlink(partial(self._soon, self._listed, path))
        return None

    def _listed(self, path: str, result: Any) -> None:
        line = self.lines.get(path)
        if line is None or not line.reading:
            return
        line.reading = False
        try:
            children, watched = result.get_nowait(), True
        except NoNodeError:
            children, watched = [], False  # no watch on a node not there: _recheck reads again
        except Exception:
            logger.warning("celery-zklock gate: could not read %s; its held messages go to "
                           "the pool", path, exc_info=True)  # fmt: skip
            return self._hand_over(line)
        if line.read_again:  # it changed while we read
            line.read_again = False
            return self._read(line)
        line.queue, line.watched = queue_of(children), watched
        if line.named is not None:  # a holder was named: it may be our run, released
            line.forget_released()
        return self._advance(line)

    def _on_watch(self, event: WatchedEvent) -> None:  # a kazoo thread
        self._soon(self._changed, event.path)

    def _changed(self, path: str) -> None:
        line = self.lines.get(path)
        if line is None:
            return
        line.queue, line.watched = None, False
        if line.reading:
            line.read_again = True
        elif line.held:
            self._read(line)

    def _to_inbox(self, fn: Callable[..., Any], *args: Any) -> None:
        """:attr:`_soon` with kombu 5.3's hub: ``fn(*args)`` waits in the inbox for
        :meth:`_recheck`."""
        self._inbox.append((fn, args))

    def _recheck(self) -> None:
        """Answers queued in the inbox are handled; runs sent to the pool that ended let the
        next go; keys whose node did not exist at the last read (so no watch) are read
        again."""
        while self._inbox:
            fn, args = self._inbox.popleft()
            fn(*args)
        self._act_on_due()
        waiting_for_a_slot = []
        for line in list(self.lines.values()):
            if not line.held:
                line.forget_ended(worker_state.reserved_requests)
                if line.idle:
                    self.lines.pop(line.path, None)
                continue
            reread = not line.watched and not line.reading
            if reread:
                self._read(line)
            if line.going or (not reread and line.queue is not None):
                waiting_for_a_slot.append(line)
        # Runs that ended let the next of their key go, and free pool slots go to the lines
        # whose first message came first.
        for line in sorted(waiting_for_a_slot, key=lambda line: line.held[0].due):
            if line.held and (line.going or line.queue is not None):
                self._advance(line)

    def _discount_outage(self, away_since: float) -> None:
        """ZooKeeper being away is never taken for a busy lock: the time each held message
        spent waiting for it does not count against its ``lock_timeout`` (its ``due``, which
        its run counts from, moves on by as much; its broker bound stays)."""
        now = time.time()
        for line in self.lines.values():
            for held in line.held:
                shift = now - max(away_since, held.due)
                held.due += shift
                if held.timeout_at is not None:
                    held.timeout_at += shift

    def _on_state(self, state: str) -> None:  # a kazoo thread
        self._soon(self._state_changed, state)

    def _state_changed(self, state: str) -> None:
        client = self.client
        if state == KazooState.CONNECTED and client is not None and client.connected:
            if self._away_since is not None:
                logger.info(
                    "celery-zklock gate: ZooKeeper answers again after %.1fs; %d held "
                    "message(s) go on",
                    time.time() - self._away_since,
                    self.held,
                )
                self._discount_outage(self._away_since)
            self._away_since = None
            for line in list(self.lines.values()):
                self._changed(line.path)  # watches may have fired unseen: look again
            return
        if state == KazooState.CONNECTED:
            return  # an old notice: the client is away again
        for line in self.lines.values():  # the session's watches may be gone: read again later
            line.queue, line.watched, line.read_again = None, False, line.reading
        if self._away_since is None:
            self._away_since = time.time()
            self._next_due = self._away_since  # held calls that do not ride it out go now
            logger.warning(
                "celery-zklock gate: ZooKeeper is away; locked calls wait here for it up to "
                "%.0fs (zklock_outage_budget), then apply lock_on_unavailable (at once for "
                "those whose lock_on_unavailable is not 'wait')",
                self.config.outage_budget,
            )


def _revoked(request: Any) -> bool:
    """Whether a held request was revoked or expired: if so Celery's own handling has ended it
    (REVOKED stored and sent, the message acknowledged, the request forgotten)."""
    if request.id not in worker_state.revoked and not request.expires:
        return False
    return bool(request.revoked())


def _stamped(request: Any, since: float) -> Any:
    """``request``, telling its run since when its call has met the outage (past the budget:
    the run applies ``lock_on_unavailable``'s policy instead of sending it back)."""
    request.request_dict[sendback.UNAVAILABLE_SINCE] = since
    return request


def _outage_since(request: Any, away_since: float) -> float:
    """Since when the call of ``request`` has met the outage: ``away_since`` (when the gate lost
    ZooKeeper), or earlier if its message says so (sent back by a run)."""
    carried = sendback.unavailable_since(request)
    return away_since if carried is None else min(carried, away_since)
