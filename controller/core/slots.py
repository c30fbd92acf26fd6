"""Slots: which runs hold a lab's GPU slots, who waits for one, and in which order they get one.

Both front ends keep one `SlotBook` per lab through the engine: it is filled from
the experiments' statuses as last written (when a lab is first seen, and by the
local loop at every pass), and slots are handed out in the order `queue_order`
gives. A slot list of None means the backend schedules by itself (a cluster
without `gpuSlots`): every grant succeeds. It holds no I/O; its lock makes it
safe for the operator's handler threads.

The queue, one rule for the slot book and for the listings (`autolab get`'s QUEUE):

- Priority first: a higher-priority experiment's run goes before a lower one's,
  whatever kind of run it is (a first run, a pair run of a decision under way).
- Then creation time, as Kueue orders workloads: when the user applied the
  experiment (`queue_key`). Locally that is the stamp `autolab apply` writes
  into the experiment's record, to the microsecond, so the specs of one apply
  keep the order they were given in; a spec file written by hand is stamped
  with its modification time when the loop first reads it. In a cluster it is
  `metadata.creationTimestamp`, which has whole seconds: Experiments created in
  the same second fall back on their names, the last tie-break, and never
  decide anything else.
- One confirmation at a time: the runs of a decision past its first (its pair
  runs) go one experiment at a time (`SlotBook.confirming`). A promotion starts
  every other decision in flight over on the new master, so confirmations side
  by side mostly measure pairs that can no longer be promoted. A confirmation
  waiting for its turn keeps its place for when it comes, and takes no slot.
  A decision started over that way (attempt 2 on) is a confirmation too: it
  had its first look, and were it a first run, its older creation time would
  put every decision a promotion voided before the new specs (on the campaign
  bench, a new spec's longest wait went from 11 runs to 76).
- No head-of-line blocking: a decision in progress does not hold the slots
  while new candidates wait for a first run (`FIRST_RUN_EVERY`).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Mapping

from controller.core.status import CONFIRMING, QUEUED, ExperimentStatus

UNLIMITED = "cluster"  # the slot of a run whose backend schedules by itself

# A first run waits behind at most this many runs of the decision in progress (runs granted to
# confirmations since the last first run was granted), then it is granted the next free slot,
# if its priority is as high. With one slot, a new candidate is measured after at most this many
# runs of a long decision (plus the run in flight), not after the whole decision: a hard decision
# can take a dozen runs, and a first run is the cheapest look at an idea nobody measured yet.
# Small, so new ideas are not starved; above 1, so a decision close to its verdict still gets
# most of the GPU, as each of its runs may end it (and a promotion voids the others' pairs).
FIRST_RUN_EVERY = 2

_NEVER = "~"  # sorts after every instant: a waiter with no creation time goes last
_STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(?:Z|\+00:?00)\Z")


@dataclass(frozen=True)
class Waiter:
    """An experiment waiting for a slot, as the queue weighs it."""

    priority: int  # its spec's
    created: str   # when the user applied it (ISO 8601, UTC)
    confirm: bool  # a run of its decision past the first: it needs the confirmation's turn


def instant(stamp: str | None) -> str:
    """A creation stamp (ISO 8601, UTC) in one sortable form, to the nanosecond:
    `...T12:00:00Z` and `...T12:00:00.25Z` compare as the instants they are (as text, "Z"
    sorts after "."). Unreadable: after every instant."""
    m = _STAMP.match(stamp or "")
    if m is None:
        return _NEVER
    return f"{m.group(1)}.{(m.group(2) or '').ljust(9, '0')}Z"


def queue_key(name: str, w: Waiter) -> tuple[int, str, str]:
    """Priority (highest first), then creation time (oldest first); the name only breaks a tie
    of identical stamps."""
    return (-w.priority, instant(w.created), name)


def queue_order(waiting: Mapping[str, Waiter], confirming: str | None,
                since_first: int) -> tuple[list[str], list[str]]:
    """Who the next free slots go to, in order; and the confirmations that wait for their turn.

    `confirming`: the experiment whose decision is under way (it holds the confirmation's turn);
    when it is not waiting itself, its run is in flight, and no other confirmation starts.
    `since_first`: runs granted to confirmations since the last first run was granted.
    """
    ranked = sorted(waiting, key=lambda n: queue_key(n, waiting[n]))
    confirms = [n for n in ranked if waiting[n].confirm]
    turn: str | None = None
    if confirming is None:
        turn = confirms[0] if confirms else None  # the next decision to go on: the first in line
    elif confirming in waiting:
        turn = confirming
        if confirms and waiting[confirms[0]].priority > waiting[confirming].priority:
            turn = confirms[0]  # a higher priority's decision goes on first, between two runs
    order = [n for n in ranked if not waiting[n].confirm or n == turn]
    if turn is not None and since_first >= FIRST_RUN_EVERY:
        i = order.index(turn)
        first = next((n for n in order[i + 1:]
                      if waiting[n].priority >= waiting[turn].priority), None)
        if first is not None:  # its wait is over: it goes before the decision's next run
            order.remove(first)
            order.insert(i, first)
    return order, [n for n in confirms if n != turn]


def allocate_slots(queued: Mapping[str, Waiter], busy: set[str], slots: list[str],
                   confirming: str | None = None, since_first: int = 0) -> dict[str, str]:
    """Give free slots to waiting experiments in `queue_order`. busy: slots held by runs in
    flight. slots: every slot id (GPU ids, or ["cpu"])."""
    free = [s for s in slots if s not in busy]
    order, _ = queue_order(queued, confirming, since_first)
    return dict(zip(order, free))


class SlotBook:
    """GPU slots of one Lab: who holds one, who waits, and which candidates are in flight."""

    def __init__(self, slots: list[str] | None):
        self.slots = list(slots) if slots is not None else None
        self.held: dict[str, str] = {}       # slot -> holder (experiment or baseline run)
        self.waiting: dict[str, Waiter] = {}  # experiment -> how the queue weighs it
        self.inflight: dict[str, str] = {}   # candidate or semantic hash -> experiment
        self.running: set[str] = set()       # experiments and baselines with a run in flight
        # Whose decision is under way: the one experiment whose pair runs go now (see the
        # module's docstring). Kept in memory, as is `since_first`; a new book (a controller
        # started again) finds the holder by its pair run in flight and counts from 0, which
        # keeps the bound.
        self.confirming: str | None = None
        self.confirms: set[str] = set()      # active experiments past their first run
        self.since_first = 0                 # runs granted to confirmations since a first run
        self._lock = threading.Lock()

    def resize(self, slots: list[str] | None) -> None:
        with self._lock:
            self.slots = list(slots) if slots is not None else None

    def carry(self, previous: "SlotBook") -> None:
        """What only memory holds, from the book this one replaces (filled afresh from the
        statuses): the turn of a decision still under way, and the runs since a first run."""
        with self._lock:
            self.since_first = previous.since_first
            if previous.confirming in self.confirms and self.confirming in (
                    None, previous.confirming):
                self.confirming = previous.confirming

    def observe(self, name: str, status: dict, priority: int = 0, created: str = "") -> None:
        """Take in one Experiment's status as last written (StatusError if it is not one).

        `created`: when the user applied it (the front end's record; default: the status's
        `createdAt`, when the controller first saw it)."""
        st = ExperimentStatus.parse(status)
        confirm = (isinstance(st.raw.get("pairs"), dict) or int(st.raw.get("attempt") or 1) > 1) \
            and st.active
        with self._lock:
            self._release(name)
            for h in [h for h, who in self.inflight.items() if who == name]:
                del self.inflight[h]
            self.waiting.pop(name, None)
            self.confirms.discard(name)
            if self.confirming == name and not confirm:
                self.confirming = None  # its verdict is in (or it started over): the next one
            if confirm and st.job and self.confirming is None:
                self.confirming = name  # a pair run in flight holds the turn
            if not st.active:
                return
            if confirm:
                self.confirms.add(name)
            for h in st.hashes:
                self.inflight.setdefault(h, name)
            if st.job:
                self.running.add(name)
                if self.slots is not None and st.job.slot in self.slots:
                    self.held[st.job.slot] = name
            elif st.phase in (QUEUED, CONFIRMING):
                self.waiting[name] = Waiter(priority, created or st.created_at or "", confirm)

    def claim(self, name: str, hashes: tuple[str | None, ...]) -> str | None:
        """Mark a checked candidate in flight; returns who already has it, if anyone."""
        with self._lock:
            for h in hashes:
                other = self.inflight.get(h or "")
                if other and other != name:
                    return other
            for h in hashes:
                if h:
                    self.inflight[h] = name
            return None

    def grant(self, name: str, priority: int, created: str,
              confirm: bool = False) -> str | None:
        """A slot for `name` if it is next in line (`queue_order`), reserved until `observe` or
        `release`; None: it waits, in its place.

        `confirm`: the run is one of its decision's past the first, which goes only in its
        decision's turn (one at a time).
        """
        with self._lock:
            if confirm:
                self.confirms.add(name)
            if self.slots is None:
                if confirm and self.confirming not in (None, name):
                    self.waiting[name] = Waiter(priority, created, confirm)
                    return None
                self.waiting.pop(name, None)
                slot: str | None = UNLIMITED
            else:
                slot = next((s for s, who in self.held.items() if who == name), None)
                if slot is None:
                    self.waiting[name] = Waiter(priority, created, confirm)
                    slot = allocate_slots(self.waiting, set(self.held), self.slots,
                                          self.confirming, self.since_first).get(name)
                    if slot is None:
                        return None
                    self.held[slot] = name
                    self.waiting.pop(name, None)
                    self.since_first = self.since_first + 1 if confirm else 0
            if confirm:
                self.confirming = name
            return slot

    def next_in_line(self) -> str | None:
        """Who `grant` would give the next free slot to, as things stand (None: nobody waits)."""
        with self._lock:
            order, _ = queue_order(self.waiting, self.confirming, self.since_first)
            return order[0] if order else None

    def queue(self) -> list[str]:
        """Everyone waiting for a slot, in the order they get one as things stand: those next
        in line, then the confirmations that wait for their decision's turn."""
        with self._lock:
            order, later = queue_order(self.waiting, self.confirming, self.since_first)
            return order + later

    def hold(self, name: str, slot: str | None = None) -> str | None:
        """A slot for a run outside the queue (the baseline): any free one, or the one it has."""
        with self._lock:
            self.running.add(name)
            if self.slots is None:
                return UNLIMITED
            for s, who in self.held.items():
                if who == name:
                    return s
            free = [s for s in self.slots if s not in self.held]
            if slot in free:
                free = [slot]
            if not free:
                self.running.discard(name)
                return None
            self.held[free[0]] = name
            return free[0]

    def release(self, name: str) -> None:
        with self._lock:
            self._release(name)

    def forget(self, name: str) -> None:
        with self._lock:
            self._release(name)
            self.waiting.pop(name, None)
            self.confirms.discard(name)
            if self.confirming == name:
                self.confirming = None
            for h in [h for h, who in self.inflight.items() if who == name]:
                del self.inflight[h]

    def _release(self, name: str) -> None:
        self.running.discard(name)
        for slot in [s for s, who in self.held.items() if who == name]:
            del self.held[slot]

    def in_flight(self) -> int:
        with self._lock:
            return len(self.running)
