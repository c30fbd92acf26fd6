"""The engine's seams: what a front end gives it, and the only places the front ends differ.

Where an experiment and its status live (`StatusStore`: JSON files under `.autolab/status`,
or the custom resource's status), where the master lives (`MasterOfRecord`:
`research/live/master.json` and the lab repo, or the master ConfigMap; each promotion a
compare-and-swap) and how events are told (`EventSink`: a JSONL file per experiment, or
Kubernetes Events). `Observed` is one experiment as its front end read it: the front end
hands it to `Engine.reconcile`, which never reads it again in that pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from controller.core.intents import Event, Promotion
from controller.core.reconcile import Master, PromotionResult
from controller.lab.memory import remember_quietly
from controller.lab.paths import LabPaths
from controller.lab.tracking import track_quietly


@dataclass(frozen=True)
class Observed:
    """One experiment as its front end stores it."""

    name: str
    key: str                  # names the kept copy of its checked spec (a name, or a uid)
    spec: dict | None         # the spec as it is now (None: it is gone)
    status: dict
    generation: int = 1
    deleting: bool = False
    spec_error: str | None = None  # the front end's own refusal of the spec (schema, backend)
    owner: dict | None = None      # in a cluster: the ownerReference of what its run creates
    created: str = ""              # when the user applied it: its place in the queue (slots.py)


class StatusStore(Protocol):
    """Where experiments and their statuses live.

    The front end reads an experiment and hands it to `Engine.reconcile`; the engine reads
    through `read` only what its pass was not handed: another experiment (the one started up
    next to a run), or the status again after a pass that failed.
    """

    def read(self, name: str) -> Observed | None: ...

    def write_status(self, name: str, status: dict, previous: dict | None = None) -> None:
        """Store `status` whole. `previous` is the status it replaces, where the engine knows it
        (a store that writes by merge patch removes the keys `status` no longer has)."""

    def finalized(self, name: str) -> None:
        """The experiment is recorded and cleaned up and was deleted: let it go."""


class MasterOfRecord(Protocol):
    """Where the master lives. On one machine, the lab repo itself (`LabRepo`: master.json
    and the `autolab/master` branch); in a cluster, the master ConfigMap, which the lab repo
    follows.

    `before_checks(asked_at)` brings the lab repo's master in step before a candidate is
    checked against it: a store that mirrors another (the cluster's) does that; the lab repo,
    its own master, has nothing to do. It is called under the engine's lock; `asked_at`
    (time.monotonic()) is when the check asked: a bringing in step begun since then (under the
    same lock) is as fresh as a new one.
    """

    def master(self) -> Master: ...

    def before_checks(self, asked_at: float | None = None) -> None: ...

    def master_source(self) -> str: ...

    def promote_candidate(self, promotion: Promotion) -> PromotionResult:
        """Compare-and-swap the candidate in as the master (see `Promotion`)."""

    def set_master_metric(self, val_bpb: float, places: dict | None = None,
                          master_hash: str | None = None) -> None:
        """The baseline: the master's val_bpb, and its value at the places it ran; only while
        `master_hash` (where given) is still the master."""

    def set_place(self, master_hash: str, place: int, val_bpb: float) -> bool:
        """Keep the master's value at `place` if `master_hash` is still the master and the
        place has none yet; True if it was kept."""


class EventSink(Protocol):
    def experiment(self, name: str, event: Event) -> None: ...

    def lab(self, event: Event) -> None: ...

    def lab_changed(self) -> None:
        """A phase or the master changed (the operator mirrors it onto the Lab's status)."""


# After a ledger row is written: (paths, lab name, surface, row, checked spec, status).
Hook = Callable[[LabPaths, str, str, dict, "dict | None", "dict | None"], None]
DEFAULT_HOOKS: tuple[Hook, ...] = (remember_quietly, track_quietly)
