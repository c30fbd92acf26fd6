"""Every phase transition of `reconcile()`, as a table of worlds and the decision expected."""

from __future__ import annotations

import dataclasses

import pytest

from controller.core.intents import SetPlace
from controller.core.reconcile import (Candidate, Master, PromotionResult, RunObservation, World,
                                       beats, next_run, reconcile, reconcile_baseline)
from controller.core.spec import ExperimentSpec, LabSpec

NOW = "2026-11-29T10:00:00Z"
LAB = LabSpec(profile="tiny", min_delta=0.0)  # one run decides; margins: test_min_delta_margin
MASTER = Master(hash="a" * 40, semantic_hash="b" * 40, commit="c" * 40, val_bpb=1.0)
UNMEASURED = Master(hash="a" * 40, semantic_hash="b" * 40, commit="c" * 40, val_bpb=None)
SPEC = ExperimentSpec(hypothesis="Shorter warmdown", parent="aaaa", diff="--- a/train.py")
GOOD = Candidate(candidate_hash="d" * 40, semantic_hash="e" * 40, parent_hash="a" * 40,
                 commit="f" * 40)
JOB = {"backend": "local", "name": "exp-e-1", "slot": "0"}


def ok(val):
    return RunObservation("exp-e-1", "succeeded", result={"status": "succeeded",
                                                          "metrics": {"val_bpb": val}})


def st(phase, **kw):
    return {"phase": phase, "conditions": [], **kw}


# (id, world overrides, expected phase, expected outcome, expected intent kinds)
TABLE = [
    ("new spec asks for the checks", {}, "Pending", None, ["materialise"]),
    ("bad spec is Invalid and recorded", dict(spec=None, spec_error="f.yaml: spec.diff: must not be empty"),
     "Invalid", None, ["record"]),
    ("refused diff is Invalid", dict(status=st("Pending"), candidate=Candidate(
        refusal="Invalid", reason="DiffTouchesOtherFile", message="diff touches prepare.py")),
     "Invalid", None, ["record"]),
    ("rebase conflict is Conflict", dict(status=st("Pending"), candidate=Candidate(
        refusal="Conflict", reason="RebaseConflict", message="conflict")),
     "Conflict", None, ["record"]),
    ("repeat is Duplicate, no run", dict(status=st("Pending"), candidate=GOOD, duplicate_of="e0",
                                         slot="0"), "Duplicate", None, ["record"]),
    ("checked candidate with a slot is submitted", dict(status=st("Pending"), candidate=GOOD,
                                                        slot="0"), "Queued", None, ["submit"]),
    ("checked candidate without a slot asks for one", dict(status=st("Pending"), candidate=GOOD),
     "Queued", None, ["acquire-slot"]),
    ("nothing runs before the master's baseline", dict(status=st("Queued"), slot="0",
                                                       master=UNMEASURED), "Queued", None, []),
    ("submitted run that vanished is submitted again (adopt)", dict(status=st("Queued", job=JOB),
                                                                    run=RunObservation("exp-e-1", "missing")),
     "Queued", None, ["submit"]),
    ("a spec file broken after the checks does not stop its run",
     dict(status=st("Running", job=JOB), spec_error="f.yaml: malformed YAML",
          run=RunObservation("exp-e-1", "running")), "Running", None, []),
    ("queued backend run stays Queued", dict(status=st("Queued", job=JOB),
                                             run=RunObservation("exp-e-1", "queued")), "Queued", None, []),
    ("started run is Running", dict(status=st("Queued", job=JOB),
                                    run=RunObservation("exp-e-1", "running")), "Running", None, []),
    ("better result asks to promote", dict(status=st("Running", job=JOB), run=ok(0.9)),
     "Running", None, ["promote"]),
    ("promotion done: Succeeded Promoted", dict(status=st("Running", job=JOB), run=ok(0.9),
                                                promotion=PromotionResult(True, 1.0)),
     "Succeeded", "Promoted", ["record"]),
    ("lost the CAS: Succeeded Rejected", dict(status=st("Running", job=JOB), run=ok(0.9),
                                              promotion=PromotionResult(False, 0.8, "moved")),
     "Succeeded", "Rejected", ["record"]),
    ("worse result: Succeeded Rejected", dict(status=st("Running", job=JOB), run=ok(1.1)),
     "Succeeded", "Rejected", ["record"]),
    ("equal result is not an improvement", dict(status=st("Running", job=JOB), run=ok(1.0)),
     "Succeeded", "Rejected", ["record"]),
    ("candidate failure: Failed", dict(status=st("Running", job=JOB), run=RunObservation(
        "exp-e-1", "failed", result={"status": "failed", "reason": "loss is NaN"})),
     "Failed", None, ["record"]),
    ("infrastructure error: run again", dict(status=st("Running", job=JOB), run=RunObservation(
        "exp-e-1", "error", result={"status": "error", "reason": "no data"})),
     "Queued", None, ["record", "cleanup-run"]),
    ("lost run: run again", dict(status=st("Running", job=JOB), run=RunObservation("exp-e-1", "lost")),
     "Queued", None, ["record", "cleanup-run"]),
    ("succeeded without a metric: Failed", dict(status=st("Running", job=JOB), run=RunObservation(
        "exp-e-1", "succeeded", result={"metrics": {"val_bpb": float("nan")}})),
     "Failed", None, ["record"]),
    ("deleted while queued: Cancelled", dict(status=st("Queued"), deleting=True),
     "Cancelled", None, ["record"]),
    ("deleted while running: cancel the run", dict(status=st("Running", job=JOB), deleting=True,
                                                   run=RunObservation("exp-e-1", "running")),
     "Running", None, ["cancel"]),
    ("run cancelled: Cancelled", dict(status=st("Running", job=JOB), deleting=True,
                                      run=RunObservation("exp-e-1", "cancelled")),
     "Cancelled", None, ["record"]),
    ("terminal and recorded: cleanup only", dict(status=st("Succeeded", outcome="Rejected", job=JOB),
                                                 recorded=True, worktree=True),
     "Succeeded", "Rejected", ["cleanup"]),
    ("terminal, recorded, clean: nothing", dict(status=st("Failed", job=JOB), recorded=True),
     "Failed", None, []),
]


@pytest.mark.parametrize("case", TABLE, ids=[c[0] for c in TABLE])
def test_phase_transitions(case):
    _, overrides, phase, outcome, kinds = case
    world = dict(name="e", spec=SPEC, lab=LAB, master=MASTER, now=NOW)
    world.update(overrides)
    d = reconcile(World(**world))
    assert d.status["phase"] == phase
    assert d.status.get("outcome") == outcome
    assert d.kinds() == kinds


def test_reconcile_is_pure_and_idempotent():
    w = World(name="e", spec=SPEC, lab=LAB, master=MASTER, now=NOW, status=st("Running", job=JOB),
              run=ok(0.9), promotion=PromotionResult(True, 1.0))
    a, b = reconcile(w), reconcile(w)
    assert a.status == b.status and a.intents == b.intents
    again = reconcile(World(name="e", spec=SPEC, lab=LAB, master=MASTER, now=NOW, status=a.status,
                            recorded=True))
    assert again.intents == [] and again.events == []


def test_status_carries_hashes_rebase_and_delta():
    d = reconcile(World(name="e", spec=SPEC, lab=LAB, master=MASTER, now=NOW, status=st("Pending"),
                        candidate=Candidate(candidate_hash="d" * 40, semantic_hash="e" * 40,
                                            parent_hash="a" * 40, rebased_from="9" * 40,
                                            commit="f" * 40)))
    assert d.status["candidateHash"] == "d" * 40 and d.status["rebasedFrom"] == "9" * 40
    assert "rebased cleanly" in d.status["conditions"][0]["message"]
    d = reconcile(World(name="e", spec=SPEC, lab=LAB, master=MASTER, now=NOW,
                        status=st("Running", job=JOB), run=ok(1.25)))
    assert d.status["delta"] == pytest.approx(0.25)
    assert d.status["metrics"]["val_bpb"] == 1.25


def test_duplicate_message_names_the_original():
    d = reconcile(World(name="e", spec=SPEC, lab=LAB, master=MASTER, now=NOW, status=st("Pending"),
                        candidate=GOOD, duplicate_of="warmdown-075"))
    assert d.status["duplicateOf"] == "warmdown-075"
    assert "same program as warmdown-075" in d.status["message"]
    row = d.intents[0].row
    assert row["status"] == "duplicate" and row["duplicate_of"] == "warmdown-075"


def test_min_delta_margin():
    lab = LabSpec(min_delta=0.01)
    assert not beats(0.995, 1.0, 0.01) and beats(0.98, 1.0, 0.01)
    d = reconcile(World(name="e", spec=SPEC, lab=lab, master=MASTER, now=NOW,
                        status=st("Running", job=JOB), run=ok(0.995)))
    assert d.status["outcome"] == "Rejected"
    assert "not above promotion.minDelta 0.01" in d.status["message"]


def test_spec_edit_after_checks_is_ignored_not_rerun():
    d = reconcile(World(name="e", spec=SPEC, lab=LAB, master=MASTER, now=NOW, generation=2,
                        status=st("Running", job=JOB, specGeneration=1),
                        run=RunObservation("exp-e-1", "running")))
    cond = {c["type"]: c for c in d.status["conditions"]}
    assert cond["SpecChangeIgnored"]["status"] == "True"
    assert d.kinds() == []


def test_baseline_runs_once_then_sets_the_master_metric():
    missing = RunObservation("b", "missing")
    assert [i.kind for i in reconcile_baseline(UNMEASURED, missing, "0", False)] == ["submit"]
    assert reconcile_baseline(UNMEASURED, missing, None, False) == []
    assert reconcile_baseline(UNMEASURED, RunObservation("b", "running"), "0", False) == []
    done = reconcile_baseline(UNMEASURED, RunObservation("b", "succeeded", result={
        "metrics": {"val_bpb": 1.5}}), "0", False)
    assert [i.kind for i in done] == ["record", "set-master-metric"]
    assert reconcile_baseline(MASTER, missing, "0", False) == []
    failed = reconcile_baseline(UNMEASURED, RunObservation("b", "failed", result={
        "reason_code": "CandidateCrashed", "reason": "boom"}), "0", False)
    assert [i.kind for i in failed] == ["record", "resubmit-baseline"]
    assert failed[0].row["status"] == "error"


def test_baseline_runs_are_named_per_lab_and_attempt():
    from controller.core.reconcile import baseline_run_name
    a, b = baseline_run_name("lab-a", UNMEASURED), baseline_run_name("lab-b", UNMEASURED)
    assert a != b and baseline_run_name("lab-a", UNMEASURED, 2) != a
    assert len(baseline_run_name("x" * 63, UNMEASURED, 3)) <= 63


@pytest.mark.parametrize("state, result, phase, row_status", [
    ("failed", {"status": "failed", "reason_code": "CandidateCrashed"}, "Failed", "failed"),
    ("failed", {"status": "failed", "reason_code": "BudgetExceeded"}, "Failed", "failed"),
    ("lost", None, "Queued", "lost"),
    ("error", {"status": "error", "reason_code": "DataUnavailable"}, "Failed", "error"),
    ("error", {"status": "error", "reason_code": "HarnessError"}, "Queued", "lost"),
    ("error", None, "Queued", "lost"),
])
def test_only_what_the_candidate_did_counts_as_measured(state, result, phase, row_status):
    """A run the candidate failed is a measurement; a lost run or a broken harness is not: its
    row says "lost", which the duplicate check does not count, and its place is run again."""
    d = reconcile(World(name="e", spec=SPEC, lab=LAB, master=MASTER, now=NOW,
                        status=st("Running", job=JOB),
                        run=RunObservation("exp-e-1", state, result=result)))
    assert d.status["phase"] == phase
    (record,) = [i for i in d.intents if i.kind == "record"]
    assert record.row["status"] == row_status


MOVED = Master(hash="9" * 40, semantic_hash="8" * 40, commit="7" * 40, val_bpb=0.95,
               experiment="first")


def test_a_winner_built_on_an_older_master_gets_a_rebased_follow_up_not_a_promotion():
    """Two experiments built on the same master; the first was promoted while the second ran.
    The second beat its own master (1.0) but lacks the first's change: promoting it would erase
    a win. It is not promoted; its run is recorded, and a follow-up, attempt 2, is queued."""
    d = reconcile(World(name="e", spec=SPEC, lab=LAB, master=MOVED, now=NOW,
                        status=st("Running", job=JOB, parentHash="a" * 40, parentValBpb=1.0),
                        run=RunObservation("exp-e-1", "succeeded",
                                           result={"metrics": {"val_bpb": 0.97}})))
    assert "promote" not in d.kinds()
    assert (d.status["phase"], d.status["reason"], d.status["attempt"]) == \
        ("Confirming", "FollowUp", 2)
    assert not d.status.get("job") and d.status["run"] == "exp-e-2"
    (record,) = [i for i in d.intents if i.kind == "record"]
    assert (record.row["run_id"], record.row["status"],
            record.row["promoted"]) == ("exp-e-1", "succeeded", "0")
    assert ("cleanup-run", "exp-e-1") in [(i.kind, getattr(i, "run", None)) for i in d.intents]


def test_a_loser_on_an_older_master_is_judged_against_its_own_parent():
    """Worse than the master it was built on (1.02 against 1.0): rejected, with its delta
    against that parent, and no follow-up run is spent."""
    d = reconcile(World(name="e", spec=SPEC, lab=LAB, master=MOVED, now=NOW,
                        status=st("Running", job=JOB, parentHash="a" * 40, parentValBpb=1.0),
                        run=RunObservation("exp-e-1", "succeeded",
                                           result={"metrics": {"val_bpb": 1.02}})))
    assert (d.status["phase"], d.status["outcome"], d.status["delta"]) == \
        ("Succeeded", "Rejected", 0.02)


def test_the_follow_up_gives_up_after_the_last_attempt():
    from controller.core.noise import MAX_ATTEMPTS
    last = f"exp-e-{MAX_ATTEMPTS}"
    d = reconcile(World(name="e", spec=SPEC, lab=LAB, master=MOVED, now=NOW,
                        status=st("Confirming", job=dict(JOB, name=last), attempt=MAX_ATTEMPTS,
                                  run=last, parentHash="a" * 40, parentValBpb=1.0),
                        run=RunObservation(last, "succeeded",
                                           result={"metrics": {"val_bpb": 0.90}})))
    assert "promote" not in d.kinds()
    assert (d.status["phase"], d.status["reason"], d.status["outcome"]) == \
        ("Succeeded", "MasterMoved", "Rejected")
    assert "9999999999" in d.status["message"] and "again" in d.status["message"]


def test_a_queued_experiment_is_rebased_onto_the_current_master_before_it_starts():
    from controller.core.reconcile import Candidate
    queued = st("Queued", parentHash="a" * 40, candidateHash="1" * 40, queuedAt=NOW)
    w = World(name="e", spec=SPEC, lab=LAB, master=MOVED, now=NOW, status=queued, slot="0")
    d = reconcile(w)
    assert d.kinds() == ["materialise"]  # no submit before the rebase
    rebased = Candidate(candidate_hash="2" * 40, semantic_hash="3" * 40, parent_hash="9" * 40,
                        rebased_from="a" * 40, commit="4" * 40)
    d = reconcile(dataclasses.replace(w, candidate=rebased))
    assert d.kinds() == ["submit"]
    assert (d.status["parentHash"], d.status["candidateHash"], d.status["rebasedFrom"]) == \
        ("9" * 40, "2" * 40, "a" * 40)
    assert d.status["parentValBpb"] == 0.95  # judged against the master it now runs on
    conflict = Candidate(refusal="Conflict", reason="RebaseConflict", message="conflicts")
    d = reconcile(dataclasses.replace(w, candidate=conflict))
    assert (d.status["phase"], d.status["reason"]) == ("Conflict", "RebaseConflict")
    assert "submit" not in d.kinds()
    d = reconcile(dataclasses.replace(w, candidate=rebased, duplicate_of="master (first)"))
    assert d.status["phase"] == "Duplicate" and "submit" not in d.kinds()


def test_the_compare_and_swap_refuses_a_candidate_whose_parent_is_not_the_master():
    from controller.core.reconcile import promotion_refused
    current = {"hash": "9" * 40, "val_bpb": 0.95, "experiment": "first"}
    refused = promotion_refused(current, "e", 0.90, 0.0, None, parent="a" * 40)
    assert refused is not None and not refused.promoted and refused.reason == "MasterMoved"
    assert promotion_refused(current, "e", 0.90, 0.0, None, parent="9" * 40) is None
    # built on this very master and judged against its reference value (the mean of its
    # repeat runs): the swap stands even where one stored run of the master was luckier...
    assert promotion_refused(current, "e", 0.96, 0.0, None, parent="9" * 40,
                             against=0.97) is None
    # ...but not against the stored value alone, nor without a parent
    assert promotion_refused(current, "e", 0.96, 0.0, None, parent="9" * 40).reason == \
        "DidNotBeatMaster"
    assert promotion_refused(current, "e", 0.96, 0.0, None, parent="",
                             against=0.97).reason == "DidNotBeatMaster"


# Student's t, one-sided 97.5 % and 99.5 % quantiles, as statistics tables print them.
T_TABLE = {(1, 0.025): 12.706, (2, 0.025): 4.303, (5, 0.025): 2.571, (10, 0.025): 2.228,
           (30, 0.025): 2.042, (120, 0.025): 1.980, (5, 0.005): 4.032, (10, 0.005): 3.169,
           (30, 0.005): 2.750}
AUTO = dataclasses.replace(LAB, min_delta="auto")  # the default: pairs, judged one at a time
PLACED = dataclasses.replace(MASTER, places={1: 1.0, 2: 1.01})


def finished(run, val):
    return RunObservation(run, "succeeded", result={"metrics": {"val_bpb": val}})


def drive(w, values, steps=30):
    """Reconcile `w` until it stops submitting: each submitted run ends with values[run]."""
    submitted, d = [], reconcile(w)
    for _ in range(steps):
        subs = [i for i in d.intents if i.kind == "submit"]
        if not subs:
            return d, submitted
        (sub,) = subs
        submitted.append((sub.run, sub.program, sub.place))
        d = reconcile(dataclasses.replace(w, status=d.status,
                                          run=finished(sub.run, values[sub.run])))
        if d.status["phase"] in ("Succeeded", "Failed") or "promote" in d.kinds():
            return d, submitted
        d = reconcile(dataclasses.replace(w, status=d.status, run=None, slot="0"))
    raise AssertionError("did not settle")


def test_the_students_t_quantiles_match_the_printed_tables():
    from controller.core.noise import t_crit
    for (df, alpha), printed in T_TABLE.items():
        assert abs(t_crit(df, alpha) - printed) < 0.0006, (df, alpha)  # tables round
    assert t_crit(10) > t_crit(11) > t_crit(12) and t_crit(10, 0.001) > t_crit(10)


def test_pairs_go_place_by_place_and_reuse_the_masters_values():
    """A candidate 0.01 better on every seed. Place 1 and 2: the master has values (its
    baseline, an earlier candidate's master run), so only the candidate runs. Place 3: the
    candidate first, then the master, whose value is kept on the master for later candidates.
    Three pairs with no spread: promoted at their mean, with its values as the new master's.
    Which of the two runs at place 3 goes first is a coin of the decision's (its entropy)."""
    orders = set()
    for entropy in range(12):
        w = World(name="e", spec=SPEC, lab=AUTO, master=PLACED, now=NOW, slot="0",
                  entropy=entropy, status=st("Queued", parentHash="a" * 40, queuedAt=NOW,
                                             candidateHash="d" * 40))
        values = {"exp-e-1": 0.99, "exp-e-1-p2": 1.0, "exp-e-1-p3": 0.995, "exp-e-1-m3": 1.005}
        d, submitted = drive(w, values)
        assert submitted[:2] == [("exp-e-1", "candidate", 1), ("exp-e-1-p2", "candidate", 2)]
        assert sorted(submitted[2:]) == [("exp-e-1-m3", "master", 3),
                                         ("exp-e-1-p3", "candidate", 3)]
        orders.add(submitted[2][1])
        assert (3 in d.status["pairs"]["masterFirst"]) == (submitted[2][1] == "master")
    assert orders == {"candidate", "master"}
    (promote,) = [i for i in d.intents if i.kind == "promote"]
    assert promote.places == {"1": 0.99, "2": 1.0, "3": 0.995}
    assert promote.val_bpb == round((0.99 + 1.0 + 0.995) / 3, 6)
    assert d.status["pairs"]["master"] == [1.0, 1.01, 1.005]
    assert d.status["pairs"]["verdict"]["decision"] == "promote"
    # the master's run at place 3 was kept for the next candidate (`set-place`), during the pass
    # that read it; its row and the candidate's pair rows were recorded as they finished


def test_the_masters_run_at_a_place_is_kept_on_the_master():
    status = st("Confirming", parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1", tries=1,
                pairs={"candidate": [0.99, 1.0, 0.995], "master": [1.0, 1.01]},
                job=dict(JOB, name="exp-e-1-m3", program="master", place=3))
    d = reconcile(World(name="e", spec=SPEC, lab=AUTO, master=PLACED, now=NOW, status=status,
                        run=finished("exp-e-1-m3", 1.005)))
    (keep,) = [i for i in d.intents if i.kind == "set-place"]
    assert keep == SetPlace(master="a" * 40, place=3, val_bpb=1.005)
    rows = [i.row for i in d.intents if i.kind == "record"]
    assert [(r["run_id"], r["candidate_hash"]) for r in rows][0] == ("exp-e-1-m3", "a" * 40)
    # measured meanwhile by another candidate: taken, no run spent
    status["job"] = None
    placed = dataclasses.replace(PLACED, places={1: 1.0, 2: 1.01, 3: 1.004})
    d = reconcile(World(name="e", spec=SPEC, lab=AUTO, master=placed, now=NOW, status=status,
                        slot="0"))
    assert "submit" not in d.kinds() and d.status["pairs"]["master"][-1] == 1.004


def test_a_clear_loser_stops_after_one_run():
    w = World(name="e", spec=SPEC, lab=AUTO, master=PLACED, now=NOW, slot="0",
              status=st("Queued", parentHash="a" * 40, queuedAt=NOW, candidateHash="d" * 40))
    d, submitted = drive(w, {"exp-e-1": 1.05})
    assert submitted == [("exp-e-1", "candidate", 1)]
    # worse on its seed: a regression (research/do-not-repeat.md), not "no measurable effect"
    assert (d.status["phase"], d.status["outcome"], d.status.get("verdict")) == \
        ("Succeeded", "Rejected", None)
    assert {c["type"]: c["reason"] for c in d.status["conditions"]}["Promoted"] == \
        "DidNotBeatMaster"
    assert d.status["delta"] == 0.05 and "no better than the master" in d.status["message"]


def test_a_no_op_is_rejected_on_its_own_pairs_spread():
    """A variant that changes nothing (another SEED): its gains straddle zero."""
    w = World(name="e", spec=SPEC, lab=AUTO, master=PLACED, now=NOW, slot="0",
              status=st("Queued", parentHash="a" * 40, queuedAt=NOW, candidateHash="d" * 40))
    d, submitted = drive(w, {"exp-e-1": 0.98, "exp-e-1-p2": 1.02})
    assert len(submitted) == 2 and d.status["outcome"] == "Rejected"
    assert d.status["pairs"]["verdict"]["decision"] == "reject"
    assert d.status["verdict"] == "WithinNoise"  # its interval holds zero: no measurable effect


def test_each_test_against_one_master_is_made_at_a_lower_level():
    from controller.core.noise import test_alpha
    assert [round(test_alpha(k), 6) for k in (1, 2, 3)] == [0.015, round(0.03 / 6, 6),
                                                           round(0.03 / 12, 6)]
    w = World(name="e", spec=SPEC, lab=AUTO, master=PLACED, now=NOW, slot="0", tries=3,
              status=st("Queued", parentHash="a" * 40, queuedAt=NOW, candidateHash="d" * 40))
    d = reconcile(w)
    assert d.status["tries"] == 3  # fixed when its first run is submitted
    d, _ = drive(w, {"exp-e-1": 1.05})
    assert d.status["pairs"]["verdict"]["alpha"] == round(0.03 / 12, 6)


def test_the_sequential_test_waits_for_a_spread_and_stops_losers_early():
    from controller.core.noise import decide
    # the MATRIX_LR = 0.022 pairs at 45 s on an H100: a real gain, shown on the 4th
    gains = [0.0059, 0.0065, 0.0081]
    assert decide(gains[:1]).decision == "continue"
    assert decide(gains[:2]).decision == "continue"  # no look before three pairs
    step = decide(gains)
    assert step.decision == "continue" and 10.3 < step.t < 10.5
    assert decide(gains + [0.0068]).decision == "promote"
    assert decide([-0.001]).decision == "reject"                  # worse on the first seed
    assert decide([0.004, -0.0035]).decision == "reject"          # within one standard error
    assert decide([0.01] * 10, cap=10).decision == "promote"
    assert decide([0.01, 0.009, 0.011, 0.01], min_delta=0.02).decision == "reject"


def test_a_promotion_refused_because_another_landed_first_is_followed_up():
    """Two winners on one master decided together: the compare-and-swap lets the first in and
    refuses the second (MasterMoved). The second is not Rejected: it is rebased onto the new
    master and measured there, attempt 2."""
    status = st("Confirming", parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1", tries=1,
                metrics={"val_bpb": 0.975}, job=JOB,
                pairs={"candidate": [0.975], "master": [1.0], "verdict": {
                    "decision": "promote", "explain": "1 pair", "why": "a real gain"}})
    refused = PromotionResult(False, 0.98, "moved to first", "MasterMoved")
    d = reconcile(World(name="e", spec=SPEC, lab=LAB, master=MOVED, now=NOW, status=status,
                        promotion=refused))
    assert (d.status["phase"], d.status["reason"], d.status["attempt"]) == \
        ("Confirming", "FollowUp", 2)
    assert d.status.get("outcome") is None and "pairs" not in d.status
    assert "measured again there" in d.status["message"]
    (row,) = [i.row for i in d.intents if i.kind == "record"]
    assert (row["run_id"], row["reason"], row["promoted"]) == ("exp-e-1", "FollowUp", "0")


def test_pairs_stop_when_the_master_moves_between_them():
    status = st("Confirming", parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1", tries=1,
                metrics={"val_bpb": 0.98},
                pairs={"candidate": [0.98], "master": [1.0]})
    d = reconcile(World(name="e", spec=SPEC, lab=AUTO, master=MOVED, now=NOW, status=status,
                        slot="0"))
    assert "submit" not in d.kinds(), "no pair is spent on a decision that cannot promote"
    assert (d.status["reason"], d.status["attempt"]) == ("FollowUp", 2)
    # one whose pairs already reject it ends so
    status["pairs"] = {"candidate": [0.98, 1.02], "master": [1.0, 1.0]}
    d = reconcile(World(name="e", spec=SPEC, lab=AUTO, master=MOVED, now=NOW, status=status,
                        slot="0"))
    assert (d.status["phase"], d.status["outcome"]) == ("Succeeded", "Rejected")


def test_a_masters_pair_run_that_fails_is_run_again_at_its_place():
    """The master's run failing says nothing of the candidate: the pairs stay, the place is
    run again under a name of its own, and the failed try has one row, `lost`."""
    status = st("Confirming", parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1", tries=1,
                pairs={"candidate": [0.99, 1.0, 0.995], "master": [1.0, 1.01]},
                job=dict(JOB, name="exp-e-1-m3", program="master", place=3))
    d = reconcile(World(name="e", spec=SPEC, lab=AUTO, master=PLACED, now=NOW, status=status,
                        run=RunObservation("exp-e-1-m3", "failed", result={
                            "status": "failed", "reason_code": "CandidateCrashed"})))
    assert (d.status["phase"], d.status["reason"]) == ("Confirming", "RunRetried")
    assert d.status["pairs"]["candidate"] == [0.99, 1.0, 0.995]
    rows = [i.row for i in d.intents if i.kind == "record"]
    assert [(r["run_id"], r["status"]) for r in rows] == [("exp-e-1-m3", "lost")]
    assert [e.reason for e in d.events] == ["RunRetried"]
    # the next pass submits the master again at place 3, as a retry of its own name
    d = reconcile(World(name="e", spec=SPEC, lab=AUTO, master=PLACED, now=NOW,
                        status=d.status, slot="0"))
    (submit,) = [i for i in d.intents if i.kind == "submit"]
    assert (submit.run, submit.program, submit.place) == \
        ("exp-e-1-m3-t2", "master", 3)


def test_a_run_lost_more_often_than_the_bound_ends_the_experiment_not_held_against_it():
    """Each loss of one place is a try, recorded once as lost; the fourth ends the experiment
    Failed (RunsLost), recorded as not measured (error), saying its pairs can be continued."""
    status = st("Confirming", parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1", tries=1,
                pairs={"candidate": [0.99, 0.98], "master": [1.0, 1.01]})
    runs = []
    for k in range(1, 5):
        d = reconcile(World(name="e", spec=SPEC, lab=AUTO, master=PLACED, now=NOW,
                            status=status, slot="0"))
        (submit,) = [i for i in d.intents if i.kind == "submit"]
        runs.append(submit.run)
        d = reconcile(World(name="e", spec=SPEC, lab=AUTO, master=PLACED, now=NOW,
                            status=d.status, run=RunObservation(submit.run, "lost")))
        status = d.status
        if k < 4:
            assert status["phase"] == "Confirming"
    assert runs == ["exp-e-1-p3", "exp-e-1-p3-t2", "exp-e-1-p3-t3", "exp-e-1-p3-t4"]
    assert (status["phase"], status["reason"]) == ("Failed", "RunsLost")
    assert "continues from its 2 pairs" in status["message"]
    rows = [i.row for i in d.intents if i.kind == "record"]
    assert [(r["run_id"], r["status"]) for r in rows] == [("exp-e-1-p3-t4", "lost"),
                                                         ("exp-e-1", "error")]
    assert [x["run"] for x in status["lostRuns"]] == runs


def test_a_status_from_before_pairs_is_measured_again_in_pairs():
    old = st("Confirming", parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1",
             metrics={"val_bpb": 0.97},
             confirm={"runs": 2, "candidate": [0.97], "master": [1.0], "seeds": [5, 6]})
    d = reconcile(World(name="e", spec=SPEC, lab=AUTO, master=PLACED, now=NOW, status=old))
    assert (d.status["reason"], d.status["attempt"]) == ("FollowUp", 2)
    assert "confirm" not in d.status
    assert next_run("e", d.status) == {"name": "exp-e-2", "program": "candidate", "place": 1}


def test_a_master_measured_before_places_keeps_its_value_at_place_1_once_others_are_measured():
    """A master whose val_bpb came from one run before places stands for place 1; a master run
    at place 2 (kept by `set-place`) must not take that away, or every decision against it
    waits for a baseline that never comes."""
    old = Master(hash="a" * 40, semantic_hash="b" * 40, commit="c" * 40, val_bpb=1.0,
                 places={2: 1.01})
    assert (old.place(1), old.place(2), old.place(3)) == (1.0, 1.01, None)
    status = st("Confirming", parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1", tries=1,
                pairs={"candidate": [0.9, 0.91], "master": [1.0, 1.01]})
    d = reconcile(World(name="e", spec=SPEC, lab=AUTO, master=old, now=NOW, status=status,
                        slot="0"))
    assert [i.kind for i in d.intents] == ["submit"], d.status.get("conditions")
