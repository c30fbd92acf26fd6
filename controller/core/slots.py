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
        self._lock = threading.Lock()

    def resize(self, slots: list[str] | None) -> None:
        with self._lock:
            self.slots = list(slots) if slots is not None else None

    def observe(self, name: str, status: dict, priority: int = 0) -> None:
        """Take in one Experiment's status as last written (StatusError if it is not one)."""
        st = ExperimentStatus.parse(status)
        with self._lock:
            self._release(name)
            for h in [h for h, who in self.inflight.items() if who == name]:
                del self.inflight[h]
            self.waiting.pop(name, None)
            if not st.active:
                return
            for h in st.hashes:
                self.inflight.setdefault(h, name)
            if st.job:
                self.running.add(name)
                if self.slots is not None and st.job.slot in self.slots:
                    self.held[st.job.slot] = name
            elif st.phase in (QUEUED, CONFIRMING):
                self.waiting[name] = (priority, st.queued_at or "")

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

    def grant(self, name: str, priority: int, queued_at: str) -> str | None:
        """A slot for `name` if it is next in line, reserved until `observe` or `release`."""
        with self._lock:
            if self.slots is None:
                return UNLIMITED
            for slot, who in self.held.items():
                if who == name:
                    return slot
            self.waiting[name] = (priority, queued_at)
            queued = [(n, p, q) for n, (p, q) in self.waiting.items()]
            slot = allocate_slots(queued, set(self.held), self.slots).get(name)
            if slot is not None:
                self.held[slot] = name
                self.waiting.pop(name, None)
            return slot

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
            for h in [h for h, who in self.inflight.items() if who == name]:
                del self.inflight[h]

    def _release(self, name: str) -> None:
        self.running.discard(name)
        for slot in [s for s, who in self.held.items() if who == name]:
            del self.held[slot]

    def in_flight(self) -> int:
        with self._lock:
            return len(self.running)
