"""The lifecycle of an experiment, as one pure function.

`reconcile(world) -> Decision` reads what a front end observed about one
experiment (its spec, its last status, the master, the checks on its
candidate, its run) and returns the status it should have now plus the
intents that move the world one step towards the spec. It does no I/O, reads
no clock (the time is part of the world) and draws no random numbers (what it
needs, the seeds of confirm runs, comes from the world's `entropy`), so the
kopf operator and the local loop share it, and tables of worlds test it.

    Pending -> Invalid | Duplicate | Conflict
    Pending -> Queued -> Running -> Succeeded (outcome Promoted | Rejected) | Failed
    Running -> Confirming -> Succeeded   (measured again before the verdict)
    any non-terminal phase -> Cancelled (the spec was deleted)

The master moves only by real, cumulative improvements:

- A queued experiment is rebased onto the current master right before its run
  starts (a conflict ends it Conflict, an empty result Duplicate).
- A run judged after the master moved is judged against its own parent's
  measurement; if it won there, a rebased follow-up run (attempt 2, then 3)
  measures it on the current master, and only that run can promote it.
- A win is confirmed before it is promoted (`controller.core.noise.confirm_runs`
  says when: with `minDelta: auto`, the default, every win beyond the margin;
  every improvement when the lab asks for confirm runs): fresh runs of the
  candidate and of its master, then the test in `controller.core.noise`.

Every intent is idempotent and every one that must happen at a terminal phase
(recording the ledger row, removing the worktree) is issued again until the
world shows it done. So a front end may write the status first and carry out
the intents after: a crash in between is healed by the next pass. Runs have
deterministic names (`exp-<name>-<attempt>`), so submitting twice adopts the
run that exists instead of starting a second one.
"""

from __future__ import annotations

import copy
import secrets
from dataclasses import dataclass, field
from typing import Any

from controller.core import figures
from controller.core.noise import (CONFIRM_SEEDS, MAX_ATTEMPTS, confirm, confirm_alpha,
                                   confirm_runs, confirm_seeds, margin, mean, within_noise)
from controller.core.slots import queue_priority
from controller.core.spec import ExperimentSpec, LabSpec
# ACTIVE and TERMINAL are re-exported: the front ends and the CLI read them from here.
from controller.core.status import (ACTIVE, CANCELLED, CONFIRMING, DUPLICATE, FAILED,  # noqa: F401
                                    HARNESS_REASONS, INVALID, PENDING, PROMOTED, QUEUED, REJECTED,
                                    NOT_MEASURED, RUNNING, SUCCEEDED, TERMINAL, Condition,
                                    Reason)

SUMMARY_KEYS = ("val_bpb", "training_seconds", "total_seconds", "peak_vram_mb", "mfu_percent",
                "total_tokens_M", "num_steps", "num_params_M", "depth")


# --- what the front end observed -------------------------------------------------------------

@dataclass(frozen=True)
class Master:
    """The promoted surface: its hashes, its commit and its measured metric (None: not yet)."""

    hash: str
    semantic_hash: str
    commit: str
    val_bpb: float | None = None
    experiment: str | None = None


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
    noise: float | None = None  # the lab's measured sigma for its profile and budget
    noise_df: int = 0           # its degrees of freedom (repeat runs - 1)
    reference: float | None = None  # the master's val_bpb averaged over its repeat runs, if any
    near_duplicates: tuple[str, ...] = ()  # judged experiments that made the same move
    # Which confirm test against the current master this one would be (1: the first): other
    # experiments with a candidate's confirm run against it, plus one. It sets the test's level.
    confirm_tries: int = 1
    # Randomness for what must be secret from a candidate: the seeds of confirm runs (see
    # `controller.core.noise.confirm_seeds`). It is drawn when the front end builds the World,
    # so reconcile stays a function of its input and tests can pin it.
    entropy: int = field(default_factory=lambda: secrets.randbits(64))


# --- what reconcile asks for -----------------------------------------------------------------

@dataclass(frozen=True)
class Intent:
    """One idempotent effect for the front end to carry out.

    kinds: materialise, acquire-slot(priority, queued_at), submit(run, slot, backend,
    program, seed), cancel(run), promote(run, val_bpb, margin), record(row), cleanup,
    cleanup-run(run, backend): the backend's objects of a run that ended mid-life.
    """

    kind: str
    args: dict = field(default_factory=dict)


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


def run_name(name: str, attempt: int = 1) -> str:
    return f"exp-{name}-{attempt}"


def beats(val: float, master_val: float | None, min_delta: float) -> bool:
    """True when `val` improves on the master by more than `min_delta` (lower is better)."""
    if master_val is None:
        return False
    return (master_val - val) > min_delta


def promotion_refused(current: dict, experiment: str, val_bpb: float, min_delta: float,
                      previous_val_bpb: float | None, parent: str,
                      against: float | None = None) -> PromotionResult | None:
    """The compare of a compare-and-swap promotion, for every master store: None means "swap".

    `current` is the master as just read under the store's lock or version (its "hash",
    "experiment" and "val_bpb"); `parent` the master the candidate was built on. A master is
    only ever replaced by a program that contains it: a candidate built on an older master is
    refused (MasterMoved), however good. One built on the current master must beat `against`,
    the value it was judged against (the mean of that master's repeat runs where there are
    some), by more than `min_delta`; without `against` or a parent, the master's stored
    val_bpb. `previous_val_bpb` is what the master measured before
    `experiment` was promoted, in case it already was (a retried promotion settles as done).
    """
    if current.get("experiment") == experiment:
        return PromotionResult(True, previous_val_bpb)
    if parent and current.get("hash") != parent:
        return PromotionResult(False, current.get("val_bpb"), master_moved(
            val_bpb, parent, str(current.get("hash", "")), current.get("experiment")),
            Reason.MASTER_MOVED)
    ref = against if against is not None and parent else current.get("val_bpb")
    if not beats(val_bpb, ref, min_delta):
        return PromotionResult(False, current.get("val_bpb"),
                               f"val_bpb {val_bpb:.6f} did not beat the master "
                               f"{str(current.get('hash', ''))[:12]} "
                               f"({current.get('experiment') or 'seed'}, "
                               f"{current.get('val_bpb')}), "
                               "which was promoted while this run was in flight.",
                               Reason.DID_NOT_BEAT_MASTER)
    return None


def master_moved(val_bpb: float, parent: str, master: str, experiment: str | None) -> str:
    return (f"val_bpb {val_bpb:.6f} was measured on master {parent[:12]}, and the master moved "
            f"to {master[:12]} ({experiment or 'seed'}) while it ran: promoting it would drop "
            "that change. Apply the same change again under a new name: it rebases onto the "
            "current master and is measured there.")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == x and x not in (float("inf"), float("-inf"))


# --- the function ----------------------------------------------------------------------------

class _Step:
    """Accumulates the decision while the phases are walked."""

    def __init__(self, w: World):
        self.w = w
        self.st = copy.deepcopy(w.status) if w.status else {}
        self.intents: list[Intent] = []
        self.events: list[Event] = []

    def condition(self, type_: str, status: bool, reason: str, message: str) -> None:
        conds = self.st.setdefault("conditions", [])
        value = "True" if status else "False"
        for c in conds:
            if c["type"] == type_:
                if c["status"] != value:
                    c["lastTransitionTime"] = self.w.now
                c.update(status=value, reason=reason, message=message)
                return
        conds.append({"type": type_, "status": value, "reason": reason, "message": message,
                      "lastTransitionTime": self.w.now})

    def phase(self, phase: str, reason: str, message: str, warning: bool = False) -> None:
        if self.st.get("phase") != phase:
            self.events.append(Event("Warning" if warning else "Normal", reason, message))
            if phase in TERMINAL:
                self.st["finishedAt"] = self.w.now
        self.st.update(phase=phase, reason=reason, message=message)

    def decision(self, finalized: bool = False) -> Decision:
        self.st["observedGeneration"] = self.w.generation
        return Decision(self.st, self.intents, self.events, finalized)


def reconcile(w: World) -> Decision:
    s = _Step(w)
    st = s.st
    if not st.get("phase"):
        s.phase(PENDING, Reason.ACCEPTED, "Waiting for the pre-run checks.")
        st["createdAt"] = w.now
        if w.spec is not None:
            st["specGeneration"] = w.generation
    phase = st["phase"]

    if w.deleting:
        return _reconcile_deleting(s)
    if phase in TERMINAL:
        return _settle_terminal(s)
    if w.spec_error and phase == PENDING:  # after the checks, the checked spec is what runs
        s.phase(INVALID, Reason.INVALID_SPEC, w.spec_error, warning=True)
        s.condition(Condition.CHECKED, False, Reason.INVALID_SPEC, w.spec_error)
        return _settle_terminal(s)
    if st.get("specGeneration") not in (None, w.generation) and phase != PENDING:
        s.condition(Condition.SPEC_CHANGE_IGNORED, True, Reason.SPEC_IMMUTABLE,
                    "The spec changed after its checks; an experiment runs the spec it was "
                    "checked with. Apply the change under a new name.")
    if phase == PENDING:
        return _reconcile_pending(s)
    return _reconcile_active(s)


def _reconcile_pending(s: _Step) -> Decision:
    w, st = s.w, s.st
    if w.candidate is None:
        s.intents.append(Intent("materialise"))
        return s.decision()
    c = w.candidate
    if c.refusal:
        s.phase(c.refusal, c.reason, c.message, warning=True)
        s.condition(Condition.CHECKED, False, c.reason, c.message)
        return _settle_terminal(s)
    duplicate = _take_candidate(s, c, c.rebased_from, "")
    if duplicate is not None:
        return duplicate
    msg = "The diff applies, the candidate compiles and is new."
    if c.rebased_from:
        msg = (f"The diff was written against {c.rebased_from[:12]} and rebased cleanly onto "
               f"master {c.parent_hash[:12]}; the candidate compiles and is new.")
    s.condition(Condition.CHECKED, True, Reason.CHECKS_PASSED, msg)
    if w.near_duplicates:
        near = ("A near-duplicate (it runs anyway): " + "; ".join(w.near_duplicates) +
                ". A different amount, or a reason it differs now, is worth saying in the "
                "hypothesis.")
        s.condition(Condition.NEAR_DUPLICATE, True, Reason.NEAR_DUPLICATE, near)
        s.events.append(Event("Warning", Reason.NEAR_DUPLICATE, near))
    s.phase(QUEUED, Reason.CHECKS_PASSED, "Waiting for a free slot.")
    st["queuedAt"] = w.now
    return _reconcile_active(s)


def next_run(name: str, st: dict) -> dict:
    """The run an active experiment submits next: its name, program and harness seed.

    The first run of attempt n is `exp-<name>-<n>` (seed 0, as the master's baseline). Confirm
    runs `exp-<name>-<n>-c1`, `-m1`, `-c2`, `-m2`, ... go in pairs, in the order c1 m1 m2 c2
    c3 m3 m4 c4: each pair reverses the one before (ABBA). Runs share a machine one after
    another, and what a run leaves behind (a hot GPU, a page cache emptied of the shards) and
    what drifts slowly (clocks, a neighbour's load) fall on the run after it. The candidate's
    first run comes just before c1, so in this order as many master runs as candidate runs
    follow a candidate run, and a drift adds as much to each program's sum; c1 m1 c2 m2 put
    every master run after a candidate run, the later run of each pair on the master, and a
    candidate that leaves the machine slower than it found it would win by it.

    The i-th confirm run of each program takes the i-th of the seeds drawn when the confirm
    runs started (`st["confirm"]["seeds"]`; `controller.core.noise.confirm_seeds`): random,
    none a noise run's, the candidate's and the master's the same (paired). A seed reaches the
    candidate, so it must not say the run's place: in this fixed order the place says whose
    run comes next, and a candidate that slowed the machine only before the master's runs
    would win again. A status from an older controller has no seeds; its runs take
    CONFIRM_SEEDS + i, as they did.
    """
    main = run_name(name, int(st.get("attempt") or 1))
    c = st.get("confirm")
    if not c:
        return {"name": main, "program": "candidate", "seed": 0}
    done = len(c["candidate"]) + len(c["master"])
    candidate_first = (done // 2) % 2 == 0  # pairs 1, 3, 5, ...: candidate, then master
    program = "candidate" if (done % 2 == 0) == candidate_first else "master"
    i = len(c[program]) + 1
    seeds = c.get("seeds") or []
    seed = seeds[i - 1] if i <= len(seeds) else CONFIRM_SEEDS + i
    return {"name": f"{main}-{program[0]}{i}", "program": program, "seed": seed}


def candidate_confirm_run(run_id: str, name: str) -> bool:
    """Whether `run_id`, a ledger row of experiment `name`, is one of its candidate's confirm
    runs (`next_run` names them `exp-<name>-<attempt>-c<i>`)."""
    prefix = f"exp-{name}-"
    if not run_id.startswith(prefix):
        return False
    attempt, _, place = run_id[len(prefix):].partition("-c")
    return attempt.isdigit() and place.isdigit()


def _margin(w: World) -> float | None:
    return margin(w.lab.min_delta, w.noise)


def _moved(w: World, st: dict) -> bool:
    parent = st.get("parentHash") or ""
    return bool(parent) and parent != w.master.hash and w.master.experiment != w.name


def _take_candidate(s: _Step, c: Candidate, rebased_from: str | None,
                    context: str) -> Decision | None:
    """Put a checked candidate on the status; a terminal Duplicate decision if it repeats."""
    w, st = s.w, s.st
    st.update(candidateHash=c.candidate_hash, semanticHash=c.semantic_hash,
              parentHash=c.parent_hash, commit=c.commit)
    if rebased_from:
        st["rebasedFrom"] = rebased_from
    if not w.duplicate_of:
        return None
    st["duplicateOf"] = w.duplicate_of
    what = "the candidate is the same program as" if context else \
        "The candidate is the same program as"
    msg = (f"{context}{what} {w.duplicate_of} (hash {c.candidate_hash[:12]}); no GPU is spent "
           "on a repeat. Change the idea, not the formatting.")
    s.phase(DUPLICATE, Reason.DUPLICATE_CANDIDATE, msg, warning=True)
    s.condition(Condition.CHECKED, False, Reason.DUPLICATE_CANDIDATE, msg)
    return _settle_terminal(s)


def _reconcile_active(s: _Step) -> Decision:
    w, st = s.w, s.st
    if (st.get("confirm") or {}).get("verdict") is not None:
        return _decide_confirmed(s)
    job = st.get("job")
    c = st.get("confirm")
    if not job and c and (c["candidate"] or c["master"]) and _moved(w, st) \
            and w.promotion is None:
        # Between two confirm runs the master moved: the rest of them would measure a pair
        # that can no longer be promoted. Start over on the new master.
        return _follow_up(s, (st.get("metrics") or {}).get(w.lab.metric, 0.0),
                          st.get("parentValBpb"), done=len(c["candidate"]) + len(c["master"]))
    if not job:
        if w.master.val_bpb is None:
            s.condition(Condition.SCHEDULED, False, Reason.WAITING_FOR_BASELINE,
                        "The master has no measured val_bpb yet; its baseline run comes first.")
            return s.decision()
        if _margin(w) is None:
            s.condition(Condition.SCHEDULED, False, Reason.WAITING_FOR_NOISE,
                        "promotion.minDelta is auto and the lab's noise is not measured yet for "
                        "this profile and budget: the controller measures it first "
                        "(promotion.noiseRuns), or run `autolab noise`.")
            return s.decision()
        if w.slot is None:
            s.condition(Condition.SCHEDULED, False, Reason.WAITING_FOR_SLOT,
                        "Waiting for a slot; confirm runs go one experiment at a time."
                        if st.get("confirm") else "All slots are busy.")
            # The front end's slot book answers: a slot (pass it in `World.slot`) or not yet.
            s.intents.append(Intent("acquire-slot", {
                "priority": queue_priority(w.spec.priority if w.spec else 0, st.get("phase")),
                "queued_at": st.get("queuedAt", ""), "confirm": bool(st.get("confirm"))}))
            return s.decision()
        nxt = next_run(w.name, st)
        fresh = not c or not (c["candidate"] or c["master"])
        if nxt["program"] == "candidate" and fresh \
                and st.get("parentHash") and st["parentHash"] != w.master.hash:
            refused = _rebase(s)
            if refused is not None:
                return refused
            if st.get("parentHash") != w.master.hash:
                return s.decision()  # the rebase is under way (a materialise intent)
        backend = (w.spec.backend if w.spec and w.spec.backend else w.lab.backend)
        st["job"] = {"backend": backend, "name": nxt["name"], "slot": w.slot,
                     "program": nxt["program"], "seed": nxt["seed"]}
        if nxt["name"] == run_name(w.name, int(st.get("attempt") or 1)):
            st["run"] = nxt["name"]
            # What this run is judged against: the master's measurement, averaged over its
            # repeat runs where there are some (one lucky baseline does not set the bar).
            st["parentValBpb"] = w.reference if w.reference is not None else w.master.val_bpb
        what = "" if nxt["program"] == "candidate" and not nxt["seed"] else \
            f" ({nxt['program']}, seed {nxt['seed']})"
        s.condition(Condition.SCHEDULED, True, Reason.SUBMITTED,
                    f"Run {nxt['name']}{what} submitted to {backend} on slot {w.slot}.")
        s.events.append(Event("Normal", Reason.SUBMITTED, f"Run {nxt['name']}{what} on {backend}, "
                                                          f"slot {w.slot}."))
        s.intents.append(Intent("submit", {"run": nxt["name"], "slot": w.slot,
                                           "backend": backend, "program": nxt["program"],
                                           "seed": nxt["seed"]}))
        return s.decision()
    run = w.run
    if run is None or run.state == "missing":
        # Submitted but not visible (a crash before the backend saw it, or a lagging cache):
        # submitting again adopts the run if it exists, creates it if it does not.
        s.intents.append(Intent("submit", {"run": job["name"], "slot": job.get("slot"),
                                           "backend": job["backend"],
                                           "program": job.get("program", "candidate"),
                                           "seed": job.get("seed", 0)}))
        return s.decision()
    if run.job_id:
        job["id"] = run.job_id
    if run.state == "queued":
        # Submitted and waiting: the status says for what (a Pod to be scheduled, a queue's
        # admission), not the "free slot" it waited for before it was submitted.
        if st["phase"] != CONFIRMING:
            s.phase(QUEUED, run.reason or Reason.RUN_QUEUED,
                    run.message or "The run waits for its GPU.")
        return s.decision()
    if run.state == "running":
        if st["phase"] not in (RUNNING, CONFIRMING):
            st["startedAt"] = w.now
            s.phase(RUNNING, Reason.RUN_STARTED, f"Run {job['name']} is training.")
            s.condition(Condition.RUNNING, True, Reason.RUN_STARTED,
                        f"Run {job['name']} is training.")
        return s.decision()
    return _reconcile_finished(s, run)


def _rebase(s: _Step) -> Decision | None:
    """Rebase a queued candidate onto the master that moved since its checks.

    Returns a terminal decision when the rebase refuses it (Conflict, Duplicate); None when
    the status now holds the rebased candidate, or a materialise intent was asked for.
    """
    w, st = s.w, s.st
    c = w.candidate
    if c is None or (not c.refusal and c.parent_hash != w.master.hash):
        s.intents.append(Intent("materialise"))
        return None
    if c.refusal:
        s.phase(c.refusal, c.reason, f"Rebased onto master {w.master.hash[:12]} before its "
                                     f"start: {c.message}", warning=True)
        s.condition(Condition.CHECKED, False, c.reason, c.message)
        return _settle_terminal(s)
    old = st.get("parentHash") or ""
    duplicate = _take_candidate(s, c, c.rebased_from or old,
                                f"Rebased onto master {w.master.hash[:12]} before its start, ")
    if duplicate is not None:
        return duplicate
    msg = (f"The master moved from {old[:12]} to {w.master.hash[:12]} while it waited: the "
           "candidate was rebased onto it cleanly before its start.")
    s.condition(Condition.CHECKED, True, Reason.REBASED, msg)
    s.events.append(Event("Normal", Reason.REBASED, msg))
    return None


def _reconcile_finished(s: _Step, run: RunObservation) -> Decision:
    w, st = s.w, s.st
    if run.worker:
        st.setdefault("job", {})["worker"] = run.worker
    s.condition(Condition.RUNNING, False, Reason.RUN_FINISHED, f"Run ended: {run.state}.")
    if run.state == "cancelled":
        s.phase(CANCELLED, Reason.RUN_CANCELLED, run.message or "The run was cancelled.", True)
        return _settle_terminal(s)
    if st.get("confirm"):
        return _confirm_run_finished(s, run)
    if run.state in ("failed", "error", "lost"):
        reason = {"failed": Reason.CANDIDATE_FAILED, "error": Reason.INFRASTRUCTURE_ERROR,
                  "lost": Reason.RUN_LOST}[run.state]
        code = (run.result or {}).get("reason_code")
        if code in HARNESS_REASONS.get(run.state, ()):
            reason = code  # the harness's own verdict, e.g. BudgetExceeded
        detail = (run.result or {}).get("reason") or run.message or "no reason given"
        s.phase(FAILED, reason, f"The run failed: {detail}", warning=True)
        return _settle_terminal(s)
    metrics = dict((run.result or {}).get("metrics") or {})
    val = metrics.get(w.lab.metric)
    if not _finite(val):
        s.phase(FAILED, Reason.NO_METRIC, f"The run finished without a finite {w.lab.metric}.",
                True)
        return _settle_terminal(s)
    st["metrics"] = {k: metrics[k] for k in SUMMARY_KEYS if k in metrics}
    st[figures.STATUS_FIELD] = figures.of_result(run.result, st["metrics"])
    evaluated = ((run.result or {}).get("timing") or {}).get("evaluate_seconds")
    if _finite(evaluated):  # a promoted candidate's bounds the next ones' (core.evaluation)
        st["metrics"]["evaluate_seconds"] = evaluated
    # Judged against the master it was built on (measured when it started), not a later one.
    base = st.get("parentValBpb")
    if base is None:
        base = w.master.val_bpb
    if w.promotion is not None:
        base = w.promotion.master_val_bpb
    if base is not None:
        st["delta"] = round(val - base, 6)
        st["masterValBpb"] = base
    need = _margin(w)
    need = 0.0 if need is None else need
    moved = _moved(w, st)
    # A win that needs confirm runs is not promoted on this one: one run that clears the
    # margin is still one run, picked for its luck (an agent can draw again and again with
    # variants that change nothing), and the master's val_bpb would inherit that luck.
    runs = confirm_runs(w.lab.min_delta, w.lab.confirm_runs,
                        None if base is None else base - val, need)
    won = runs == 0 and base is not None and (base - val) > need
    if w.promotion is None and w.master.experiment != w.name and (won or runs):
        if moved:
            return _follow_up(s, val, base)
        if won:
            s.condition(Condition.PROMOTED, False, Reason.PROMOTING,
                        "Comparing against the master under its lock.")
            s.intents.append(Intent("promote", {"run": st["job"]["name"], "val_bpb": val,
                                                "margin": need, "against": base}))
            return s.decision()
        return _start_confirm(s, val, base, runs)
    promoted = (w.promotion.promoted if w.promotion is not None
                else w.master.experiment == w.name)
    st["outcome"] = PROMOTED if promoted else REJECTED
    if promoted:
        msg = (f"{w.lab.metric} {val:.6f} beat the master's {base:.6f}; "
               "the candidate is the new master.")
        s.condition(Condition.PROMOTED, True, Reason.BEAT_MASTER, msg)
        s.phase(SUCCEEDED, PROMOTED, msg)
        return _settle_terminal(s)
    reason = Reason.DID_NOT_BEAT_MASTER
    msg = (f"{w.lab.metric} {val:.6f} did not beat the master's "
           f"{base if base is None else f'{base:.6f}'} by more than {need:g}.")
    if base is not None and within_noise(base - val, w.noise):
        reason = Reason.WITHIN_NOISE
        msg += (f" The difference {val - base:+.6f} is inside the lab's noise (sigma "
                f"{w.noise:.6f}): no measurable effect.")
    if w.promotion is not None and w.promotion.message:
        reason, msg = w.promotion.reason or reason, w.promotion.message
    s.condition(Condition.PROMOTED, False, reason, msg)
    s.phase(SUCCEEDED, Reason.MASTER_MOVED if reason == Reason.MASTER_MOVED else REJECTED, msg)
    if reason == Reason.WITHIN_NOISE:
        st["verdict"] = Reason.WITHIN_NOISE
    return _settle_terminal(s)


def _follow_up(s: _Step, val: float, base: float | None, done: int | None = None) -> Decision:
    """It won on the master it was built on, but the master moved: measure it again, rebased.

    `done`: confirm runs finished when the move was seen (they are left unused). A win that
    needed confirm runs goes straight to confirm runs on the new master (they compare fresh
    runs of both programs, so a new first run would add nothing to the verdict); a clear win
    gets a new first run, which may promote it alone again.
    """
    w, st = s.w, s.st
    attempt = int(st.get("attempt") or 1)
    parent = st.get("parentHash") or ""
    if attempt >= MAX_ATTEMPTS:
        msg = master_moved(val, parent, w.master.hash, w.master.experiment)
        st["outcome"] = REJECTED
        s.condition(Condition.PROMOTED, False, Reason.MASTER_MOVED, msg)
        s.phase(SUCCEEDED, Reason.MASTER_MOVED, msg + f" (after {attempt} attempts)")
        return _settle_terminal(s)
    job = st.get("job") or {}
    main = st.get("run") or job.get("name") or run_name(w.name, attempt)
    msg = (f"{w.lab.metric} {val:.6f} beat its own master {parent[:12]} ({base}), but the "
           f"master moved to {w.master.hash[:12]} ({w.master.experiment or 'seed'}) while it "
           f"ran{'' if done is None else f' ({done} confirm runs in)'}: a follow-up run "
           f"rebased onto the current master, {run_name(w.name, attempt + 1)}, decides.")
    row = ledger_row(w.name, w.spec, {**st, "phase": SUCCEEDED, "outcome": "",
                                      "reason": Reason.FOLLOW_UP, "message": msg})
    if not w.recorded:
        s.intents.append(Intent("record", {"row": row}))
    if job:
        s.intents.append(Intent("cleanup-run", {"run": job["name"], "backend": job["backend"]}))
    st.setdefault("attempts", []).append({"run": main, "parentHash": parent, "val_bpb": val})
    # Confirm runs under way start over on the new master; a win inside the margin that
    # needed them goes straight to them; a clear win gets a new first run.
    runs = (st.get("confirm") or {}).get("runs", 0)
    if not runs and base is not None and base - val <= (_margin(w) or 0.0):
        runs = confirm_runs(w.lab.min_delta, w.lab.confirm_runs, base - val, _margin(w) or 0.0)
    for k in ("job", "metrics", "delta", "masterValBpb", "parentValBpb", "confirm"):
        st.pop(k, None)
    st["attempt"] = attempt + 1
    st["run"] = run_name(w.name, attempt + 1)
    if runs:
        st["confirm"] = _fresh_confirm(w, runs)
    s.condition(Condition.CONFIRMING, True, Reason.FOLLOW_UP, msg)
    s.phase(CONFIRMING, Reason.FOLLOW_UP, msg)
    return s.decision()


def _start_confirm(s: _Step, val: float, base: float, n: int) -> Decision:
    w, st = s.w, s.st
    job = st["job"]
    need = _margin(w) or 0.0
    where = "inside" if base - val <= need else "beyond"
    msg = (f"{w.lab.metric} {val:.6f} beat the master's {base:.6f} by {base - val:.6f}, {where} "
           f"the margin {need:g}: one run is not a verdict, so {n} fresh runs each of the "
           "candidate and the master decide.")
    st["confirm"] = _fresh_confirm(w, n)
    st["job"] = None
    s.intents.append(Intent("cleanup-run", {"run": job["name"], "backend": job["backend"]}))
    s.condition(Condition.CONFIRMING, True, Reason.CONFIRM_RUNS, msg)
    s.phase(CONFIRMING, Reason.CONFIRM_RUNS, msg)
    return s.decision()


def _fresh_confirm(w: World, runs: int) -> dict:
    """The status of confirm runs about to start: `runs` of each program, none done yet, and
    their harness seeds, drawn now from the world's entropy and kept (see `next_run`)."""
    return {"runs": runs, "candidate": [], "master": [],
            "seeds": confirm_seeds(w.entropy, runs)}


def _confirm_run_finished(s: _Step, run: RunObservation) -> Decision:
    w, st = s.w, s.st
    c, job = st["confirm"], st["job"]
    program = job.get("program", "candidate")
    val = ((run.result or {}).get("metrics") or {}).get(w.lab.metric)
    ok = run.state == "succeeded" and _finite(val)
    row = confirm_row(w.name, w.spec, st, job, run, val if ok else None)
    s.intents.append(Intent("record", {"row": row}))
    s.intents.append(Intent("cleanup-run", {"run": job["name"], "backend": job["backend"]}))
    st["job"] = None
    if not ok:
        why = (run.result or {}).get("reason") or run.message or run.state
        msg = (f"confirm run {job['name']} ({program}) ended without a {w.lab.metric} ({why}): "
               "no verdict, so no promotion. Apply the change again under a new name to "
               "measure it again.")
        st["outcome"] = REJECTED
        s.condition(Condition.CONFIRMING, False, Reason.NOT_CONFIRMED, msg)
        s.condition(Condition.PROMOTED, False, Reason.NOT_CONFIRMED, msg)
        s.phase(SUCCEEDED, Reason.NOT_CONFIRMED, msg, warning=True)
        return _settle_terminal(s)
    c[program].append(val)
    done = len(c["candidate"]) + len(c["master"])
    if done < 2 * c["runs"]:
        s.phase(CONFIRMING, Reason.CONFIRM_RUNS,
                f"Confirm runs: {done} of {2 * c['runs']} done.")
        return s.decision()
    v = confirm(c["candidate"], c["master"], w.noise, w.noise_df,
                confirm_alpha(w.confirm_tries))
    c["verdict"] = {"promote": v.promote, "difference": round(v.difference, 6),
                    "standardError": round(v.standard_error, 6),
                    "critical": round(v.critical, 4), "alpha": round(v.alpha, 6),
                    "tries": w.confirm_tries, "explain": v.explain()}
    return _decide_confirmed(s)


def _decide_confirmed(s: _Step) -> Decision:
    w, st = s.w, s.st
    c = st["confirm"]
    v = c["verdict"]
    val = round(mean(c["candidate"]), 6)
    st["delta"] = round(-v["difference"], 6)
    if not st.get("metrics"):  # an attempt that went straight to confirm runs: their mean
        st["metrics"] = {w.lab.metric: val}
        st["masterValBpb"] = round(mean(c["master"]), 6)
    wins = v["promote"] and (w.lab.min_delta == "auto"
                             or v["difference"] > float(w.lab.min_delta))
    if w.promotion is None and wins and w.master.experiment != w.name:
        if _moved(w, st):
            return _follow_up(s, val, mean(c["master"]))
        s.condition(Condition.PROMOTED, False, Reason.PROMOTING,
                    "Comparing against the master under its lock.")
        s.intents.append(Intent("promote", {"run": st.get("run"), "val_bpb": val,
                                            "margin": float("-inf")}))
        return s.decision()
    promoted = (w.promotion.promoted if w.promotion is not None
                else w.master.experiment == w.name)
    st["outcome"] = PROMOTED if promoted else REJECTED
    s.condition(Condition.CONFIRMING, False, Reason.CONFIRMED if wins
                else Reason.WITHIN_NOISE, v["explain"])
    if promoted:
        msg = (f"{v['explain']}. The candidate is the new master at its confirm runs' mean "
               f"{val:.6f}.")
        s.condition(Condition.PROMOTED, True, Reason.CONFIRMED, msg)
        s.phase(SUCCEEDED, PROMOTED, msg)
        st["verdict"] = Reason.CONFIRMED
        return _settle_terminal(s)
    reason, msg = Reason.WITHIN_NOISE, f"{v['explain']}: no measurable effect."
    if v["promote"] and not wins:
        reason = Reason.DID_NOT_BEAT_MASTER
        msg = (f"{v['explain']}, but by less than promotion.minDelta {w.lab.min_delta}: "
               "a real difference, too small to promote.")
    if w.promotion is not None and w.promotion.message:
        reason, msg = w.promotion.reason or Reason.DID_NOT_BEAT_MASTER, w.promotion.message
    s.condition(Condition.PROMOTED, False, reason, msg)
    s.phase(SUCCEEDED, reason if reason == Reason.MASTER_MOVED else REJECTED, msg)
    if reason == Reason.WITHIN_NOISE:
        st["verdict"] = Reason.WITHIN_NOISE
    return _settle_terminal(s)


def _reconcile_deleting(s: _Step) -> Decision:
    w, st = s.w, s.st
    if st["phase"] in TERMINAL:
        return _settle_terminal(s, deleting=True)
    job = st.get("job")
    if job and w.run is not None and w.run.state in ("queued", "running"):
        s.intents.append(Intent("cancel", {"run": job["name"], "backend": job["backend"]}))
        return s.decision()
    if job and w.run is not None and w.run.state in ("succeeded", "failed", "error", "lost"):
        # It finished before the cancel landed: the result is real, record it.
        dec = _reconcile_finished(s, w.run)
        if st["phase"] not in TERMINAL:
            return dec
        return _settle_terminal(s, deleting=True)
    s.phase(CANCELLED, Reason.DELETED, "The experiment was deleted before it finished.", True)
    return _settle_terminal(s, deleting=True)


def _settle_terminal(s: _Step, deleting: bool = False) -> Decision:
    w = s.w
    if not w.recorded:
        s.intents.append(Intent("record", {"row": ledger_row(w.name, w.spec, s.st)}))
    if w.worktree:
        s.intents.append(Intent("cleanup"))
    done = w.recorded and not w.worktree
    return s.decision(finalized=done and deleting)


# --- the ledger row ---------------------------------------------------------------------------

def ledger_row(name: str, spec: ExperimentSpec | None, st: dict) -> dict:
    """The ledger row of a terminal experiment (created_at and worker_id come from the shell)."""
    metrics = st.get("metrics") or {}
    job = st.get("job") or {}
    phase = st.get("phase", "")
    status = phase.lower()
    if phase == FAILED and st.get("reason") in NOT_MEASURED:
        status = "error"  # not a measurement of the candidate: it may run again

    def num(key: str) -> str:
        v = metrics.get(key)
        return "" if v is None else str(v)

    row = {
        "run_id": st.get("run") or job.get("name") or run_name(name),
        "status": status,
        "job_id": job.get("id", ""),
        "campaign": spec.campaign if spec else "",
        "experiment_id": name,
        "worker_id": job.get("worker", ""),
        "hypothesis": spec.hypothesis if spec else "",
        "parent_hash": st.get("parentHash") or (spec.parent if spec else ""),
        "candidate_hash": st.get("candidateHash", ""),
        "val_bpb": num("val_bpb"),
        "training_seconds": num("training_seconds"),
        "total_seconds": num("total_seconds"),
        "peak_vram_mb": num("peak_vram_mb"),
        "mfu_percent": num("mfu_percent"),
        "promoted": "1" if st.get("outcome") == PROMOTED else "0",
        "comment": st.get("message", ""),
        "semantic_hash": st.get("semanticHash", ""),
        "outcome": st.get("outcome", ""),
        "delta": "" if st.get("delta") is None else str(st["delta"]),
        "rebased_from": st.get("rebasedFrom", ""),
        "duplicate_of": st.get("duplicateOf", ""),
        "backend": job.get("backend", ""),
        "reason": st.get("verdict") or st.get("reason", ""),
    }
    row[figures.COLUMN] = _own_columns(figures.of_status(st), row)
    return row


def confirm_row(name: str, spec: ExperimentSpec | None, st: dict, job: dict,
                run: RunObservation, val: float | None) -> dict:
    """The ledger row of one confirm run (status `confirm`; `error` or `failed` if it failed).

    A master's confirm run carries the master's hash: it is a measurement of that program.
    """
    program = job.get("program", "candidate")
    metrics = (run.result or {}).get("metrics") or {}
    status = "confirm" if val is not None else ("error" if run.state in ("error", "lost")
                                                 else "failed")
    row = {"run_id": job["name"], "status": status, "job_id": run.job_id or job.get("id", ""),
           "campaign": spec.campaign if spec else "", "experiment_id": name,
           "worker_id": run.worker or job.get("worker", ""),
           "hypothesis": f"Confirm run of {name}: the {program}, seed {job.get('seed')}.",
           "parent_hash": st.get("parentHash", ""),
           "candidate_hash": st.get("candidateHash", "") if program == "candidate"
           else st.get("parentHash", ""),
           "semantic_hash": st.get("semanticHash", "") if program == "candidate" else "",
           "val_bpb": "" if val is None else str(val), "promoted": "0",
           "comment": "" if val is not None else ((run.result or {}).get("reason")
                                                   or run.message),
           "outcome": "", "backend": job.get("backend", ""),
           "reason": "" if val is not None else ((run.result or {}).get("reason_code") or ""),
           "rebased_from": "", "duplicate_of": "", "delta": ""}
    for k in ("training_seconds", "total_seconds", "peak_vram_mb", "mfu_percent"):
        row[k] = "" if metrics.get(k) is None else str(metrics[k])
    row[figures.COLUMN] = _own_columns(set(figures.of_result(run.result, metrics)), row)
    return row


FIGURE_COLUMNS = ("val_bpb", "training_seconds", "total_seconds", "peak_vram_mb", "mfu_percent")


def _own_columns(own: set[str], row: dict) -> str:
    """The ledger's self_reported cell: the row's filled figure columns that are the candidate's."""
    return figures.column(k for k in FIGURE_COLUMNS if k in own and row.get(k, "") != "")


# --- the baseline of a master that has no metric yet ------------------------------------------

BASELINE_ATTEMPTS = 3  # tries at measuring one master, per controller start


def baseline_run_name(lab: str, master: Master, attempt: int = 1) -> str:
    """`baseline-<lab>-<master hash>-<attempt>`: unique per lab (two Labs share a namespace)
    and per attempt (each attempt has its own ledger row); at most 63 characters."""
    return f"baseline-{lab[:36]}-{master.hash[:10]}-{attempt}"


def master_run_row(master: Master, run: RunObservation) -> tuple[dict, float | None]:
    """The ledger row of a finished run of the master itself (a baseline, a noise run) and
    its val_bpb (None: the run failed; the row says `error`)."""
    val = ((run.result or {}).get("metrics") or {}).get("val_bpb")
    ok = run.state == "succeeded" and _finite(val)
    row = {"run_id": run.name, "status": "baseline" if ok else "error", "job_id": run.job_id,
           "campaign": "", "experiment_id": "baseline", "worker_id": run.worker,
           "hypothesis": "Measure the master as it stands.", "parent_hash": master.hash,
           "candidate_hash": master.hash, "semantic_hash": master.semantic_hash,
           "comment": "" if ok else ((run.result or {}).get("reason") or run.message),
           "reason": "" if ok else ((run.result or {}).get("reason_code") or "BaselineFailed")}
    metrics = (run.result or {}).get("metrics") or {}
    for k in FIGURE_COLUMNS:  # the ledger's metric columns; None (not measured): empty
        if k in metrics:
            row[k] = "" if metrics[k] is None else str(metrics[k])
    row[figures.COLUMN] = _own_columns(set(figures.of_result(run.result, metrics)), row)
    return row, (val if ok else None)


def noise_run_name(lab: str, master: Master, seed: int) -> str:
    """`noise-<lab>-<master hash>-s<seed>`: a repeat run of the master that measures the noise."""
    return f"noise-{lab[:36]}-{master.hash[:10]}-s{seed}"


def reconcile_baseline(master: Master, run: RunObservation | None, slot: str | None,
                       recorded: bool) -> list[Intent]:
    """Intents that measure a master nobody has measured: run it, record it, set its metric.

    `run` is the backend's view of this attempt's run (named by `baseline_run_name`), `slot`
    the slot it may take if it has to be submitted. A failed attempt asks to be tried again
    (`resubmit-baseline`); how often is the engine's policy (BASELINE_ATTEMPTS).
    """
    if master.val_bpb is not None or run is None:
        return []
    name = run.name
    if run.state == "missing":
        return [Intent("submit", {"run": name, "slot": slot})] if slot is not None else []
    if run.state in ("queued", "running"):
        return []
    row, val = master_run_row(master, run)
    ok = val is not None
    out = [] if recorded else [Intent("record", {"row": row})]
    if ok:
        out.append(Intent("set-master-metric", {"val_bpb": val, "run": name}))
    else:
        out.append(Intent("resubmit-baseline", {"run": name, "reason": row["comment"]}))
    return out
