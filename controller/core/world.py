"""What a front end observed about one experiment: the World that reconcile() reads.

The engine builds one World per step of a pass (`Engine.world`, the one place it is made):
the experiment's spec and last status, the master (`Master`), what the pre-run checks made
of the diff (`Candidate`), the backend's view of its run (`RunObservation`), the answer of a
promotion's compare-and-swap (`PromotionResult`), and the engine's own counts (its test's
number and level, pairs it may carry). Pure data: the core reads it and decides.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from controller.core.spec import ExperimentSpec, LabSpec


# --- what the front end observed -------------------------------------------------------------

@dataclass(frozen=True)
class Master:
    """The promoted surface: its hashes, its commit and its measured metric (None: not yet)."""

    hash: str
    semantic_hash: str
    commit: str
    val_bpb: float | None = None
    experiment: str | None = None
    # Its val_bpb at each place (the i-th secret harness seed): measured once, reused by every
    # candidate; a promoted candidate's own runs. Keys are places (1, 2, ...).
    places: dict = field(default_factory=dict)

    def place(self, i: int) -> float | None:
        """The master's value at place `i`. A master measured before places (its val_bpb from
        one run on seed 0) stands for place 1 with that value, also once later places of it
        are measured (else its decisions would wait for a baseline that never comes)."""
        v = self.places.get(i)
        if v is None and i == 1:
            return self.val_bpb
        return v


@dataclass(frozen=True)
class Candidate:
    """What materialising the spec produced: a checked candidate, or the refusal."""

    refusal: str | None = None  # "Invalid" or "Conflict"
    reason: str = ""
    message: str = ""
    candidate_hash: str | None = None
    semantic_hash: str | None = None
    parent_hash: str | None = None
    rebased_from: str | None = None
    commit: str | None = None
    changed_lines: int = 0


@dataclass(frozen=True)
class RunObservation:
    """A backend's view of one run. `result` is the run harness's result JSON when finished."""

    name: str
    state: str  # missing | queued | running | succeeded | failed | error | cancelled | lost
    result: dict | None = None
    message: str = ""
    job_id: str = ""
    worker: str = ""
    reason: str = ""  # what a queued run waits for (a Reason: WaitingForAdmission); "": RunQueued
    # A running run that no longer needs its GPU alone: its candidate is gone and its evaluator
    # holds the memory it needs. The engine may start the slot's next run up beside it.
    handover: bool = False
    # A running run whose evaluation ran out of time beside the run started up next to it: it
    # wants its GPU back (that run stopped) to measure the model again, alone.
    handback: bool = False


@dataclass(frozen=True)
class PromotionResult:
    promoted: bool
    master_val_bpb: float | None
    message: str = ""
    reason: str = ""  # why not, as a Reason (DidNotBeatMaster, MasterMoved)


@dataclass(frozen=True)
class World:
    name: str
    spec: ExperimentSpec | None
    lab: LabSpec
    master: Master
    now: str
    status: dict = field(default_factory=dict)
    spec_error: str | None = None
    generation: int = 1
    deleting: bool = False
    candidate: Candidate | None = None
    duplicate_of: str | None = None
    slot: str | None = None
    run: RunObservation | None = None
    promotion: PromotionResult | None = None
    recorded: bool = False
    worktree: bool = False
    near_duplicates: tuple[str, ...] = ()  # judged experiments that made the same move
    # Which test against the current master this experiment's would be (1: the first): the
    # engine counts the experiments that began one against it. It sets the test's level.
    tries: int = 1
    # The level this experiment's test would run at if it began now (the engine's online FDR
    # control, `controller.core.noise.lord_level`); None: the older rule, `test_alpha(tries)`.
    level: float | None = None
    # Values of this same candidate, on this same master, at places 1..k, from decisions of it
    # that ended without a verdict (Undecided, RunsLost): (experiments, {place: val_bpb}). A
    # decision that has not begun takes them and goes on from place k + 1.
    carried: tuple[tuple[str, ...], dict] | None = None
    # Randomness for what must be secret from a candidate: the order of the two runs at a place
    # (`next_run`). Drawn when the front end builds the World, so reconcile stays a function of
    # its input and tests can pin it.
    entropy: int = field(default_factory=lambda: secrets.randbits(64))


def run_name(name: str, attempt: int = 1) -> str:
    return f"exp-{name}-{attempt}"


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == x and x not in (float("inf"), float("-inf"))
