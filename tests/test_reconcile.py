"""Every phase transition of `reconcile()`, as a table of worlds and the decision expected."""

from __future__ import annotations

import dataclasses

import pytest

from controller.core.noise import CONFIRM_SEEDS, confirm_seeds
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
    ("infrastructure error: Failed", dict(status=st("Running", job=JOB), run=RunObservation(
        "exp-e-1", "error", result={"status": "error", "reason": "no data"})),
     "Failed", None, ["record"]),
    ("lost run: Failed", dict(status=st("Running", job=JOB), run=RunObservation("exp-e-1", "lost")),
     "Failed", None, ["record"]),
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
    row = d.intents[0].args["row"]
    assert row["status"] == "duplicate" and row["duplicate_of"] == "warmdown-075"


def test_min_delta_margin():
    lab = LabSpec(min_delta=0.01)
    assert not beats(0.995, 1.0, 0.01) and beats(0.98, 1.0, 0.01)
    d = reconcile(World(name="e", spec=SPEC, lab=lab, master=MASTER, now=NOW,
                        status=st("Running", job=JOB), run=ok(0.995)))
    assert d.status["outcome"] == "Rejected"
    assert "by more than 0.01" in d.status["message"]


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
    assert failed[0].args["row"]["status"] == "error"


def test_baseline_runs_are_named_per_lab_and_attempt():
    from controller.core.reconcile import baseline_run_name
    a, b = baseline_run_name("lab-a", UNMEASURED), baseline_run_name("lab-b", UNMEASURED)
    assert a != b and baseline_run_name("lab-a", UNMEASURED, 2) != a
    assert len(baseline_run_name("x" * 63, UNMEASURED, 3)) <= 63


def test_slots_go_by_priority_then_first_come():
    from controller.core.slots import allocate_slots

    queued = [("a", 0, "t1"), ("b", 5, "t3"), ("c", 0, "t0"), ("d", 0, "t2")]
    assert allocate_slots(queued, busy={"1"}, slots=["0", "1", "2"]) == {"b": "0", "c": "2"}
    assert allocate_slots(queued, busy={"0", "1"}, slots=["0", "1"]) == {}


@pytest.mark.parametrize("state, result, row_status", [
    ("failed", {"status": "failed", "reason_code": "CandidateCrashed"}, "failed"),
    ("failed", {"status": "failed", "reason_code": "BudgetExceeded"}, "failed"),
    ("lost", None, "error"),
    ("error", {"status": "error", "reason_code": "DataUnavailable"}, "error"),
    ("error", None, "error"),
])
def test_only_what_the_candidate_did_counts_as_measured(state, result, row_status):
    """A run the candidate failed is a measurement; a lost run or a broken harness is not: its
    row says "error", which the duplicate check does not count, so the candidate may run again."""
    d = reconcile(World(name="e", spec=SPEC, lab=LAB, master=MASTER, now=NOW,
                        status=st("Running", job=JOB),
                        run=RunObservation("exp-e-1", state, result=result)))
    assert d.status["phase"] == "Failed"
    (record,) = [i for i in d.intents if i.kind == "record"]
    assert record.args["row"]["status"] == row_status


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
    assert (record.args["row"]["run_id"], record.args["row"]["status"],
            record.args["row"]["promoted"]) == ("exp-e-1", "succeeded", "0")
    assert ("cleanup-run", "exp-e-1") in [(i.kind, i.args.get("run")) for i in d.intents]


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


def test_a_win_is_confirmed_by_fresh_runs_of_both_programs():
    lab = dataclasses.replace(LAB, min_delta=0.01, confirm_runs=2)
    w = World(name="e", spec=SPEC, lab=lab, master=MASTER, now=NOW, noise=0.01, entropy=7,
              status=st("Running", job=JOB, parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1"),
              run=RunObservation("exp-e-1", "succeeded", result={"metrics": {"val_bpb": 0.98}}))
    d = reconcile(w)
    assert (d.status["phase"], d.status["reason"]) == ("Confirming", "ConfirmRuns")
    assert "promote" not in d.kinds() and not d.status.get("job")
    # The confirm runs' seeds are drawn from the world's entropy once, when they start, and
    # kept in the status: the same world gives the same seeds, another draw others.
    seeds = d.status["confirm"]["seeds"]
    assert seeds == confirm_seeds(7, 2) == reconcile(w).status["confirm"]["seeds"]
    assert reconcile(dataclasses.replace(w, entropy=8)).status["confirm"]["seeds"] != seeds
    names = []
    status = d.status
    vals = {"c": 0.97, "m": 1.0}
    for _ in range(4):  # c1, m1, m2, c2
        d = reconcile(dataclasses.replace(w, status=status, run=None, slot="0"))
        (sub,) = [i for i in d.intents if i.kind == "submit"]
        names.append((sub.args["run"], sub.args["program"], sub.args["seed"]))
        run = RunObservation(sub.args["run"], "succeeded",
                             result={"metrics": {"val_bpb": vals[sub.args["run"][-2]]}})
        d = reconcile(dataclasses.replace(w, status=d.status, run=run))
        status = d.status
    # the i-th run of each program on the i-th seed: paired, and no seed says the place
    assert names == [("exp-e-1-c1", "candidate", seeds[0]), ("exp-e-1-m1", "master", seeds[0]),
                     ("exp-e-1-m2", "master", seeds[1]), ("exp-e-1-c2", "candidate", seeds[1])]
    assert seeds != [CONFIRM_SEEDS + 1, CONFIRM_SEEDS + 2]
    (promote,) = [i for i in d.intents if i.kind == "promote"]
    assert promote.args["val_bpb"] == 0.97  # the fresh runs' mean, not the lucky first run
    from controller.core.reconcile import PromotionResult
    d = reconcile(dataclasses.replace(w, status=status, run=None,
                                      promotion=PromotionResult(True, 1.0)))
    assert (d.status["phase"], d.status["outcome"], d.status["verdict"]) == \
        ("Succeeded", "Promoted", "Confirmed")
    (row,) = [i.args["row"] for i in d.intents if i.kind == "record"]
    assert row["run_id"] == "exp-e-1" and row["promoted"] == "1"


def test_confirm_seeds_are_drawn_distinct_and_do_not_tell_a_run_its_place():
    """A confirm run's seed reaches its candidate. Drawn from the world's entropy, the seeds
    are distinct, above every noise run's, repeatable from one draw, and at one place differ
    from draw to draw (odd and even alike: a seed no longer says whether the master runs
    next). A status from an older controller, which drew none, keeps CONFIRM_SEEDS + i."""
    for entropy in range(50):
        seeds = confirm_seeds(entropy, 20)
        assert len(set(seeds)) == 20
        assert all(CONFIRM_SEEDS < x <= CONFIRM_SEEDS + 2**31 for x in seeds)
    assert confirm_seeds(3, 5) == confirm_seeds(3, 5) != confirm_seeds(4, 5)
    assert {confirm_seeds(e, 5)[2] % 2 for e in range(20)} == {0, 1}
    older = st("Confirming", run="exp-e-1",
               confirm={"runs": 2, "candidate": [0.97], "master": [1.0]})
    assert next_run("e", older) == {"name": "exp-e-1-m2", "program": "master",
                                    "seed": CONFIRM_SEEDS + 2}
    older["confirm"]["seeds"] = [5_000_017, 6_000_011]
    assert next_run("e", older)["seed"] == 6_000_011


def test_a_confirmation_inside_the_noise_is_not_promoted():
    lab = dataclasses.replace(LAB, min_delta=0.05, confirm_runs=2)
    status = st("Confirming", parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1",
                confirm={"runs": 2, "candidate": [0.995, 1.0], "master": [1.0],
                         "seeds": [870216655, 41337090]},
                job=dict(JOB, name="exp-e-1-m2", program="master", seed=41337090))
    d = reconcile(World(name="e", spec=SPEC, lab=lab, master=MASTER, now=NOW, noise=0.01,
                        status=status, run=RunObservation("exp-e-1-m2", "succeeded",
                                                          result={"metrics": {"val_bpb": 1.0}})))
    assert "promote" not in d.kinds()
    assert (d.status["phase"], d.status["outcome"], d.status["verdict"]) == \
        ("Succeeded", "Rejected", "WithinNoise")


def test_minimum_delta_auto_waits_for_the_noise_then_uses_it():
    lab = dataclasses.replace(LAB, min_delta="auto")
    queued = st("Queued", parentHash="a" * 40, queuedAt=NOW)
    d = reconcile(World(name="e", spec=SPEC, lab=lab, master=MASTER, now=NOW, status=queued))
    assert d.intents == [] and any(c["reason"] == "WaitingForNoise" for c in d.status["conditions"])
    # sigma 0.01: the margin is 3.5 * 0.01 * sqrt(2) = 0.0495; a 0.02 win is not enough, and
    # is inside the noise (2 * 0.01 * sqrt(2) = 0.028)
    run = RunObservation("exp-e-1", "succeeded", result={"metrics": {"val_bpb": 0.98}})
    d = reconcile(World(name="e", spec=SPEC, lab=lab, master=MASTER, now=NOW, noise=0.01,
                        status=st("Running", job=JOB, parentHash="a" * 40, parentValBpb=1.0),
                        run=run))
    assert "promote" not in d.kinds() and d.status["reason"] == "Rejected"
    assert d.status["verdict"] == "WithinNoise"
    # 0.06 clears the margin: one lucky draw could, so fresh runs of both decide (two each,
    # the lab asked for none); a lab that asks for none (`confirmRuns: 0`) promotes on it
    run = RunObservation("exp-e-1", "succeeded", result={"metrics": {"val_bpb": 0.94}})
    w = World(name="e", spec=SPEC, lab=lab, master=MASTER, now=NOW, noise=0.01,
              status=st("Running", job=JOB, parentHash="a" * 40, parentValBpb=1.0), run=run)
    d = reconcile(w)
    assert "promote" not in d.kinds()
    assert (d.status["phase"], d.status["reason"]) == ("Confirming", "ConfirmRuns")
    assert d.status["confirm"]["runs"] == 2 and "beyond the margin 0.0494975" in d.status["message"]
    d = reconcile(dataclasses.replace(w, lab=dataclasses.replace(lab, confirm_runs=0)))
    assert "promote" in d.kinds()


def test_a_lucky_no_op_under_the_default_margin_is_confirmed_away():
    """Noise mining: variants that change nothing, applied until one draw clears the margin.
    The draw that picked the win is not part of the verdict, so it buys nothing."""
    lab = dataclasses.replace(LAB, min_delta="auto", confirm_runs=None)
    w = World(name="e", spec=SPEC, lab=lab, master=MASTER, now=NOW, noise=0.01, noise_df=2,
              status=st("Running", job=JOB, parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1"),
              run=RunObservation("exp-e-1", "succeeded", result={"metrics": {"val_bpb": 0.93}}))
    d = reconcile(w)
    assert d.status["phase"] == "Confirming" and "promote" not in d.kinds()
    status = d.status
    fresh = {"c1": 1.004, "m1": 0.998, "c2": 0.993, "m2": 1.003}  # the same program, twice
    for _ in range(4):
        d = reconcile(dataclasses.replace(w, status=status, run=None, slot="0"))
        (sub,) = [i for i in d.intents if i.kind == "submit"]
        run = RunObservation(sub.args["run"], "succeeded",
                             result={"metrics": {"val_bpb": fresh[sub.args["run"][-2:]]}})
        d = reconcile(dataclasses.replace(w, status=d.status, run=run))
        status = d.status
    assert "promote" not in d.kinds()
    assert (d.status["phase"], d.status["outcome"], d.status["verdict"]) == \
        ("Succeeded", "Rejected", "WithinNoise")
    # a numeric margin with nothing asked: one run decides, as the lab said
    d = reconcile(dataclasses.replace(w, lab=dataclasses.replace(lab, min_delta=0.05)))
    assert "promote" in d.kinds()


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


def test_the_confirm_test_pools_the_labs_noise_and_is_never_too_lenient():
    from controller.core.noise import confirm, t_crit
    for (df, alpha), printed in T_TABLE.items():
        assert abs(t_crit(df, alpha) - printed) < 0.0006, (df, alpha)  # tables round
    assert t_crit(10) > t_crit(11) > t_crit(12) and t_crit(10, 0.001) > t_crit(10)
    # a difference of 1.5 standard errors is not enough; of 3 it is
    assert not confirm([0.99, 1.0], [1.0, 1.01], sigma=0.01, sigma_df=10).promote
    assert confirm([0.97, 0.96, 0.97], [1.0, 1.0, 0.99], sigma=0.01, sigma_df=10).promote
    # no measured noise: the fresh runs' own spread, with their few degrees of freedom
    v = confirm([0.97, 0.96], [1.0, 0.99])
    assert v.critical == t_crit(2) and not v.promote


def test_a_confirmed_win_on_a_master_that_moved_gets_a_follow_up():
    lab = dataclasses.replace(LAB, min_delta=0.01, confirm_runs=1)
    status = st("Confirming", parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1",
                metrics={"val_bpb": 0.98},
                confirm={"runs": 1, "candidate": [0.97], "master": [], "seeds": [870216655]},
                job=dict(JOB, name="exp-e-1-m1", program="master", seed=870216655))
    d = reconcile(World(name="e", spec=SPEC, lab=lab, master=MOVED, now=NOW, noise=0.001,
                        noise_df=10, status=status, entropy=7,
                        run=RunObservation("exp-e-1-m1", "succeeded",
                                           result={"metrics": {"val_bpb": 1.0}})))
    assert "promote" not in d.kinds()
    assert (d.status["phase"], d.status["reason"], d.status["attempt"]) == \
        ("Confirming", "FollowUp", 2)
    # straight to fresh confirm runs of the rebased candidate and the new master, on seeds
    # drawn afresh
    assert d.status["confirm"] == {"runs": 1, "candidate": [], "master": [],
                                   "seeds": confirm_seeds(7, 1)}
    assert next_run("e", d.status) == {"name": "exp-e-2-c1", "program": "candidate",
                                       "seed": confirm_seeds(7, 1)[0]}
    rows = [i.args["row"]["run_id"] for i in d.intents if i.kind == "record"]
    assert rows == ["exp-e-1-m1", "exp-e-1"]


def test_confirm_runs_stop_when_the_master_moves_between_them():
    lab = dataclasses.replace(LAB, min_delta=0.05, confirm_runs=3)
    status = st("Confirming", parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1",
                metrics={"val_bpb": 0.98},
                confirm={"runs": 3, "candidate": [0.97], "master": [1.0]})
    d = reconcile(World(name="e", spec=SPEC, lab=lab, master=MOVED, now=NOW, status=status,
                        slot="0"))
    assert "submit" not in d.kinds(), "no confirm run is spent on a pair that cannot promote"
    assert (d.status["reason"], d.status["attempt"]) == ("FollowUp", 2)


def test_with_confirm_runs_even_a_large_single_run_win_is_confirmed_first():
    """One run that clears the margin is still one lucky run: with confirm runs the master's
    val_bpb is never that run's."""
    lab = dataclasses.replace(LAB, min_delta=0.01, confirm_runs=2)
    d = reconcile(World(name="e", spec=SPEC, lab=lab, master=MASTER, now=NOW,
                        status=st("Running", job=JOB, parentHash="a" * 40, parentValBpb=1.0),
                        run=RunObservation("exp-e-1", "succeeded",
                                           result={"metrics": {"val_bpb": 0.5}})))
    assert "promote" not in d.kinds() and d.status["phase"] == "Confirming"


def test_a_confirmed_difference_below_a_numeric_min_delta_is_not_promoted():
    lab = dataclasses.replace(LAB, min_delta=0.05, confirm_runs=2)
    status = st("Confirming", parentHash="a" * 40, parentValBpb=1.0, run="exp-e-1",
                confirm={"runs": 2, "candidate": [0.97, 0.97], "master": [1.0],
                         "seeds": [870216655, 41337090]},
                job=dict(JOB, name="exp-e-1-m2", program="master", seed=41337090))
    d = reconcile(World(name="e", spec=SPEC, lab=lab, master=MASTER, now=NOW, noise=0.001,
                        noise_df=10, status=status,
                        run=RunObservation("exp-e-1-m2", "succeeded",
                                           result={"metrics": {"val_bpb": 1.0}})))
    assert "promote" not in d.kinds()
    assert (d.status["outcome"], d.status["reason"]) == ("Rejected", "Rejected")
    assert "too small to promote" in d.status["message"]
