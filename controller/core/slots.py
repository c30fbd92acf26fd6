"""Slots: which runs hold a lab's GPU slots, who waits for one, and which candidates are in flight.

Both front ends keep one `SlotBook` per lab through the engine: it is filled from
the experiments' statuses as last written (when a lab is first seen, and by the
local loop at every pass), and slots are handed out by priority, first come first
served within a priority (`allocate_slots`). A slot list of None means the
backend schedules by itself (a cluster without `gpuSlots`): every grant succeeds.
It holds no I/O; its lock makes it safe for the operator's handler threads.
"""

from __future__ import annotations

import threading

from controller.core.status import CONFIRMING, QUEUED, ExperimentStatus

UNLIMITED = "cluster"  # the slot of a run whose backend schedules by itself
# An experiment measured once and waiting for its next run (a follow-up, a pair run) goes
# before the first runs of others, whatever their priority: a decision half made holds the
# lab's attention, and the longer it waits the likelier the master moves under it (and it
# starts over).
CONFIRMING_BOOST = 1_000_000


def queue_priority(priority: int, phase: str | None) -> int:
    """The priority a waiting experiment is served by (its spec's, boosted while Confirming)."""
    return priority + (CONFIRMING_BOOST if phase == CONFIRMING else 0)


def allocate_slots(queued: list[tuple[str, int, str]], busy: set[str],
                   slots: list[str]) -> dict[str, str]:
    """Give free slots to queued experiments: higher priority first, FIFO within a priority.

    queued: (name, priority, queued_at) of experiments waiting for a slot.
    busy: slots held by runs in flight. slots: every slot id (GPU ids, or ["cpu"]).
    """
    free = [s for s in slots if s not in busy]
    order = sorted(queued, key=lambda q: (-q[1], q[2], q[0]))
    return {name: slot for (name, _, _), slot in zip(order, free)}


class SlotBook:
    """GPU slots of one Lab: who holds one, who waits, and which candidates are in flight."""

    def __init__(self, slots: list[str] | None):
        self.slots = list(slots) if slots is not None else None
        self.held: dict[str, str] = {}       # slot -> holder (experiment or baseline run)
        self.waiting: dict[str, tuple[int, str]] = {}  # experiment -> (priority, queuedAt)
        self.inflight: dict[str, str] = {}   # candidate or semantic hash -> experiment
        self.running: set[str] = set()       # experiments and baselines with a run in flight
        # One confirmation at a time: the experiment whose pairs past the first hold the master
        # (see `grant`), and those measured once that wait to start theirs.
        self.confirming: str | None = None
        self.confirm_waiting: set[str] = set()
        self._lock = threading.Lock()

    def resize(self, slots: list[str] | None) -> None:
        with self._lock:
            self.slots = list(slots) if slots is not None else None

    def observe(self, name: str, status: dict, priority: int = 0) -> None:
        """Take in one Experiment's status as last written (StatusError if it is not one)."""
        st = ExperimentStatus.parse(status)
        confirm = isinstance(st.raw.get("pairs"), dict) and st.active
        with self._lock:
            self._release(name)
            for h in [h for h, who in self.inflight.items() if who == name]:
                del self.inflight[h]
            self.waiting.pop(name, None)
            self.confirm_waiting.discard(name)
            if self.confirming == name and not confirm:
                self.confirming = None  # its verdict is in (or it started over): the next one
            if confirm and st.job and self.confirming is None:
                self.confirming = name  # a pair run in flight holds the token
            if not st.active:
                return
            for h in st.hashes:
                self.inflight.setdefault(h, name)
            if st.job:
                self.running.add(name)
                if self.slots is not None and st.job.slot in self.slots:
                    self.held[st.job.slot] = name
            elif st.phase in (QUEUED, CONFIRMING):
                self.waiting[name] = (queue_priority(priority, st.phase), st.queued_at or "")
                if confirm:
                    self.confirm_waiting.add(name)

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

    def grant(self, name: str, priority: int, queued_at: str,
              confirm: bool = False) -> str | None:
        """A slot for `name` if it is next in line, reserved until `observe` or `release`.

        `confirm`: the run is one of its pair runs past the first. Confirmations go one experiment
        at a time: while another's are under way, this one waits (and takes no slot from others).
        Each promotion makes every confirmation in flight start over on the new master, so
        confirmations side by side mostly measure pairs that can no longer be promoted.
        """
        with self._lock:
            if confirm:
                self.confirm_waiting.add(name)
                if self.confirming not in (None, name):
                    self.waiting[name] = (priority, queued_at)
                    return None
            if self.slots is None:
                slot = UNLIMITED
            else:
                slot = next((s for s, who in self.held.items() if who == name), None)
                if slot is None:
                    self.waiting[name] = (priority, queued_at)
                    blocked = self.confirm_waiting - {self.confirming} \
                        if self.confirming else set()
                    if confirm and self.confirming is None:
                        # the next confirmation: only the first in line among those waiting
                        blocked = self.confirm_waiting - {self._next_confirmation()}
                    queued = [(n, p, q) for n, (p, q) in self.waiting.items()
                              if n not in blocked]
                    slot = allocate_slots(queued, set(self.held), self.slots).get(name)
                    if slot is not None:
                        self.held[slot] = name
                        self.waiting.pop(name, None)
            if slot is not None and confirm:
                self.confirming = name
                self.confirm_waiting.discard(name)
            return slot

    def next_in_line(self) -> str | None:
        """Who `grant` would give the next free slot to, as things stand (None: nobody waits)."""
        with self._lock:
            blocked = self.confirm_waiting - {self.confirming} if self.confirming else set()
            order = sorted(((n, p, q) for n, (p, q) in self.waiting.items() if n not in blocked),
                           key=lambda t: (-t[1], t[2], t[0]))
            return order[0][0] if order else None

    def _next_confirmation(self) -> str | None:
        order = sorted((n for n in self.confirm_waiting if n in self.waiting),
                       key=lambda n: (-self.waiting[n][0], self.waiting[n][1], n))
        return order[0] if order else None

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
            self.confirm_waiting.discard(name)
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
