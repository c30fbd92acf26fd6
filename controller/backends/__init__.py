"""Backends: where a run executes. Each one offers the same small seam.

A backend turns a candidate into a run with a deterministic name, observes
it, and cancels it. `submit` must adopt a run that already exists under that
name (a restarted controller calls it again), never start a second one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from controller.core.errors import MachineError
from controller.core.reconcile import RunObservation


class BackendConfigError(MachineError):
    """The lab's settings for a backend cannot work (no token, data it cannot reach): every
    run on it would fail the same way, so the loop stops and the message says what to set,
    instead of recording it against one experiment after another."""


@dataclass(frozen=True)
class RunRequest:
    """Everything a backend needs to start one run of the bench harness."""

    run: str                 # deterministic run name, e.g. exp-warmdown-075-1
    experiment: str          # experiment name ("baseline" for a master's baseline)
    campaign: str
    candidate_source: str    # the surface source to run
    slot: str | None         # GPU id, "cpu", or None where the backend schedules itself
    profile: str
    data: str
    budget_seconds: int | None
    gpus: int = 1
    overrides: dict | None = None  # per-experiment backend settings (e.g. spec.hf)
    owner: dict | None = None      # in a cluster: the ownerReference its objects carry
    seed: int = 0                  # the harness's seed: 0 measured run, 1.. repeat runs
    eval_limit: float | None = None  # seconds its evaluation may take (None: the profile's)


class Backend(Protocol):
    """What the engine asks of a backend. The first five every backend writes; the rest are
    what only some backends can do, with the answer of one that cannot, so a backend inherits
    them (`class LocalBackend(Backend)`) and writes only those it offers."""

    name: str

    def submit(self, req: RunRequest) -> RunObservation: ...

    def observe(self, run: str) -> RunObservation: ...

    def cancel(self, run: str) -> RunObservation: ...

    def cleanup(self, run: str) -> None:
        """Remove what the run left in the backend once its result is recorded."""

    def leftovers(self, run: str) -> bool:
        """True while `cleanup` still has something to remove."""

    # -- what only some backends can do (the local one does all of it) -----------------------
    starts_ahead: bool = False
    """Whether `start_next` starts anything: the engine asks the core who is next only then."""

    def start_next(self, req: RunRequest) -> None:
        """Start the run `req` on its slot now, held until its `submit` (while the slot's run
        is evaluated). A backend that schedules its own machines starts nothing ahead."""

    def stop_next(self, slot: str | None = None) -> None:
        """Stop the run started ahead on `slot` (every slot: None); none started, none stopped."""

    def give_back(self, run: str) -> None:
        """`run`'s evaluation ran out of time beside a run started ahead: stop that one. Without
        `start_next` there is no neighbour to stop."""

    def slot_of(self, run: str) -> str | None:
        """The slot (a GPU of this machine) `run` holds; None where the backend schedules it."""
        return None

    def reap_stale(self) -> list[str]:
        """Stop what a controller that is gone started ahead, one line per run for a person."""
        return []

    def close(self) -> None:
        """Let go of what this backend holds in this process (its runs go on)."""
