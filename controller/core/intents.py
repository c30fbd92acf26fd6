"""What reconcile() asks the engine to do: one small, typed, idempotent effect per class.

`reconcile(world)` returns a `Decision`: the status the experiment should have now, the
events that tell the transition, and a list of intents. Each intent is a frozen dataclass
that names one effect and carries exactly what the engine needs to carry it out; the engine
has one method per class (`controller.engine`, dispatched on the type). Every intent is safe
to carry out twice: a run submitted again is adopted, a ledger row written again is refused
by its run id, a cleanup of what is gone does nothing. So a front end may store the status
first and carry out the intents after, and a crash in between is healed by the next pass.

    Materialise       check the diff and make the candidate (then the duplicate lookup)
    AcquireSlot       ask the slot book for a GPU slot (by priority, then creation time)
    ClaimTest         count this decision as a test against its master (its level)
    Submit            start (or adopt) a run of the candidate or of its master at a place
    Cancel            stop a run (the spec was deleted)
    CleanupRun        remove a backend's objects of a run that ended mid-life
    SetPlace          keep the master's value at a place, measured by this experiment's run
    Promote           compare-and-swap the candidate in as the master
    Record            append one ledger row
    Cleanup           remove the candidate's worktree and the backend's objects at the end

The master's baseline has intents of its own: `Submit`, `Record`, `SetMasterMetric` and
`ResubmitBaseline` (`reconcile_baseline`).

`kind` is each class's name in the lab's vocabulary: what tests and transcripts print.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class Materialise:
    kind: ClassVar[str] = "materialise"


@dataclass(frozen=True)
class AcquireSlot:
    kind: ClassVar[str] = "acquire-slot"
    priority: int = 0
    confirm: bool = False  # a decision's pair run (one experiment at a time holds these)


@dataclass(frozen=True)
class ClaimTest:
    kind: ClassVar[str] = "claim-test"


@dataclass(frozen=True)
class Submit:
    kind: ClassVar[str] = "submit"
    run: str
    slot: str | None = None
    backend: str = ""
    program: str = "candidate"  # candidate | master (a pair run of the master it was built on)
    place: int | None = 1       # its harness seed is its place's
    claim: bool = False         # its first run: count the test first (ClaimTest)


@dataclass(frozen=True)
class Cancel:
    kind: ClassVar[str] = "cancel"
    run: str
    backend: str


@dataclass(frozen=True)
class CleanupRun:
    kind: ClassVar[str] = "cleanup-run"
    run: str
    backend: str


@dataclass(frozen=True)
class SetPlace:
    kind: ClassVar[str] = "set-place"
    master: str
    place: int
    val_bpb: float


@dataclass(frozen=True)
class Promote:
    kind: ClassVar[str] = "promote"
    run: str | None
    val_bpb: float
    margin: float = 0.0              # -inf: the pairs already decided
    places: dict = field(default_factory=dict)  # the candidate's values by place: the new master's
    against: float | None = None     # the value it was judged against (None: the master's)


@dataclass(frozen=True)
class Record:
    kind: ClassVar[str] = "record"
    row: dict


@dataclass(frozen=True)
class Cleanup:
    kind: ClassVar[str] = "cleanup"


@dataclass(frozen=True)
class SetMasterMetric:
    kind: ClassVar[str] = "set-master-metric"
    val_bpb: float
    run: str


@dataclass(frozen=True)
class ResubmitBaseline:
    kind: ClassVar[str] = "resubmit-baseline"
    run: str
    reason: str = ""


Intent = (Materialise | AcquireSlot | ClaimTest | Submit | Cancel | CleanupRun | SetPlace
          | Promote | Record | Cleanup | SetMasterMetric | ResubmitBaseline)


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Decision:
    status: dict
    intents: list[Intent] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    # The object may go: it is terminal, recorded and cleaned up (finalizers may be removed).
    finalized: bool = False

    def kinds(self) -> list[str]:
        return [i.kind for i in self.intents]


@dataclass(frozen=True)
class Promotion:
    """What the engine asks of the master of record when it carries out a `Promote`: a
    compare-and-swap. `name` replaces the master if the master is still `parent` and `val_bpb`
    beats `against` (the value it was judged against; None: the master's) by more than
    `margin` (-inf: the pairs already decided). `places`: the candidate's values by place,
    the new master's."""

    name: str
    commit: str
    source: str
    val_bpb: float
    hashes: tuple[str, str]  # the candidate's exact and semantic hashes
    parent: str
    now: str
    margin: float = 0.0
    against: float | None = None
    places: dict | None = None
