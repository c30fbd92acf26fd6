"""An Experiment's status, typed: its phases, the reasons it can carry, and a parsed view.

The status is stored as JSON (a file beside the spec, or the custom resource's
`status`), written by `reconcile()` alone. Everything that reads one to plan (the
engine, the slot book, the front ends' listings) reads it through
`ExperimentStatus.parse`, which says what is wrong with a status that is not one
instead of letting a `.get` chain fail somewhere later. The reasons are the
`reason` of a phase or a condition, as Kubernetes API conventions have them:
one CamelCase word a program can match on, with the message for people beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controller.core.errors import MachineError


# --- phases ------------------------------------------------------------------------------------

PENDING, QUEUED, RUNNING = "Pending", "Queued", "Running"
# Measured once, and measured again before the verdict: more pairs (the first decided nothing)
# or a rebased follow-up (the master moved before the verdict).
CONFIRMING = "Confirming"
SUCCEEDED, FAILED, CANCELLED = "Succeeded", "Failed", "Cancelled"
INVALID, DUPLICATE, CONFLICT = "Invalid", "Duplicate", "Conflict"
TERMINAL = (INVALID, DUPLICATE, CONFLICT, SUCCEEDED, FAILED, CANCELLED)
ACTIVE = (QUEUED, RUNNING, CONFIRMING)
PROMOTED, REJECTED = "Promoted", "Rejected"  # the outcome of a Succeeded experiment
# ... or Undecided: its pairs kept a gain inside their interval but did not show it at its level
# by the hard cap. Not a measured rejection: the same candidate may be applied again, and
# continues from these pairs.
UNDECIDED = "Undecided"


# --- reasons -----------------------------------------------------------------------------------

class Reason:
    """The reasons `reconcile()` writes (a refusal's reason comes from the checks)."""

    ACCEPTED = "Accepted"
    INVALID_SPEC = "InvalidSpec"
    SPEC_IMMUTABLE = "SpecImmutable"
    CHECKS_PASSED = "ChecksPassed"
    DUPLICATE_CANDIDATE = "DuplicateCandidate"
    WAITING_FOR_BASELINE = "WaitingForBaseline"
    WAITING_FOR_SLOT = "WaitingForSlot"
    SUBMITTED = "Submitted"
    RUN_QUEUED = "RunQueued"
    WAITING_FOR_ADMISSION = "WaitingForAdmission"  # a suspended Job waits for its queue (Kueue)
    RUN_STARTED = "RunStarted"
    RUN_FINISHED = "RunFinished"
    RUN_CANCELLED = "RunCancelled"
    RUN_LOST = "RunLost"
    CANDIDATE_FAILED = "CandidateFailed"
    INFRASTRUCTURE_ERROR = "InfrastructureError"
    NO_METRIC = "NoMetric"
    PROMOTING = "Promoting"
    BEAT_MASTER = "BeatMaster"
    DID_NOT_BEAT_MASTER = "DidNotBeatMaster"
    MASTER_MOVED = "MasterMoved"  # it beat the master, but was built on an older one
    REBASED = "Rebased"           # rebased onto the current master right before it started
    FOLLOW_UP = "FollowUp"        # it won on an older master: a rebased run measures it again
    CONFIRM_RUNS = "ConfirmRuns"  # (a status of a controller before pairs)
    PAIRS = "Pairs"               # its pairs so far decide nothing yet: one more pair
    PAIR_RUN_LOST = "PairRunLost"  # a pair run ended with no value, not the candidate's doing
    CONFIRMED = "Confirmed"       # the pairs' test says it is better
    WITHIN_NOISE = "WithinNoise"  # its pairs show no gain (the test's verdict, or its cap)
    NOT_CONFIRMED = "NotConfirmed"  # a pair run of the candidate failed: no verdict
    NEAR_DUPLICATE = "NearDuplicate"  # moves a constant the way a rejected experiment did
    RUN_RETRIED = "RunRetried"    # a run was lost (machine, node, controller): run again, same place
    RUNS_LOST = "RunsLost"        # one run was lost more often than LOST_RETRIES: no verdict
    CONTINUED = "Continued"       # it took the pairs of the same candidate's unfinished decision
    UNDECIDED = UNDECIDED
    PROMOTED = PROMOTED
    REJECTED = REJECTED
    DELETED = "Deleted"


class Condition:
    """The condition types of an Experiment's status."""

    CHECKED = "Checked"
    SCHEDULED = "Scheduled"
    RUNNING = "Running"
    PROMOTED = "Promoted"
    SPEC_CHANGE_IGNORED = "SpecChangeIgnored"
    CONFIRMING = "Confirming"
    NEAR_DUPLICATE = "NearDuplicate"


# Reason codes of the run harness (bench/run.py) that a Failed phase carries as its reason,
# by the run state they come with.
HARNESS_REASONS = {
    "failed": ("CandidateCrashed", "BudgetExceeded", "NoExport", "NoTraining", "ExportRefused",
               "NotCausal", "EvaluationFailed", "ProcessesLeft", "ResultNotAuthentic"),
    "error": ("HarnessTampered", "DataUnavailable", "SandboxUnavailable", "HarnessError"),
}


# Failed reasons that measured nothing about the candidate (the infrastructure failed, or the
# run was lost): their ledger row says "error", which does not count as measured, so the same
# candidate may run again.
NOT_MEASURED = (Reason.INFRASTRUCTURE_ERROR, Reason.RUN_LOST, Reason.PAIR_RUN_LOST,
                Reason.RUNS_LOST) \
    + HARNESS_REASONS["error"]


# --- the parsed view ---------------------------------------------------------------------------

class StatusError(MachineError, ValueError):
    """A stored status that is not one (a hand edit, a crash mid-write, another tool)."""


def _text(d: dict, key: str, where: str) -> str | None:
    v = d.get(key)
    if v is not None and not isinstance(v, str):
        raise StatusError(f"{where}{key}: expected a string, found {type(v).__name__}")
    return v


@dataclass(frozen=True)
class JobRef:
    """The run an experiment submitted: `status.job`."""

    backend: str
    name: str
    slot: str | None = None
    id: str = ""
    worker: str = ""

    @classmethod
    def parse(cls, d: Any) -> "JobRef":
        if not isinstance(d, dict):
            raise StatusError(f"status.job: expected a mapping, found {type(d).__name__}")
        backend, name = _text(d, "backend", "status.job."), _text(d, "name", "status.job.")
        if not backend or not name:
            raise StatusError("status.job: backend and name are required")
        return cls(backend, name, _text(d, "slot", "status.job."),
                   _text(d, "id", "status.job.") or "", _text(d, "worker", "status.job.") or "")


@dataclass(frozen=True)
class ExperimentStatus:
    """What planning reads of a status. `raw` is the stored dict, untouched."""

    phase: str | None
    reason: str | None
    job: JobRef | None
    candidate_hash: str | None
    semantic_hash: str | None
    created_at: str | None
    queued_at: str | None
    outcome: str | None
    raw: dict

    @classmethod
    def parse(cls, d: Any) -> "ExperimentStatus":
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise StatusError(f"status: expected a mapping, found {type(d).__name__}")
        job = JobRef.parse(d["job"]) if d.get("job") else None
        return cls(phase=_text(d, "phase", "status."), reason=_text(d, "reason", "status."),
                   job=job, candidate_hash=_text(d, "candidateHash", "status."),
                   semantic_hash=_text(d, "semanticHash", "status."),
                   created_at=_text(d, "createdAt", "status."),
                   queued_at=_text(d, "queuedAt", "status."),
                   outcome=_text(d, "outcome", "status."), raw=d)

    @property
    def active(self) -> bool:
        return self.phase in ACTIVE

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL

    @property
    def hashes(self) -> tuple[str, ...]:
        return tuple(h for h in (self.candidate_hash, self.semantic_hash) if h)
