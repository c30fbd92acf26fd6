"""The lifecycle of an experiment, as one pure function.

What it reads is `controller.core.world` (the World and its parts), what it returns is
`controller.core.intents` (the Decision: a status, events and typed intents), and the ledger
rows its states write are `controller.core.rows`; this module is the state machine between.

`reconcile(world) -> Decision` reads what a front end observed about one
experiment (its spec, its last status, the master, the checks on its
candidate, its run) and returns the status it should have now plus the
intents that move the world one step towards the spec. It does no I/O, reads
no clock (the time is part of the world) and draws no random numbers of its
own (a run's harness seed is the engine's, from the lab's secret and the run's
place; the order of a pair's runs comes from the world's `entropy`), so the
kopf operator and the local loop share it, and tables of worlds test it.

    Pending -> Invalid | Duplicate | Conflict
    Pending -> Queued -> Running -> Succeeded (outcome Promoted | Rejected) | Failed
    Running -> Confirming -> Succeeded   (more pairs before the verdict)
    any non-terminal phase -> Cancelled (the spec was deleted)

The master moves only by real, cumulative improvements:

- A queued experiment is rebased onto the current master right before its run
  starts (a conflict ends it Conflict, an empty result Duplicate).
- A decision is made on pairs (`controller.core.noise`): the candidate's run at
  place i against the master's value at place i (the same secret harness seed),
  judged after each pair: promote, reject, or one more pair. The master's value
  at a place is measured once (a run `exp-<name>-<attempt>-m<i>`, before or
  after the candidate's run at that place, by a secret coin) and kept on the
  master for every later candidate; a promoted candidate's runs become the new
  master's values.
- A candidate whose master moved while it was measured (seen before its
  verdict, or by the compare-and-swap of its promotion) is rebased onto the new
  master and measured again there from its first pair (a follow-up, attempt 2,
  then 3), unless its pairs so far already reject it. Only pairs against the
  current master can promote.

Every intent is idempotent and every one that must happen at a terminal phase
(recording the ledger row, removing the worktree) is issued again until the
world shows it done. So a front end may write the status first and carry out
the intents after: a crash in between is healed by the next pass. Runs have
deterministic names (`exp-<name>-<attempt>`), so submitting twice adopts the
run that exists instead of starting a second one.
"""

from __future__ import annotations

import copy
import random

from controller.core import figures
from controller.core.rows import (FIGURE_COLUMNS, carried_values, ledger_row,  # noqa: F401
                                  master_run_row, pair_row)
from controller.core.world import (Candidate, Master, PromotionResult, RunObservation,  # noqa: F401
                                   World, finite, run_name)
from controller.core.intents import (AcquireSlot, Cancel, ClaimTest, Cleanup, CleanupRun,
                                     Decision, Event, Intent, Materialise, Promote, Record,
                                     ResubmitBaseline, SetMasterMetric, SetPlace, Submit)
from controller.core.noise import (MAX_ATTEMPTS, Step, decide, hard_cap, mean, one_pair,
                                   test_alpha)
# ACTIVE and TERMINAL are re-exported: the front ends and the CLI read them from here.
from controller.core.status import (ACTIVE, CANCELLED, CONFIRMING, DUPLICATE, FAILED,  # noqa: F401
                                    HARNESS_REASONS, INVALID, PENDING, PROMOTED, QUEUED, REJECTED,
                                    RUNNING, SUCCEEDED, TERMINAL, UNDECIDED,
                                    Condition, Reason)

# How often one run (a program at a place) is submitted again after it was lost for a reason
# outside the candidate: its process, Pod or Job gone, the machine or node lost or preempted, the
# controller restarted elsewhere, the evaluator lost. Three: preemptions come in bursts, and a
# fourth loss in a row says the machine, not the weather, is at fault (RunsLost).
LOST_RETRIES = 3
# Faults of the machine that another try on it would meet again: no sandbox that works, no data,
# the lab's harness files changed during the run. They end the experiment at once, not measured
# (the same change may be applied again once the machine is fixed), as before retries.
NOT_RETRIED = ("SandboxUnavailable", "DataUnavailable", "HarnessTampered")

SUMMARY_KEYS = figures.SUMMARY_KEYS  # what of a result's metrics a status keeps


# What the front end observed (the World and its parts): controller/core/world.py. What
# reconcile asks for (the intents), the Decision and its Events: controller/core/intents.py.
# The ledger rows its states write: controller/core/rows.py. All re-exported from here.

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
        s.intents.append(Materialise())
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


def next_run(name: str, st: dict, master: Master | None = None) -> dict:
    """The run an active experiment submits next: its name, program and place.

    A decision goes place by place. At place 1 the candidate's run is `exp-<name>-<attempt>`
    (its first run; the master has a value at place 1 already: its baseline, or the runs that
    promoted it). At place i > 1 the candidate's run is `exp-<name>-<attempt>-p<i>`; where
    `master` has no value at place i yet, the master's run `exp-<name>-<attempt>-m<i>` (the
    parent's program) is made too, and kept on the master for every later candidate.

    What a run leaves on the machine (a hot GPU, a page cache emptied of the shards) falls on
    the run after it. So at such places the two runs take turns going first (ABBA: c2 m2, m3
    c3, c4 m4, ...): as many master runs as candidate runs follow one of the candidate's, and a
    candidate that leaves the machine slow after every run slows both programs alike. Which
    side begins is a coin drawn for the decision when its pairs begin (`pairs.masterFirst`,
    from the world's entropy), after the candidate was written, kept only in the status. A
    candidate that learns its place (an agent can read a run's seed from its log, and the
    places' seeds are the lab's, the same for every candidate) and slows the machine only
    after some places still has to guess that coin (tests/adversarial/README.md).

    The place's harness seed is the engine's (`controller.core.noise.place_seed`, from the
    lab's secret): the status holds only the place. A run lost at its place (`status.lostRuns`)
    is run again there as `<run>-t2`, `-t3`, ... (`base`: the name it stands in for).
    """
    nxt = _next_base(name, st, master)
    tries = sum(1 for lost in st.get("lostRuns") or [] if lost.get("base") == nxt["name"])
    if tries:  # run again after a loss: a name of its own, so the lost try's record stays
        nxt = {**nxt, "base": nxt["name"], "name": f"{nxt['name']}-t{tries + 1}"}
    return nxt


def _next_base(name: str, st: dict, master: Master | None) -> dict:
    main = run_name(name, int(st.get("attempt") or 1))
    p = st.get("pairs")
    if not p:
        return {"name": main, "program": "candidate", "place": 1}
    n, k = len(p["candidate"]), len(p["master"])
    if k < n:  # the candidate went first at place n
        return {"name": f"{main}-m{n}", "program": "master", "place": n}
    if k > n:  # the master went first at place k
        return {"name": f"{main}-p{k}", "program": "candidate", "place": k}
    q = n + 1
    if master is not None and master.place(q) is None and q in (p.get("masterFirst") or []):
        return {"name": f"{main}-m{q}", "program": "master", "place": q}
    return {"name": f"{main}-p{q}", "program": "candidate", "place": q}


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
    if "confirm" in st:  # confirm runs of a controller before pairs: measure it again, in pairs
        return _follow_up(s, "its confirm runs were started by an earlier controller")
    p = st.get("pairs")
    if p and p.get("verdict"):
        return _decide(s)
    job = st.get("job")
    if not job and p and _moved(w, st) and w.promotion is None:
        return _master_moved(s)
    if not job:
        if w.master.place(1) is None:
            s.condition(Condition.SCHEDULED, False, Reason.WAITING_FOR_BASELINE,
                        "The master has no measured val_bpb yet; its baseline run comes first.")
            return s.decision()
        if not p and w.carried and st.get("parentHash") == w.master.hash:
            return _continue(s)
        nxt = next_run(w.name, st, w.master if w.master.hash == st.get("parentHash") else None)
        if nxt["program"] == "master" and w.master.hash == st.get("parentHash") \
                and w.master.place(nxt["place"]) is not None:
            # Another candidate measured the master at this place meanwhile: take its value.
            p["master"].append(w.master.place(nxt["place"]))
            return _judge(s)
        if w.slot is None:
            s.condition(Condition.SCHEDULED, False, Reason.WAITING_FOR_SLOT,
                        "Waiting for a slot; decisions past their first pair go one experiment "
                        "at a time." if p else "All slots are busy.")
            # The front end's slot book answers: a slot (pass it in `World.slot`) or not yet.
            # Its place in the queue is the book's (core/slots.py: priority, then creation).
            # A decision a promotion voided (attempt 2 on) goes on in the decisions' turn, as
            # its pairs did: it had its first look, and new ideas are not made to wait behind it.
            s.intents.append(AcquireSlot(
                priority=w.spec.priority if w.spec else 0,
                confirm=bool(p) or int(st.get("attempt") or 1) > 1))
            return s.decision()
        if nxt["place"] == 1 and st.get("parentHash") and st["parentHash"] != w.master.hash:
            refused = _rebase(s)
            if refused is not None:
                return refused
            if st.get("parentHash") != w.master.hash:
                return s.decision()  # the rebase is under way (a materialise intent)
        backend = (w.spec.backend if w.spec and w.spec.backend else w.lab.backend)
        st["job"] = {"backend": backend, "name": nxt["name"], "slot": w.slot,
                     "program": nxt["program"], "place": nxt["place"]}
        if "base" in nxt:
            st["job"]["base"] = nxt["base"]
        claim = False
        if nxt["place"] == 1 and not p:
            st["run"] = nxt["name"]
            # What this run is judged against: the master's value at place 1, and which test
            # against that master this decision is (its level).
            st["parentValBpb"] = w.master.place(1)
            claim = _begin_test(w, st)
        what = "" if nxt["place"] == 1 else f" ({nxt['program']}, place {nxt['place']})"
        s.condition(Condition.SCHEDULED, True, Reason.SUBMITTED,
                    f"Run {nxt['name']}{what} submitted to {backend} on slot {w.slot}.")
        s.events.append(Event("Normal", Reason.SUBMITTED, f"Run {nxt['name']}{what} on {backend}, "
                                                          f"slot {w.slot}."))
        s.intents.append(Submit(run=nxt["name"], slot=w.slot, backend=backend,
                                  program=nxt["program"], place=nxt["place"], claim=claim))
        return s.decision()
    run = w.run
    if run is not None and run.state == "missing" and job.get("id"):
        # Seen running once (it has an id), now gone: its process, Pod or Job vanished (a node
        # lost, a Job deleted, a lab moved to another machine). Lost: its place runs again.
        return _reconcile_finished(s, RunObservation(
            run.name, "lost", message=f"run {job['name']} ({job.get('id')}) is gone from its "
                                      f"backend ({job.get('backend')})"))
    if run is None or run.state == "missing":
        # Submitted but not visible (a crash before the backend saw it, or a lagging cache):
        # submitting again adopts the run if it exists, creates it if it does not.
        s.intents.append(Submit(run=job["name"], slot=job.get("slot"), backend=job["backend"],
                                  program=job.get("program", "candidate"),
                                  place=job.get("place", 1)))
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
        s.intents.append(Materialise())
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
    if st.get("pairs"):
        return _pair_run_finished(s, run)
    if _retried(run):  # not the candidate's doing: its place is run again
        return _lost(s, run)
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
    if not finite(val):
        s.phase(FAILED, Reason.NO_METRIC, f"The run finished without a finite {w.lab.metric}.",
                True)
        return _settle_terminal(s)
    st["metrics"] = {k: metrics[k] for k in SUMMARY_KEYS if k in metrics}
    st[figures.STATUS_FIELD] = figures.of_result(run.result, st["metrics"])
    evaluated = ((run.result or {}).get("timing") or {}).get("evaluate_seconds")
    if finite(evaluated):  # a promoted candidate's bounds the next ones' (core.evaluation)
        st["metrics"]["evaluate_seconds"] = evaluated
    # Paired with the master it was built on, at place 1 (its value when the run started).
    base = st.get("parentValBpb")
    if base is None:
        base = w.master.place(1)
    # The order of the two runs at each later place the master has no value for yet: turn
    # about (ABBA), from a side drawn now (see `next_run`).
    phase = random.Random(w.entropy).random() < 0.5
    st["pairs"] = {"candidate": [val], "master": [] if base is None else [base],
                   "masterFirst": [q for q in range(2, hard_cap(w.lab.pairs_cap) + 1)
                                   if (q + phase) % 2 == 1]}
    return _judge(s)


def _pair_run_finished(s: _Step, run: RunObservation) -> Decision:
    """A run after the first ended: the candidate's at its place, or the master's."""
    w, st = s.w, s.st
    p, job = st["pairs"], st["job"]
    program = job.get("program", "candidate")
    val = ((run.result or {}).get("metrics") or {}).get(w.lab.metric)
    ok = run.state == "succeeded" and finite(val)
    if not ok and (_retried(run) or (program == "master" and run.state != "error")):
        # Not the candidate's doing: the master's run, or the machine. The place is run again;
        # the pairs so far stay.
        return _lost(s, run)
    if not ok and run.state == "error":  # a fault that running again cannot mend
        why = (run.result or {}).get("reason") or run.message or run.state
        code = (run.result or {}).get("reason_code") or Reason.INFRASTRUCTURE_ERROR
        s.intents.append(Record(pair_row(w.name, w.spec, st, job, run, None, status="error")))
        s.phase(FAILED, code, f"pair run {job['name']} ({program}, place {job.get('place')}) "
                              f"could not run: {why}. Nothing is held against the candidate: fix "
                              "the machine, then apply it again under a new name; it continues "
                              "from its pairs.", warning=True)
        return _settle_terminal(s)
    row = pair_row(w.name, w.spec, st, job, run, val if ok else None)
    s.intents.append(Record(row))
    if not ok:
        why = (run.result or {}).get("reason") or run.message or run.state
        msg = (f"pair run {job['name']} (the candidate, place {job.get('place')}) failed "
               f"({why}): no verdict, so no promotion.")
        st["outcome"] = REJECTED
        s.condition(Condition.CONFIRMING, False, Reason.NOT_CONFIRMED, msg)
        s.condition(Condition.PROMOTED, False, Reason.NOT_CONFIRMED, msg)
        s.phase(SUCCEEDED, Reason.NOT_CONFIRMED, msg, warning=True)
        return _settle_terminal(s)
    p[program].append(val)
    if program == "master":
        s.intents.append(SetPlace(master=st.get("parentHash", ""), place=job.get("place"),
                                     val_bpb=val))
    return _judge(s)


def _lost(s: _Step, run: RunObservation) -> Decision:
    """A run ended without the harness's verdict on the candidate, for a reason outside it (its
    process, Pod or Job gone; the machine, node, controller or evaluator lost; or the master's
    own run failed): record the try as lost, and run the same program at the same place again,
    keeping the pairs so far. After LOST_RETRIES such runs of one place, the experiment ends
    Failed (RunsLost): not held against the candidate, and applied again it continues from
    its pairs (`World.carried`)."""
    w, st = s.w, s.st
    job = st["job"]
    program, place = job.get("program", "candidate"), job.get("place", 1)
    base = job.get("base") or job["name"]
    why = (run.result or {}).get("reason") or run.message or run.state
    lost = st.setdefault("lostRuns", [])
    lost.append({"run": job["name"], "base": base, "program": program, "place": place,
                 "state": run.state, "reason": str(why)[:300], "at": w.now})
    tries = sum(1 for x in lost if x.get("base") == base)
    what = f"run {job['name']} ({program}, place {place})"
    final = tries > LOST_RETRIES
    if not (final and not st.get("pairs")):  # a first run's last try is the experiment's row
        s.intents.append(Record(pair_row(w.name, w.spec, st, job, run, None, status="lost")))
    if final:
        n = len((st.get("pairs") or {}).get("candidate") or [])
        msg = (f"{what} was lost {tries} times ({why}): no verdict, and nothing is held against "
               f"the candidate. Apply the same change again under a new name: it continues "
               f"from its {n} pair{'s' if n != 1 else ''}." if n else
               f"{what} was lost {tries} times ({why}): no verdict, and nothing is held against "
               "the candidate. Fix the machine (see the run's log), then apply the same change "
               "again under a new name.")
        s.phase(FAILED, Reason.RUNS_LOST, msg, warning=True)
        return _settle_terminal(s)
    msg = (f"{what} was lost ({why}); it runs again at the same place "
           f"(try {tries + 1} of {LOST_RETRIES + 1}); the pairs so far stay.")
    s.events.append(Event("Warning", Reason.RUN_RETRIED, msg))
    _next_run(s)
    if st.get("pairs"):
        s.condition(Condition.CONFIRMING, True, Reason.RUN_RETRIED, msg)
        s.phase(CONFIRMING, Reason.RUN_RETRIED, msg)
    else:
        s.phase(QUEUED, Reason.RUN_RETRIED, msg)
    return s.decision()


def _retried(run: RunObservation) -> bool:
    """Whether a run that ended without a verdict on the candidate is run again at its place:
    one lost, or one the machine failed for a reason another try may not meet (a harness fault,
    an evaluator lost, no authentic result); not a fault another try is sure to meet again
    (NOT_RETRIED), nor a verdict of the harness on the candidate (`failed`)."""
    code = (run.result or {}).get("reason_code")
    return run.state == "lost" or (run.state == "error" and code not in NOT_RETRIED)


def _begin_test(w: World, st: dict) -> bool:
    """This decision's test begins: keep its level (and its number against the master) on the
    status. True: the engine counts it (the `claim` of its submit)."""
    st["tries"] = w.tries
    if w.level is not None:
        st["level"] = w.level
    return True


def _level(st: dict) -> float:
    """The level of this decision's test: the one kept when it began; a status of an older
    controller has only its number against the master (`test_alpha`)."""
    level = st.get("level")
    if isinstance(level, (int, float)) and not isinstance(level, bool) and 0 < level < 1:
        return float(level)
    return test_alpha(int(st.get("tries") or 1))


def _continue(s: _Step) -> Decision:
    """Begin with the pairs an unfinished decision of this same candidate on this same master
    measured (Undecided, or ended by lost runs): its values at places 1..k against the master's,
    as a new test (its own level), which goes on from place k + 1."""
    w, st = s.w, s.st
    names, values = w.carried
    places = []
    for i in range(1, len(values) + 1):
        v, m = values.get(i), w.master.place(i)
        if v is None or m is None:
            break
        places.append((v, m))
    if not places:
        return s.decision()
    claim = _begin_test(w, st)
    st["run"] = run_name(w.name, int(st.get("attempt") or 1))
    st["parentValBpb"] = w.master.place(1)
    st["continues"] = list(names)
    st["metrics"] = {w.lab.metric: places[0][0]}
    phase = random.Random(w.entropy).random() < 0.5
    st["pairs"] = {"candidate": [v for v, _ in places], "master": [m for _, m in places],
                   "masterFirst": [q for q in range(len(places) + 1, hard_cap(w.lab.pairs_cap) + 1)
                                   if (q + phase) % 2 == 1]}
    msg = (f"Continues {', '.join(names)}: the same candidate on the same master, "
           f"{len(places)} pair{'s' if len(places) != 1 else ''} carried; a new test.")
    s.events.append(Event("Normal", Reason.CONTINUED, msg))
    s.condition(Condition.CHECKED, True, Reason.CONTINUED, msg)
    if claim:
        s.intents.append(ClaimTest())
    return _judge(s)


def _judge(s: _Step) -> Decision:
    """After a run: the next run of the pair, or the pairs' verdict."""
    w, st = s.w, s.st
    p = st["pairs"]
    n = len(p["candidate"])
    if len(p["master"]) > n:  # the master went first at this place: the candidate's run next
        return _one_more_run(s, f"Pair {len(p['master'])}: the master ran first; the "
                                "candidate's run comes next.")
    if len(p["master"]) < n:  # the master's value at this place comes next
        if w.master.hash != st.get("parentHash") or w.master.place(n) is None:
            return _one_more_run(s, f"Pair {n}: the candidate measured "
                                    f"{p['candidate'][-1]:.6f}; the master's run at this place "
                                    "comes next.")
        p["master"].append(w.master.place(n))
    gains = [m - c for m, c in zip(p["master"], p["candidate"])]
    step = one_pair(gains[0], w.lab.min_gain) if w.lab.one_pair_decides \
        else decide(gains, _level(st), w.lab.pairs_cap, w.lab.min_gain)
    st["delta"] = round(-step.gain, 6)
    st["masterValBpb"] = st.get("parentValBpb") if st.get("parentValBpb") is not None \
        else p["master"][0]
    p["estimate"] = _verdict(step, int(st.get("tries") or 1), w.lab.pairs_cap)
    if step.decision == "continue":
        return _one_more_run(s, f"{step.explain()}.")
    p["verdict"] = _verdict(step, int(st.get("tries") or 1), w.lab.pairs_cap)
    return _decide(s)


def _one_more_run(s: _Step, msg: str) -> Decision:
    """The decision needs another run: unless the master moved meanwhile (then its pairs can
    no longer promote it), the run that ended is done with, and the next may be submitted."""
    if _moved(s.w, s.st) and s.w.promotion is None:
        return _master_moved(s)
    _next_run(s)
    s.condition(Condition.CONFIRMING, True, Reason.PAIRS, msg)
    s.phase(CONFIRMING, Reason.PAIRS, msg)
    return s.decision()


def _next_run(s: _Step) -> None:
    """The run that ended is done with (its own row, if it was a pair run, is recorded): its
    backend objects go and the next run may be submitted."""
    job = s.st.get("job")
    if job:
        s.intents.append(CleanupRun(run=job["name"], backend=job["backend"]))
    s.st["job"] = None


def _verdict(step: Step, tries: int, cap: int) -> dict:
    def r(x: float) -> float | None:
        return round(x, 6) if finite(x) else None
    return {"decision": step.decision, "pairs": step.pairs, "gain": r(step.gain),
            "standardError": r(step.standard_error), "t": r(step.t),
            "critical": r(step.critical), "interval": [r(step.low), r(step.high)],
            "alpha": round(step.alpha, 8), "tries": tries, "cap": cap,
            "why": step.why, "explain": step.explain(),
            **({"morePairs": step.more_pairs} if step.decision == "undecided" else {})}


def _decide(s: _Step) -> Decision:
    """Carry out the pairs' verdict: promote (compare-and-swap), or end Rejected."""
    w, st = s.w, s.st
    p = st["pairs"]
    v = p["verdict"]
    val = round(mean(p["candidate"]), 6)
    if v["decision"] == "promote" and w.promotion is None and w.master.experiment != w.name:
        if _moved(w, st):
            return _follow_up(s, "its pairs showed a gain")
        s.condition(Condition.PROMOTED, False, Reason.PROMOTING,
                    "Comparing against the master under its lock.")
        s.intents.append(Promote(
            run=st.get("run"), val_bpb=val, margin=float("-inf"),
            places={str(i + 1): c for i, c in enumerate(p["candidate"])}))
        return s.decision()
    if w.promotion is not None and not w.promotion.promoted \
            and w.promotion.reason == Reason.MASTER_MOVED:
        # The compare-and-swap found another promotion landed first: as a master that moved
        # during the run, measure it again on the new master (issue: never lost to a race).
        return _follow_up(s, "its pairs showed a gain, and another promotion landed first")
    if v["decision"] == "undecided" and w.promotion is None:
        n = v.get("pairs") or 0
        msg = (f"{v['explain']}. Not a measured rejection: apply the same change again under a "
               f"new name and it continues from these {n} pairs.")
        st["outcome"] = UNDECIDED
        s.condition(Condition.CONFIRMING, False, Reason.UNDECIDED, v["explain"])
        s.condition(Condition.PROMOTED, False, Reason.UNDECIDED, msg)
        s.phase(SUCCEEDED, Reason.UNDECIDED, msg)
        st["verdict"] = Reason.UNDECIDED
        return _settle_terminal(s)
    promoted = (w.promotion.promoted if w.promotion is not None
                else w.master.experiment == w.name)
    st["outcome"] = PROMOTED if promoted else REJECTED
    if promoted:
        msg = (f"{v['explain']}. The candidate is the new master at its pairs' mean "
               f"{val:.6f}.")
        s.condition(Condition.CONFIRMING, False, Reason.CONFIRMED, v["explain"])
        s.condition(Condition.PROMOTED, True, Reason.CONFIRMED, msg)
        s.phase(SUCCEEDED, PROMOTED, msg)
        st["verdict"] = Reason.CONFIRMED
        return _settle_terminal(s)
    reason = Reason.WITHIN_NOISE if _no_effect(v) else Reason.DID_NOT_BEAT_MASTER
    msg = f"{v['explain']}."
    if w.promotion is not None and w.promotion.message:
        reason, msg = w.promotion.reason or Reason.DID_NOT_BEAT_MASTER, w.promotion.message
    s.condition(Condition.CONFIRMING, False, reason, v["explain"])
    s.condition(Condition.PROMOTED, False, reason, msg)
    s.phase(SUCCEEDED, REJECTED, msg)
    if reason == Reason.WITHIN_NOISE:  # the ledger's reason; a regression's stays "Rejected"
        st["verdict"] = reason
    return _settle_terminal(s)


def _no_effect(v: dict) -> bool:
    """Whether a rejection says "no measurable effect" (WithinNoise: not a regression, the lab's
    memory keeps it apart) rather than "worse" (DidNotBeatMaster): worse is a mean gain below
    zero that its 95 % interval keeps below zero, or, with one pair (no spread yet), worse on
    its first seed; a gain too small for minDelta is not "no effect" either."""
    if "minDelta" in (v.get("why") or ""):
        return False
    gain, high = v.get("gain"), (v.get("interval") or [None, None])[1]
    if gain is None or gain >= 0:
        return True
    return v.get("pairs", 1) > 1 and (high is None or high >= 0)


def _master_moved(s: _Step) -> Decision:
    """The master moved before the verdict: pairs against the old one cannot promote. A
    candidate its pairs already reject ends so; any other is measured again on the new one."""
    w, st = s.w, s.st
    p = st["pairs"]
    n = min(len(p["candidate"]), len(p["master"]))
    if n and not w.lab.one_pair_decides:
        gains = [m - c for m, c in zip(p["master"][:n], p["candidate"][:n])]
        step = decide(gains, _level(st), w.lab.pairs_cap, w.lab.min_gain)
        if step.decision == "reject":
            p["verdict"] = _verdict(step, int(st.get("tries") or 1), w.lab.pairs_cap)
            return _decide(s)
    elif n and p["master"][0] - p["candidate"][0] <= w.lab.min_gain:
        p["verdict"] = _verdict(one_pair(p["master"][0] - p["candidate"][0], w.lab.min_gain),
                                1, 1)
        return _decide(s)
    return _follow_up(s, f"{n} pair{'s' if n != 1 else ''} in, not decided")


def _follow_up(s: _Step, why: str) -> Decision:
    """It was measured on a master that is no longer the master: record what ran, rebase it
    onto the current master, and measure it again there from its first pair."""
    w, st = s.w, s.st
    attempt = int(st.get("attempt") or 1)
    parent = st.get("parentHash") or ""
    p = st.get("pairs") or {}
    val = (st.get("metrics") or {}).get(w.lab.metric)
    if attempt >= MAX_ATTEMPTS:
        msg = master_moved(val if val is not None else float("nan"), parent, w.master.hash,
                           w.master.experiment) + f" (after {attempt} attempts)"
        st["outcome"] = REJECTED
        s.condition(Condition.PROMOTED, False, Reason.MASTER_MOVED, msg)
        s.phase(SUCCEEDED, Reason.MASTER_MOVED, msg)
        return _settle_terminal(s)
    job = st.get("job") or {}
    main = st.get("run") or job.get("name") or run_name(w.name, attempt)
    msg = (f"Measured on master {parent[:12]}, but the master moved to {w.master.hash[:12]} "
           f"({w.master.experiment or 'seed'}) before its verdict ({why}): it is rebased onto "
           f"the current master and measured again there, {run_name(w.name, attempt + 1)} "
           "first.")
    if st.get("metrics"):  # its first run measured something: that run's own row
        row = ledger_row(w.name, w.spec, {**st, "phase": SUCCEEDED, "outcome": "",
                                          "reason": Reason.FOLLOW_UP, "message": msg})
        if not w.recorded:
            s.intents.append(Record(row))
    if job:
        s.intents.append(CleanupRun(run=job["name"], backend=job["backend"]))
    st.setdefault("attempts", []).append({"run": main, "parentHash": parent, "val_bpb": val,
                                          "pairs": len(p.get("candidate") or [])})
    for k in ("job", "metrics", figures.STATUS_FIELD, "delta", "masterValBpb", "parentValBpb",
              "pairs", "tries", "level", "confirm", "verdict", "lostRuns", "continues"):
        st.pop(k, None)
    st["attempt"] = attempt + 1
    st["run"] = run_name(w.name, attempt + 1)
    s.condition(Condition.CONFIRMING, True, Reason.FOLLOW_UP, msg)
    s.phase(CONFIRMING, Reason.FOLLOW_UP, msg)
    return s.decision()


def _reconcile_deleting(s: _Step) -> Decision:
    w, st = s.w, s.st
    if st["phase"] in TERMINAL:
        return _settle_terminal(s, deleting=True)
    job = st.get("job")
    if job and w.run is not None and w.run.state in ("queued", "running"):
        s.intents.append(Cancel(run=job["name"], backend=job["backend"]))
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
        s.intents.append(Record(ledger_row(w.name, w.spec, s.st)))
    if w.worktree:
        s.intents.append(Cleanup())
    done = w.recorded and not w.worktree
    return s.decision(finalized=done and deleting)


# --- the baseline of a master that has no metric yet ------------------------------------------

BASELINE_ATTEMPTS = 3  # tries at measuring one master, per controller start


def baseline_run_name(lab: str, master: Master, attempt: int = 1) -> str:
    """`baseline-<lab>-<master hash>-<attempt>`: unique per lab (two Labs share a namespace)
    and per attempt (each attempt has its own ledger row); at most 63 characters."""
    return f"baseline-{lab[:36]}-{master.hash[:10]}-{attempt}"


def noise_run_name(lab: str, master: Master, place: int, kind: str = "p") -> str:
    """`noise-<lab>-<master hash>-p<place>`: the master at a place (`autolab noise`); `-r<place>`:
    the same again (its repeat, the GPU's own noise)."""
    return f"noise-{lab[:36]}-{master.hash[:10]}-{kind}{place}"


def reconcile_baseline(master: Master, run: RunObservation | None, slot: str | None,
                       recorded: bool) -> list[Intent]:
    """Intents that measure a master nobody has measured: run it, record it, set its metric.

    `run` is the backend's view of this attempt's run (named by `baseline_run_name`), `slot`
    the slot it may take if it has to be submitted. A failed attempt asks to be tried again
    (`resubmit-baseline`); how often is the engine's policy (BASELINE_ATTEMPTS).
    """
    if master.place(1) is not None or run is None:
        return []
    name = run.name
    if run.state == "missing":
        return [Submit(run=name, slot=slot)] if slot is not None else []
    if run.state in ("queued", "running"):
        return []
    row, val = master_run_row(master, run)
    ok = val is not None
    out = [] if recorded else [Record(row)]
    if ok:
        out.append(SetMasterMetric(val_bpb=val, run=name))
    else:
        out.append(ResubmitBaseline(run=name, reason=row["comment"]))
    return out
