"""One scenario table, two front ends, one transcript.

Every scenario below runs twice: through the local loop (`LocalLab.step()` passes over
a lab directory, with a scripted backend in place of the harness) and through the
kopf operator against the API emulator (the real KubernetesBackend; the test plays
the kubelet and the garbage collector). Each run yields a transcript that does not
depend on the front end:

- every experiment's final status.phase, status.reason and status.outcome (None
  for one that was deleted and is gone);
- the ledger rows, projected onto the columns the core decides, in the order of
  experiment_id and run_id;
- the master's history (experiment, hash, val_bpb) from research/live/master.json
  of the lab directory (the operator keeps its own in step with the master
  ConfigMap);
- the runs submitted to the backend: name, GPUs asked, how many were created;
- after every step, once the front end has settled: the phases, which runs exist
  and the master's val_bpb, so the order of things (no experiment before the
  baseline) is compared too;
- whether the lab ends saying its baseline failed for good (the operator's Lab
  condition BaselineFailed; the local loop's BaselineFailed, which stops `autolab run`).

Passes that failed (a status with the condition Reconciled False, an error in a
local pass summary) are reported too: none of these scenarios should have one.

The local side gets the scripted backend through the seam `lab.backends["local"]`,
right after each `LocalLab(root)`; its runs live in a `Machine` that outlives any one
LocalLab, as processes outlive a killed `autolab run`.

The test asserts that both transcripts are equal, and that they say what the
scenario expects (the engine's single policies: baseline runs named
`baseline-<lab>-<10 hex of the master hash>-<attempt>`, a ledger row per attempt,
up to 3 attempts per controller start, a baseline asks 1 GPU, nothing runs before
the master has a val_bpb, a run is recorded once across restarts).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from controller.backends import Backend, RunRequest
from controller.core.failures import failing
from controller.core.reconcile import TERMINAL, RunObservation
from controller.lab.ledger import Ledger
from controller.lab.paths import LAB_FILE
from controller.local import LocalLab, init_lab
from test_operator import (EXP, IMAGE, JOBS, LAB, NS, SEED_HASH, Cluster, cluster,
                           edit, operator, result)

assert cluster  # the emulator fixture of tests/test_operator.py, used here too

LAB_NAME = "default"
SLOTS = 2
MIN_DELTA = 0.001
BUDGET = 60
BASELINE = "<baseline>"  # in a step: the master's baseline run (its current attempt)
GPU = "nvidia.com/gpu"
LABEL_BASELINE = "autolab.dev/baseline"
# The ledger columns the core decides (not created_at, job_id, worker_id, backend, comment).
COLUMNS = ("experiment_id", "run_id", "status", "parent_hash", "candidate_hash",
           "semantic_hash", "val_bpb", "promoted", "outcome", "reason", "delta",
           "rebased_from", "duplicate_of")
WAIT = 20.0   # seconds the operator driver waits for one thing
QUIET = 0.5  # seconds nothing may change for the operator to count as settled (a busy CI core)
FINAL_QUIET = 1.5  # at the end: a few resync periods, to catch a late second submit or record


def baseline_run(attempt: int) -> str:
    """The intended name of the seed master's baseline run, attempt `attempt`."""
    return f"baseline-{LAB_NAME}-{SEED_HASH[:10]}-{attempt}"


def run_of(name: str) -> str:
    """The first run of an experiment; a run's own name (a follow-up's) as it is."""
    return name if name.startswith("exp-") else f"exp-{name}-1"


# --- the scenario table ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Harness:
    """What a run's harness reports: status succeeded | failed | error | lost (no result)."""

    status: str
    val_bpb: float | None = None
    reason_code: str = ""
    reason: str = ""


def ok(val: float) -> Harness:
    return Harness("succeeded", val)


CRASH = Harness("failed", reason_code="CandidateCrashed", reason="loss is NaN at step 12")
INFRA = Harness("error", reason="the cache volume is full")
LOST = Harness("lost")


@dataclass(frozen=True)
class Apply:
    name: str
    old: str
    new: str
    parent: str = SEED_HASH[:12]
    extra: dict = field(default_factory=dict)  # spec fields to add or replace
    mangle: tuple[str, str] | None = None      # (old, new) in the diff text: a diff that won't apply


@dataclass(frozen=True)
class Start:
    run: str  # an experiment's name, or BASELINE


@dataclass(frozen=True)
class Finish:
    run: str
    harness: Harness


@dataclass(frozen=True)
class Vanish:
    """A run seen running is gone with nothing left: its process and record (local), its Job
    (the operator), as a lost node or a `kubectl delete job` leaves it. Never its result."""

    run: str


@dataclass(frozen=True)
class FinishAll:
    """Several runs end before the controller looks again (in this order)."""

    finishes: tuple[Finish, ...]


@dataclass(frozen=True)
class Delete:
    name: str


@dataclass(frozen=True)
class Down:
    """The controller stops (is killed); runs in flight keep going."""


@dataclass(frozen=True)
class Up:
    """A new controller starts: a fresh LocalLab(root) / a new Operator."""


GONE = None  # an experiment deleted and finalized


@dataclass(frozen=True)
class Scenario:
    name: str
    measured: float | None  # the seed master's val_bpb, or None: its baseline runs first
    steps: tuple
    phases: dict            # experiment -> (phase, reason, outcome) | GONE
    rows: list              # (run_id, status) in transcript order
    history: list           # (experiment, val_bpb) of the masters, oldest first
    runs: list              # (run, gpus, times created), sorted
    gives_up: bool = False  # the lab ends saying its baseline failed for good
    promotion: dict = field(default_factory=lambda: {"minDelta": MIN_DELTA})  # the Lab's
    places: dict | None = None  # the seed master's values by place, measured before
    # Fields of final statuses: experiment -> {path: value}; a path is dotted ("pairs.master"),
    # a list on the way is mapped over ("lostRuns.run": each lost run's name).
    status: dict = field(default_factory=dict)
    coin: int | None = None  # pins the order of each place's two runs (World.entropy)

    def __str__(self) -> str:
        return self.name


def exp_runs(*names: str) -> list[tuple[str, int, int]]:
    return [(run_of(n), 1, 1) for n in names]


# The ledger of "lost-candidate-and-master-runs-mid-decision": each lost try once, lost.
LOST_MID_DECISION_ROWS = [
    ("exp-gain-1", "succeeded"), ("exp-gain-1-m2", "lost"), ("exp-gain-1-m2-t2", "lost"),
    ("exp-gain-1-m2-t3", "confirm"), ("exp-gain-1-m3", "confirm"), ("exp-gain-1-m4", "confirm"),
    ("exp-gain-1-p2", "lost"), ("exp-gain-1-p2-t2", "confirm"), ("exp-gain-1-p3", "confirm"),
    ("exp-gain-1-p4", "confirm")]
# ... and of "runs-lost-past-the-bound-and-the-change-applied-again-continues".
BOUND_ROWS = [
    ("exp-flaky-1", "error"), ("exp-flaky-1-p2", "lost"), ("exp-flaky-1-p2-t2", "lost"),
    ("exp-flaky-1-p2-t3", "lost"), ("exp-flaky-1-p2-t4", "lost"),
    ("exp-flaky-again-1", "succeeded"), ("exp-flaky-again-1-p2", "confirm"),
    ("exp-flaky-again-1-p3", "confirm"), ("exp-flaky-again-1-p4", "confirm")]

SCENARIOS = [
    Scenario(
        "promoted-rejected-and-within-min-delta", 1.0,
        (Apply("lr-03", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"),
         Apply("wd-04", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"),
         Start("lr-03"), Start("wd-04"),
         Finish("lr-03", ok(0.95)),
         # it beat its own master (1.0) after lr-03 moved it: a rebased follow-up decides
         Finish("wd-04", ok(0.97)),
         Start("exp-wd-04-2"), Finish("exp-wd-04-2", ok(0.955)),
         # written against the seed, rebased onto lr-03; better, but not by more than minDelta
         Apply("depth-10", "DEPTH = 8", "DEPTH = 10"),
         Start("depth-10"), Finish("depth-10", ok(0.9495))),
        {"lr-03": ("Succeeded", "Promoted", "Promoted"),
         "wd-04": ("Succeeded", "Rejected", "Rejected"),
         "depth-10": ("Succeeded", "Rejected", "Rejected")},
        [(run_of("depth-10"), "succeeded"), (run_of("lr-03"), "succeeded"),
         (run_of("wd-04"), "succeeded"), ("exp-wd-04-2", "succeeded")],
        [(None, 1.0), ("lr-03", 0.95)],
        sorted(exp_runs("lr-03", "wd-04", "depth-10") + [("exp-wd-04-2", 1, 1)])),
    Scenario(
        "candidate-failure-infrastructure-error-and-lost-run", 1.0,
        (Apply("no-warmdown", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.0"),
         Apply("shallow", "DEPTH = 8", "DEPTH = 6"),
         Start("no-warmdown"), Start("shallow"),
         Finish("no-warmdown", CRASH), Finish("shallow", INFRA),
         Apply("lr-025", "MATRIX_LR = 0.02", "MATRIX_LR = 0.025"),
         Start("lr-025"), Finish("lr-025", LOST),
         # neither the broken machine nor the lost run is the candidate's: each place runs
         # again, under a name of its own, and the lost tries keep their rows (lost)
         Start("exp-shallow-1-t2"), Finish("exp-shallow-1-t2", ok(1.02)),
         Start("exp-lr-025-1-t2"), Finish("exp-lr-025-1-t2", ok(0.97))),
        {"no-warmdown": ("Failed", "CandidateCrashed", None),
         "shallow": ("Succeeded", "Rejected", "Rejected"),
         "lr-025": ("Succeeded", "Promoted", "Promoted")},
        [(run_of("lr-025"), "lost"), ("exp-lr-025-1-t2", "succeeded"),
         (run_of("no-warmdown"), "failed"), (run_of("shallow"), "lost"),
         ("exp-shallow-1-t2", "succeeded")],
        [(None, 1.0), ("lr-025", 0.97)],
        sorted(exp_runs("no-warmdown", "shallow", "lr-025")
               + [("exp-shallow-1-t2", 1, 1), ("exp-lr-025-1-t2", 1, 1)])),
    Scenario(
        "duplicates-invalid-specs-and-a-conflict", 1.0,
        (Apply("first", "MATRIX_LR = 0.02", "MATRIX_LR = 0.05"),
         Apply("unemb", "UNEMBEDDING_LR = 0.004", "UNEMBEDDING_LR = 0.006"),
         Start("first"), Start("unemb"),
         # the same program as a run in flight, and as the master
         Apply("twin", "MATRIX_LR = 0.02", "MATRIX_LR = 0.05  # the same idea"),
         Apply("noop", "DEPTH = 8  # transformer blocks", "DEPTH = 8  # blocks"),
         # a diff that does not apply to its parent, and a spec the schema lets through but
         # the controller may not (a terminal escape sequence in the hypothesis). A field the spec may not have is not the example here: a cluster's
         # API server prunes it, or refuses the object under kubectl's strict validation, so
         # the operator never sees it (tests/test_kubectl.py).
         Apply("bad-diff", "DEPTH = 8", "DEPTH = 12", mangle=("-DEPTH = 8", "-DEPTH = 7")),
         Apply("bad-spec", "DEPTH = 8", "DEPTH = 14",
               extra={"hypothesis": "A deeper model \x1b[2Jtrains better in the same budget."}),
         Finish("first", ok(1.01)),
         # the same program as a measured experiment
         Apply("again", "MATRIX_LR = 0.02", "MATRIX_LR = 0.05  # again"),
         Finish("unemb", ok(0.95)),
         # written against the seed, on the line unemb changed: it cannot be rebased
         Apply("unemb-8", "UNEMBEDDING_LR = 0.004", "UNEMBEDDING_LR = 0.008")),
        {"first": ("Succeeded", "Rejected", "Rejected"),
         "unemb": ("Succeeded", "Promoted", "Promoted"),
         "twin": ("Duplicate", "DuplicateCandidate", None),
         "noop": ("Duplicate", "DuplicateCandidate", None),
         "bad-diff": ("Invalid", "DiffDoesNotApply", None),
         "bad-spec": ("Invalid", "InvalidSpec", None),
         "again": ("Duplicate", "DuplicateCandidate", None),
         "unemb-8": ("Conflict", "RebaseConflict", None)},
        [(run_of("again"), "duplicate"), (run_of("bad-diff"), "invalid"),
         (run_of("bad-spec"), "invalid"), (run_of("first"), "succeeded"),
         (run_of("noop"), "duplicate"), (run_of("twin"), "duplicate"),
         (run_of("unemb"), "succeeded"), (run_of("unemb-8"), "conflict")],
        [(None, 1.0), ("unemb", 0.95)],
        sorted(exp_runs("first", "unemb"))),
    Scenario(
        "cancel-running-queued-and-waiting", 1.0,
        (Apply("running", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"),
         Apply("queued", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"),
         Apply("waiting", "DEPTH = 8", "DEPTH = 10"),  # both slots are taken
         Start("running"),
         Delete("waiting"), Delete("running"), Delete("queued"),
         # the slots are free again
         Apply("after", "DEPTH = 8", "DEPTH = 6"),
         Start("after"), Finish("after", ok(0.99))),
        {"running": GONE, "queued": GONE, "waiting": GONE,
         "after": ("Succeeded", "Promoted", "Promoted")},
        [(run_of("after"), "succeeded"), (run_of("queued"), "cancelled"),
         (run_of("running"), "cancelled"), (run_of("waiting"), "cancelled")],
        [(None, 1.0), ("after", 0.99)],
        sorted(exp_runs("running", "queued", "after"))),
    Scenario(
        "baseline-fails-once-then-succeeds", None,
        (Apply("early", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"),  # waits for the baseline
         Start(BASELINE), Finish(BASELINE, CRASH),
         Start(BASELINE), Finish(BASELINE, ok(1.0)),
         Start("early"), Finish("early", ok(0.95))),
        {"early": ("Succeeded", "Promoted", "Promoted")},
        [(baseline_run(1), "error"), (baseline_run(2), "baseline"),
         (run_of("early"), "succeeded")],
        [(None, 1.0), ("early", 0.95)],
        [(baseline_run(1), 1, 1), (baseline_run(2), 1, 1), (run_of("early"), 1, 1)]),
    Scenario(
        "baseline-fails-three-times-and-nothing-runs", None,
        (Apply("patient", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"),
         Start(BASELINE), Finish(BASELINE, CRASH),
         Start(BASELINE), Finish(BASELINE, INFRA),
         Start(BASELINE), Finish(BASELINE, CRASH)),
        {"patient": ("Queued", "ChecksPassed", None)},
        [(baseline_run(1), "error"), (baseline_run(2), "error"), (baseline_run(3), "error")],
        [(None, None)],
        [(baseline_run(1), 1, 1), (baseline_run(2), 1, 1), (baseline_run(3), 1, 1)],
        gives_up=True),
    Scenario(
        "baseline-tried-again-after-a-restart", None,
        (Apply("patient", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"),
         Start(BASELINE), Finish(BASELINE, CRASH),
         Start(BASELINE), Finish(BASELINE, CRASH),
         Start(BASELINE), Finish(BASELINE, CRASH),
         Down(), Up(),              # 3 attempts per controller start: a new start tries again
         Start(BASELINE), Finish(BASELINE, ok(1.0)),
         Start("patient"), Finish("patient", ok(0.99))),
        {"patient": ("Succeeded", "Promoted", "Promoted")},
        [(baseline_run(1), "error"), (baseline_run(2), "error"), (baseline_run(3), "error"),
         (baseline_run(4), "baseline"), (run_of("patient"), "succeeded")],
        [(None, 1.0), ("patient", 0.99)],
        [(baseline_run(1), 1, 1), (baseline_run(2), 1, 1), (baseline_run(3), 1, 1),
         (baseline_run(4), 1, 1), (run_of("patient"), 1, 1)]),
    Scenario(
        "restart-with-runs-in-flight", 1.0,
        (Apply("lr-03", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"),
         Apply("wd-04", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"),
         Start("lr-03"),
         Down(), Up(),              # lr-03 running, wd-04 submitted and queued
         Start("wd-04"), Finish("lr-03", ok(0.96)),
         Down(), Finish("wd-04", ok(0.99)), Up(),  # it finished while no controller ran
         # it beat its own master after lr-03 moved it: the new controller runs its follow-up
         Start("exp-wd-04-2"), Finish("exp-wd-04-2", ok(0.97))),
        {"lr-03": ("Succeeded", "Promoted", "Promoted"),
         "wd-04": ("Succeeded", "Rejected", "Rejected")},
        [(run_of("lr-03"), "succeeded"), (run_of("wd-04"), "succeeded"),
         ("exp-wd-04-2", "succeeded")],
        [(None, 1.0), ("lr-03", 0.96)],
        sorted(exp_runs("lr-03", "wd-04") + [("exp-wd-04-2", 1, 1)])),
    Scenario(
        # Two winners built on the same master end before the controller looks again: the
        # first is promoted; the second is not Rejected (MasterMoved) but rebased and measured
        # again on the new master, and lands on top of it. (Where their order is the race's,
        # and the compare-and-swap itself refuses the second: tests/test_race.py.)
        "two-winners-finish-together", 1.0,
        (Apply("tw-a", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"),
         Apply("tw-b", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"),
         Start("tw-a"), Start("tw-b"),
         FinishAll((Finish("tw-a", ok(0.98)), Finish("tw-b", ok(0.975)))),
         Start("exp-tw-b-2"), Finish("exp-tw-b-2", ok(0.97))),
        {"tw-a": ("Succeeded", "Promoted", "Promoted"),
         "tw-b": ("Succeeded", "Promoted", "Promoted")},
        [(run_of("tw-a"), "succeeded"), (run_of("tw-b"), "succeeded"),
         ("exp-tw-b-2", "succeeded")],
        [(None, 1.0), ("tw-a", 0.98), ("tw-b", 0.97)],
        sorted(exp_runs("tw-a", "tw-b") + [("exp-tw-b-2", 1, 1)])),
    Scenario(
        # The lab's defaults (minDelta auto: pairs, judged one at a time). A handicapped master
        # spreads wide across seeds (sd 0.08 over its places); fixing the handicap is promoted,
        # and the next gain, 0.01 on every seed (an eighth of the old master's spread), is
        # promoted too: its test uses its own pairs, never the handicapped master's spread.
        "a-fixed-handicap-leaves-no-spread-behind", 1.40,
        (Apply("fix", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"),
         Start("fix"), Finish("fix", ok(0.61)),
         Start("exp-fix-1-p2"), Finish("exp-fix-1-p2", ok(0.60)),
         Start("exp-fix-1-p3"), Finish("exp-fix-1-p3", ok(0.62)),
         Start("exp-fix-1-p4"), Finish("exp-fix-1-p4", ok(0.61)),
         Apply("gain", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"),
         Start("gain"), Finish("gain", ok(0.60)),
         Start("exp-gain-1-p2"), Finish("exp-gain-1-p2", ok(0.59)),
         Start("exp-gain-1-p3"), Finish("exp-gain-1-p3", ok(0.61))),
        {"fix": ("Succeeded", "Promoted", "Promoted"),
         "gain": ("Succeeded", "Promoted", "Promoted")},
        [(run_of("fix"), "succeeded"), ("exp-fix-1-p2", "confirm"), ("exp-fix-1-p3", "confirm"),
         ("exp-fix-1-p4", "confirm"), (run_of("gain"), "succeeded"),
         ("exp-gain-1-p2", "confirm"), ("exp-gain-1-p3", "confirm")],
        [(None, 1.40), ("fix", 0.61), ("gain", 0.6)],
        sorted(exp_runs("fix", "gain") + [(f"exp-fix-1-p{i}", 1, 1) for i in (2, 3, 4)]
               + [(f"exp-gain-1-p{i}", 1, 1) for i in (2, 3)]),
        promotion={"minDelta": "auto"},
        places={1: 1.40, 2: 1.51, 3: 1.30, 4: 1.45, 5: 1.36, 6: 1.48}),
    Scenario(
        # A decision in pairs (minDelta auto) where the master has no value past place 1, so
        # the master runs too (exp-<name>-1-m<i>). A run of each side is lost mid-decision: the
        # candidate's (no result), the master's twice (its Job deleted, then the machine's
        # error). Each try is recorded once, lost; its place runs again under a name of its
        # own; the pairs so far stay, and the decision ends on the same pairs plus the re-runs.
        "lost-candidate-and-master-runs-mid-decision", 1.40,
        (Apply("gain", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"),
         Start("gain"), Finish("gain", ok(0.60)),
         # the coin puts the candidate first at place 2, the master first at place 3
         Start("exp-gain-1-p2"), Finish("exp-gain-1-p2", LOST),
         Start("exp-gain-1-p2-t2"), Finish("exp-gain-1-p2-t2", ok(0.59)),
         Start("exp-gain-1-m2"), Vanish("exp-gain-1-m2"),
         Start("exp-gain-1-m2-t2"), Finish("exp-gain-1-m2-t2", INFRA),
         Start("exp-gain-1-m2-t3"), Finish("exp-gain-1-m2-t3", ok(1.51)),
         Start("exp-gain-1-m3"), Finish("exp-gain-1-m3", ok(1.30)),
         Start("exp-gain-1-p3"), Finish("exp-gain-1-p3", ok(0.61)),
         Start("exp-gain-1-p4"), Finish("exp-gain-1-p4", ok(0.60)),
         Start("exp-gain-1-m4"), Finish("exp-gain-1-m4", ok(1.45))),
        {"gain": ("Succeeded", "Promoted", "Promoted")},
        LOST_MID_DECISION_ROWS,
        [(None, 1.40), ("gain", 0.6)],
        sorted(exp_runs("gain") + [(r, 1, 1) for r in (
            "exp-gain-1-p2", "exp-gain-1-p2-t2", "exp-gain-1-m2", "exp-gain-1-m2-t2",
            "exp-gain-1-m2-t3", "exp-gain-1-m3", "exp-gain-1-p3", "exp-gain-1-p4",
            "exp-gain-1-m4")]),
        promotion={"minDelta": "auto"}, places={1: 1.40},
        status={"gain": {"pairs.candidate": [0.60, 0.59, 0.61, 0.60],
                         "pairs.master": [1.40, 1.51, 1.30, 1.45],
                         "lostRuns.run": ["exp-gain-1-p2", "exp-gain-1-m2", "exp-gain-1-m2-t2"],
                         "lostRuns.base": ["exp-gain-1-p2", "exp-gain-1-m2", "exp-gain-1-m2"]}},
        coin=0),
    Scenario(
        # One place lost on every try ends the decision after the bound (1 + LOST_RETRIES
        # tries): Failed, RunsLost, with the machine's words, not held against the candidate
        # (its row says error, not measured). The same change applied again under a new name
        # on the same master continues from its pairs: it submits place 2, not place 1.
        "runs-lost-past-the-bound-and-the-change-applied-again-continues", 1.40,
        (Apply("flaky", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"),
         Start("flaky"), Finish("flaky", ok(0.61)),
         Start("exp-flaky-1-p2"), Finish("exp-flaky-1-p2", LOST),
         Start("exp-flaky-1-p2-t2"), Finish("exp-flaky-1-p2-t2", INFRA),
         Start("exp-flaky-1-p2-t3"), Vanish("exp-flaky-1-p2-t3"),
         Start("exp-flaky-1-p2-t4"), Finish("exp-flaky-1-p2-t4", INFRA),
         Apply("flaky-again", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"),
         Start("exp-flaky-again-1-p2"), Finish("exp-flaky-again-1-p2", ok(0.60)),
         Start("exp-flaky-again-1-p3"), Finish("exp-flaky-again-1-p3", ok(0.62)),
         Start("exp-flaky-again-1-p4"), Finish("exp-flaky-again-1-p4", ok(0.61))),
        {"flaky": ("Failed", "RunsLost", None),
         "flaky-again": ("Succeeded", "Promoted", "Promoted")},
        BOUND_ROWS,
        [(None, 1.40), ("flaky-again", 0.61)],
        sorted(exp_runs("flaky") + [(r, 1, 1) for r in (
            "exp-flaky-1-p2", "exp-flaky-1-p2-t2", "exp-flaky-1-p2-t3", "exp-flaky-1-p2-t4",
            "exp-flaky-again-1-p2", "exp-flaky-again-1-p3", "exp-flaky-again-1-p4")]),
        promotion={"minDelta": "auto"},
        places={1: 1.40, 2: 1.51, 3: 1.30, 4: 1.45, 5: 1.36, 6: 1.48},
        status={"flaky": {"lostRuns.run": ["exp-flaky-1-p2", "exp-flaky-1-p2-t2",
                                           "exp-flaky-1-p2-t3", "exp-flaky-1-p2-t4"],
                          "message~": INFRA.reason, "pairs.candidate": [0.61]},
                "flaky-again": {"continues": ["flaky"],
                                "pairs.candidate": [0.61, 0.60, 0.62, 0.61],
                                "pairs.master": [1.40, 1.51, 1.30, 1.45]}}),
    Scenario(
        "restart-while-the-baseline-is-in-flight", None,
        (Start(BASELINE),
         Down(), Up(),              # the new controller adopts attempt 1, starts no second one
         Apply("later", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.3"),
         Finish(BASELINE, ok(1.0)),
         Start("later"), Finish("later", ok(1.05))),
        {"later": ("Succeeded", "Rejected", "Rejected")},
        [(baseline_run(1), "baseline"), (run_of("later"), "succeeded")],
        [(None, 1.0)],
        [(baseline_run(1), 1, 1), (run_of("later"), 1, 1)]),
]


def spec_doc(step: Apply) -> dict:
    diff = edit(step.old, step.new)
    if step.mangle:
        assert step.mangle[0] in diff
        diff = diff.replace(*step.mangle)
    return {"apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment",
            "metadata": {"name": step.name},
            "spec": {"lab": LAB_NAME, "campaign": "one-engine",
                     "hypothesis": f"{step.new} trains better in the same budget.",
                     "parent": step.parent, "diff": diff, **step.extra}}


def label(step: Any) -> str:
    if isinstance(step, (Start, Finish, Vanish)):
        what = "baseline" if step.run == BASELINE else step.run
        return f"{type(step).__name__}({what}" + (
            f", {step.harness.status})" if isinstance(step, Finish) else ")")
    if isinstance(step, (Apply, Delete)):
        return f"{type(step).__name__}({step.name})"
    if isinstance(step, FinishAll):
        return "FinishAll(" + ", ".join(f.run for f in step.finishes) + ")"
    return f"{type(step).__name__}()"


# --- the transcript -------------------------------------------------------------------------------

@dataclass
class Transcript:
    experiments: dict = field(default_factory=dict)  # name -> (phase, reason, outcome) | None
    ledger: list = field(default_factory=list)       # projected rows, sorted
    history: list = field(default_factory=list)      # (experiment, hash, val_bpb)
    runs: list = field(default_factory=list)         # (run, gpus, times created), sorted
    snapshots: list = field(default_factory=list)    # after each step
    crashed: str | None = None                       # the driver could not go on: why
    failures: list = field(default_factory=list)     # passes that failed (told on a status)
    gave_up: bool = False  # the lab says its baseline failed for good (no attempts left)
    statuses: dict = field(default_factory=dict)     # name -> final status

    def failed(self, message: str) -> None:
        if message not in self.failures:
            self.failures.append(message)

    def watch(self, statuses: dict[str, dict]) -> None:
        """Note every pass failure a status tells (condition Reconciled False)."""
        for st in statuses.values():
            if failing(st):
                cond = next(c for c in st["conditions"] if c.get("type") == "Reconciled")
                self.failed(cond.get("message", ""))


def project(rows: list[dict]) -> list[tuple]:
    return sorted(tuple(r.get(k, "") for k in COLUMNS) for r in rows)


def history_of(lab_dir: Path) -> list[tuple]:
    """The master's history; empty where the lab never got a master (a driver that crashed)."""
    path = lab_dir / "research" / "live" / "master.json"
    if not path.exists():
        return []
    doc = json.loads(path.read_text())
    return [(h.get("experiment"), h.get("hash"), h.get("val_bpb")) for h in doc["history"]]


def master_val(lab_dir: Path) -> float | None:
    path = lab_dir / "research" / "live" / "master.json"
    return json.loads(path.read_text()).get("val_bpb") if path.exists() else None


def snapshot(step: str, statuses: dict[str, dict], runs: list[str], val: float | None) -> tuple:
    exps = tuple(sorted((n, st.get("phase"), st.get("reason"), st.get("outcome"),
                         (st.get("job") or {}).get("name")) for n, st in statuses.items()))
    return (step, exps, tuple(sorted(set(runs))), val)


def phases_of(statuses: dict[str, dict], applied: list[str]) -> dict:
    out = {}
    for n in applied:
        st = statuses.get(n)
        out[n] = None if st is None else (st.get("phase"), st.get("reason"), st.get("outcome"))
    return out


def field_of(st: Any, path: str) -> Any:
    """A status field by its dotted path; a list on the way is mapped over."""
    for key in path.split("."):
        if isinstance(st, list):
            st = [x.get(key) if isinstance(x, dict) else None for x in st]
        else:
            st = st.get(key) if isinstance(st, dict) else None
    return st


def count_runs(submitted: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    seen: dict[str, tuple[int, int]] = {}
    for run, gpus in submitted:
        g, n = seen.get(run, (gpus, 0))
        seen[run] = (g, n + 1)
    return sorted((run, g, n) for run, (g, n) in seen.items())


# --- the local front end --------------------------------------------------------------------------

class Machine:
    """The local machine's runs as the test scripts them: they outlive any one controller."""

    def __init__(self) -> None:
        self.runs: dict[str, dict] = {}
        self.submitted: list[RunRequest] = []


class ScriptedBackend(Backend):
    """The local backend's seam, with runs that move only when the test says so."""

    name = "local"

    def __init__(self, machine: Machine, root: Path):
        self.machine = machine
        self.root = root

    def submit(self, req: RunRequest) -> RunObservation:
        if req.run not in self.machine.runs:  # adopt a run that exists, never start it twice
            self.machine.runs[req.run] = {"req": req, "state": "queued", "result": None,
                                          "message": f"{req.run} waits for its GPU"}
            self.machine.submitted.append(req)
        return self.observe(req.run)

    def observe(self, run: str) -> RunObservation:
        r = self.machine.runs.get(run)
        if r is None:
            return RunObservation(run, "missing")
        worker = "" if r["state"] == "queued" else f"scripted:{r['req'].slot}"
        return RunObservation(run, r["state"], result=r["result"], message=r["message"],
                              job_id=f"scripted-{run}", worker=worker)

    def cancel(self, run: str) -> RunObservation:
        r = self.machine.runs.get(run)
        if r is not None and r["state"] in ("queued", "running"):
            r.update(state="cancelled", message="cancelled by the user",
                     result={"status": "cancelled", "reason": "cancelled by the user"})
        return self.observe(run)

    def slot_of(self, run: str) -> str | None:
        r = self.machine.runs.get(run)
        return r["req"].slot if r else None

    def run_dir(self, run: str) -> Path:
        return self.root / ".autolab" / "runs" / run

    def log_path(self, run: str) -> Path:
        return self.run_dir(run) / "log.txt"

    def cleanup(self, run: str) -> None:
        pass

    def leftovers(self, run: str) -> bool:
        return False


def harness_result(h: Harness) -> dict:
    """The result JSON of the harness, as tests/test_operator.py's `result()` makes it."""
    out = result(h.val_bpb, h.status, h.reason)
    if h.reason_code:
        out["reason_code"] = h.reason_code
    return out


class LocalDriver:
    def __init__(self, root: Path, scn: Scenario):
        self.scn = scn
        lab = init_lab(root, profile="tiny", data="synthetic", name=LAB_NAME, budget=BUDGET)
        self.root = lab.root
        doc = yaml.safe_load((self.root / LAB_FILE).read_text())
        doc["spec"].update(capacity={"gpuSlots": SLOTS}, promotion=scn.promotion)
        (self.root / LAB_FILE).write_text(yaml.safe_dump(doc, sort_keys=False))
        if scn.measured is not None:
            lab.repo.set_master_metric(scn.measured, scn.places)
        self.machine = Machine()
        self.lab: LocalLab | None = None
        self.applied: list[str] = []
        self.t = Transcript()

    def up(self) -> None:
        self.lab = LocalLab(self.root)
        self.lab.backends["local"] = ScriptedBackend(self.machine, self.root)

    def statuses(self) -> dict[str, dict]:
        d = self.root / ".autolab" / "status"
        return {p.stem: json.loads(p.read_text()).get("status") or {}
                for p in sorted(d.glob("*.json"))} if d.exists() else {}

    def fingerprint(self) -> str:
        ledger = self.root / "research" / "results.tsv"
        return json.dumps([self.statuses(), ledger.read_text() if ledger.exists() else "",
                           (self.root / "research/live/master.json").read_text(),
                           {r: (v["state"]) for r, v in self.machine.runs.items()}],
                          sort_keys=True)

    def settle(self) -> None:
        if self.lab is None:
            return  # no controller runs
        last = None
        for _ in range(30):
            try:
                summary = self.lab.step()
            except Exception as e:
                # The local loop's way to say the baseline failed for good: it stops and tells.
                if type(e).__name__ != "BaselineFailed":
                    raise
                self.t.gave_up = True
            else:
                self.t.gave_up = False
                for error in summary.errors:
                    self.t.failed(error)
            self.t.watch(self.statuses())
            now = self.fingerprint()
            if now == last:
                return
            last = now
        raise AssertionError("the local loop did not settle in 30 passes")

    def baseline_runs(self) -> list[str]:
        return [r.run for r in self.machine.submitted if r.experiment == "baseline"]

    def pick(self, run: str, state: str) -> str:
        if run != BASELINE:
            name = run_of(run)
            if name not in self.machine.runs:
                raise AssertionError(f"{name} was never submitted")
            return name
        waiting = [r for r in self.baseline_runs() if self.machine.runs[r]["state"] == state]
        if not waiting:
            raise AssertionError(f"no baseline run is {state}")
        return waiting[-1]

    def do(self, step: Any) -> None:
        if isinstance(step, Apply):
            self.applied.append(step.name)
            path = self.root / "experiments" / f"{step.name}.yaml"
            path.write_text(yaml.safe_dump(spec_doc(step), sort_keys=False))
        elif isinstance(step, Start):
            self.machine.runs[self.pick(step.run, "queued")].update(state="running", message="")
        elif isinstance(step, FinishAll):
            for finish in step.finishes:
                self.do(finish)
        elif isinstance(step, Finish):
            r = self.machine.runs[self.pick(step.run, "running")]
            h = step.harness
            if h.status == "lost":
                r.update(state="lost", result=None,
                         message="the run ended without a result from the harness")
            else:
                res = harness_result(h)
                r.update(state=h.status, result=res, message=res.get("reason", ""))
        elif isinstance(step, Vanish):
            del self.machine.runs[self.pick(step.run, "running")]
        elif isinstance(step, Delete):
            assert self.lab is not None
            self.lab.delete(step.name)
        elif isinstance(step, Down):
            self.lab = None
        elif isinstance(step, Up):
            self.up()

    def run(self) -> Transcript:
        t = self.t
        where = "start"
        try:
            self.up()
            self.settle()
            self.snap(where)
            for step in self.scn.steps:
                where = label(step)
                self.do(step)
                self.settle()
                self.snap(where)
            where = "the end"
            if self.lab is None:
                self.up()
            self.settle()
        except Exception as e:  # the transcript says how far it got
            t.crashed = f"{where}: {type(e).__name__}: {e}"
        statuses = self.statuses()
        t.statuses = statuses
        t.experiments = phases_of(statuses, self.applied)
        t.ledger = project(Ledger(self.root / "research" / "results.tsv").rows())
        t.history = history_of(self.root)
        t.runs = count_runs([(r.run, r.gpus) for r in self.machine.submitted])
        return t

    def snap(self, step: str) -> None:
        if self.lab is None:
            return  # nothing to observe while no controller runs
        self.t.snapshots.append(snapshot(step, self.statuses(),
                                         [r.run for r in self.machine.submitted],
                                         master_val(self.root)))


# --- the operator front end -----------------------------------------------------------------------

class Logged(logging.Handler):
    """The operator's errors (a handler that raised), to say why a driver timed out."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
        if text not in self.messages:
            self.messages.append(text)


class OperatorDriver:
    """Plays the kubelet (Pods, their results, a Job's failure) and the garbage collector."""

    def __init__(self, c: Cluster, scn: Scenario):
        self.c = c
        self.scn = scn
        self.lab_dir = c.root / LAB_NAME
        self.batch = k8s.BatchV1Api(c.api)
        self.stack: contextlib.AsyncExitStack | None = None
        self.applied: list[str] = []
        self.pods: dict[str, str] = {}         # job uid -> pod
        self.started: set[str] = set()         # job uids with a Pod
        self.finished: set[str] = set()        # job uids whose run ended
        self.names: dict[str, str] = {}        # job uid -> job name
        self.t = Transcript()

    # -- the cluster as the test sees it --
    def jobs(self) -> dict[str, dict]:
        return {j["metadata"]["name"]: j for j in self.c.em.items(JOBS, NS)}

    def statuses(self) -> dict[str, dict]:
        return {e["metadata"]["name"]: {k: v for k, v in (e.get("status") or {}).items()
                                        if k != "kopf"}
                for e in self.c.em.items(EXP, NS)}

    def created(self) -> list[dict]:
        """The Jobs the API server created (a create answered 409 adopted one: not counted)."""
        return [r.data for r in self.c.em.requests
                if r.method == "POST" and r.resource is not None and r.resource.plural == "jobs"
                and isinstance(r.data, dict) and (r.data.get("metadata") or {}).get("uid")]

    def submitted(self) -> list[tuple[str, int]]:
        out = []
        for job in self.created():
            pod = job["spec"]["template"]["spec"]
            limits = [((c.get("resources") or {}).get("limits") or {}).get(GPU, "0")
                      for c in pod.get("initContainers", []) + pod["containers"]]
            out.append((job["metadata"]["name"], max(int(x) for x in limits)))
        return out

    def ledger_runs(self) -> set[str]:
        return {r["run_id"] for r in self.c.ledger(LAB_NAME)}

    def master_val(self) -> float | None:
        return master_val(self.lab_dir) if (self.lab_dir / "research").exists() else None

    async def collect_garbage(self) -> None:
        """Pods of deleted Jobs go (the API server's garbage collector, left out of the emulator)."""
        uids = {j["metadata"]["uid"] for j in self.c.em.items(JOBS, NS)}
        for pod in self.c.em.items("v1/pods", NS):
            owners = [o["uid"] for o in pod["metadata"].get("ownerReferences") or []]
            if owners and not set(owners) & uids:
                with contextlib.suppress(k8s.ApiException):
                    await self.c.call(self.c.core.delete_namespaced_pod,
                                      pod["metadata"]["name"], NS)

    def unsettled(self) -> str | None:
        """Why the operator is not done with what the last step asked; None when it is."""
        jobs = self.jobs()
        uids = {j["metadata"]["uid"]: j for j in jobs.values()}
        recorded = self.ledger_runs()
        val = self.master_val()
        in_flight = 0
        waiting = []
        for e in self.c.em.items(EXP, NS):
            name = e["metadata"]["name"]
            st = e.get("status") or {}
            phase = st.get("phase")
            job = st.get("job") or {}
            if e["metadata"].get("deletionTimestamp"):
                return f"{name} is being deleted"
            if phase in (None, "Pending"):
                return f"{name} is {phase or 'new'}"
            if phase in TERMINAL:
                if (st.get("run") or job.get("name") or run_of(name)) not in recorded:
                    return f"{name} is {phase} but not in the ledger"
                continue
            if not job:
                waiting.append(name)
                continue
            in_flight += 1
            have = jobs.get(job["name"])
            if have is None:
                return f"{name}'s Job {job['name']} does not exist"
            uid = have["metadata"]["uid"]
            if uid in self.finished:
                return f"{name}'s run ended but it is {phase}"
            if uid in self.started and phase not in ("Running", "Confirming"):
                return f"{name}'s Pod runs but it is {phase}"
        for uid, job in uids.items():
            if (job["metadata"].get("labels") or {}).get(LABEL_BASELINE):
                if uid in self.finished and job["metadata"]["name"] not in recorded:
                    return f"the baseline run {job['metadata']['name']} ended, not recorded"
                if uid not in self.finished:
                    in_flight += 1
        if waiting and val is not None and in_flight < SLOTS:
            return f"{waiting} wait with a slot free"
        if val is None and not any(uid not in self.finished for uid, job in uids.items() if (
                job["metadata"].get("labels") or {}).get(LABEL_BASELINE)) and not self.gave_up():
            # An unmeasured master with no baseline in flight: the operator is about to try
            # (again); a busy core may take longer than QUIET to get there (CI saw it).
            return "the baseline is to be tried (again)"
        return None

    def gave_up(self) -> bool:
        lab = self.c.get("autolab.dev/v1alpha1/labs", LAB_NAME) or {}
        return any(c.get("reason") == "BaselineFailed" and c.get("status") == "False"
                   for c in (lab.get("status") or {}).get("conditions") or [])

    def lab_status_writes(self) -> int:
        return sum(1 for r in self.c.em.requests if r.method == "PATCH" and r.resource is not None
                   and r.resource.plural == "labs" and r.subresource == "status")

    async def settle(self, quiet: float = QUIET) -> None:
        if self.stack is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        last, since = None, loop.time()
        while True:
            await self.collect_garbage()
            self.t.watch(self.statuses())
            why = self.unsettled()
            now = json.dumps([self.statuses(), sorted(self.ledger_runs()),
                              sorted((n, j["metadata"]["uid"]) for n, j in self.jobs().items()),
                              self.master_val()], sort_keys=True, default=str)
            if why is not None or now != last:
                last, since = now, loop.time()
            elif loop.time() - since >= quiet:
                return
            if loop.time() > deadline:
                raise AssertionError(f"timed out after {WAIT}s: {why or 'still changing'}; "
                                     f"statuses {self.statuses()}")
            await asyncio.sleep(0.05)

    # -- the kubelet --
    async def job_for(self, run: str, want: str) -> dict:
        """The Job of `run` (an experiment or BASELINE) that is `want`: new | started."""
        def find() -> dict | None:
            for j in self.jobs().values():
                meta = j["metadata"]
                labels = meta.get("labels") or {}
                mine = (labels.get(LABEL_BASELINE) if run == BASELINE
                        else meta["name"] == run_of(run))
                if not mine or meta.get("deletionTimestamp"):
                    continue
                uid = meta["uid"]
                if want == "new" and uid not in self.started:
                    return j
                if want == "started" and uid in self.started and uid not in self.finished:
                    return j
            return None
        what = "the baseline" if run == BASELINE else run_of(run)
        return await self.c.until(f"a {want} Job of {what}", find, timeout=WAIT)

    async def start_pod(self, job: dict) -> None:
        """The Pod the Job controller would make, scheduled and running."""
        name = job["metadata"]["name"]
        uid = job["metadata"]["uid"]
        pod_name = f"{name}-{uid[:5]}"
        template = job["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": pod_name, "namespace": NS,
                            "labels": {**template["metadata"]["labels"], "job-name": name,
                                       "batch.kubernetes.io/job-name": name},
                            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                                                 "name": name, "uid": uid, "controller": True}]},
               "spec": {**template["spec"], "nodeName": "gpu-node-1"},
               "status": {"phase": "Running", "containerStatuses": [{
                   "name": "run", "image": IMAGE, "imageID": "", "ready": True,
                   "restartCount": 0, "state": {"running": {"startedAt": "2026-11-29T10:00:00Z"}}}]}}
        await self.c.call(self.c.core.create_namespaced_pod, NS, pod)
        self.pods[uid] = pod_name
        self.started.add(uid)
        self.names[uid] = name

    async def job_failed(self, name: str, reason: str) -> None:
        await self.c.call(self.batch.patch_namespaced_job_status, name, NS, {"status": {
            "conditions": [{"type": "Failed", "status": "True", "reason": reason,
                            "message": f"Job has reached {reason}"}]}},
            _content_type="application/merge-patch+json")

    async def finish(self, job: dict, h: Harness) -> None:
        uid = job["metadata"]["uid"]
        name = job["metadata"]["name"]
        if h.status == "lost":  # past its deadline, no result from the harness
            await self.job_failed(name, "DeadlineExceeded")
        else:
            code = {"succeeded": 0, "failed": 3, "error": 4}[h.status]
            await self.c.finish_pod(self.pods[uid], harness_result(h), exit_code=code)
            if h.status == "error":  # an infrastructure error is final when the Job gives up
                await self.job_failed(name, "BackoffLimitExceeded")
        self.finished.add(uid)

    # -- the steps --
    async def up(self) -> None:
        writes = self.lab_status_writes()
        self.stack = contextlib.AsyncExitStack()
        await self.stack.enter_async_context(operator(self.c))
        # Until the new operator has handled the Lab, its status is the old one's (a baseline
        # that failed for good, say): settled would be read off stale words.
        await self.c.until("the new operator's Lab status", lambda: (
            self.lab_status_writes() > writes), timeout=WAIT)

    async def down(self) -> None:
        if self.stack is not None:
            stack, self.stack = self.stack, None
            await stack.aclose()

    async def do(self, step: Any) -> None:
        if isinstance(step, Apply):
            self.applied.append(step.name)
            doc = spec_doc(step)
            doc["metadata"]["namespace"] = NS
            await self.c.apply("experiments", doc)
        elif isinstance(step, Start):
            await self.start_pod(await self.job_for(step.run, "new"))
        elif isinstance(step, FinishAll):
            # Kopf decides each Experiment in a worker of its own, so two runs that end
            # together are decided in either order (tests/test_race.py takes both); here each
            # is decided before the next ends, the order the local loop's one pass takes.
            jobs = [await self.job_for(f.run, "started") for f in step.finishes]
            for job, f in zip(jobs, step.finishes):
                await self.finish(job, f.harness)
                await self.settle()
        elif isinstance(step, Finish):
            await self.finish(await self.job_for(step.run, "started"), step.harness)
        elif isinstance(step, Vanish):
            job = await self.job_for(step.run, "started")
            await self.c.call(self.batch.delete_namespaced_job, job["metadata"]["name"], NS)
            self.finished.add(job["metadata"]["uid"])
        elif isinstance(step, Delete):
            await self.c.delete("experiments", step.name)
            if self.stack is not None:
                await self.c.until(f"{step.name} gone", lambda: self.c.get(EXP, step.name) is None,
                                   timeout=WAIT)
        elif isinstance(step, Down):
            await self.down()
        elif isinstance(step, Up):
            await self.up()

    async def run(self) -> Transcript:
        t = self.t
        lab = json.loads(json.dumps(LAB))
        lab["spec"].update(budgetSeconds=BUDGET, capacity={"gpuSlots": SLOTS},
                           promotion=self.scn.promotion)
        where = "start"
        logged = Logged()
        for name in ("kopf", "autolab"):
            logging.getLogger(name).addHandler(logged)
        try:
            if self.scn.measured is not None:  # the lab repo exists and was measured already
                local = init_lab(self.lab_dir, profile="tiny", data="synthetic", name=LAB_NAME,
                                 budget=BUDGET)
                local.repo.set_master_metric(self.scn.measured, self.scn.places)
            await self.c.apply("labs", lab)
            await self.up()
            await self.c.until("the lab directory", lambda: (
                self.lab_dir / "research" / "live" / "master.json").exists(), timeout=WAIT)
            await self.settle()
            self.snap("start")
            for step in self.scn.steps:
                where = label(step)
                await self.do(step)
                await self.settle()
                self.snap(where)
            where = "the end"
            if self.stack is None:
                await self.up()
            await self.settle(FINAL_QUIET)
        except Exception as e:  # the transcript says how far it got
            t.crashed = f"{where}: {type(e).__name__}: {e}" + "".join(
                f"\n      operator log: {m}" for m in logged.messages[:5])
        finally:
            await self.down()
            for name in ("kopf", "autolab"):
                logging.getLogger(name).removeHandler(logged)
        t.statuses = self.statuses()
        t.experiments = phases_of(t.statuses, self.applied)
        t.ledger = project(self.c.ledger(LAB_NAME))
        t.history = history_of(self.lab_dir) if (self.lab_dir / "research").exists() else []
        t.runs = count_runs(self.submitted())
        t.gave_up = self.gave_up()
        return t

    def snap(self, step: str) -> None:
        if self.stack is None:
            return
        self.t.snapshots.append(snapshot(step, self.statuses(),
                                         [n for n, _ in self.submitted()], self.master_val()))


# --- the test -------------------------------------------------------------------------------------

def expectation_problems(who: str, t: Transcript, scn: Scenario) -> list[str]:
    out = []
    if t.crashed:
        out.append(f"{who}: the driver stopped at {t.crashed}")
    for message in t.failures:
        out.append(f"{who}: a pass failed: {message}")
    if t.experiments != scn.phases:
        out.append(f"{who}: final (phase, reason, outcome) {t.experiments}, expected {scn.phases}")
    rows = [(r[COLUMNS.index("run_id")], r[COLUMNS.index("status")]) for r in t.ledger]
    if rows != scn.rows:
        out.append(f"{who}: ledger (run_id, status) {rows}, expected {scn.rows}")
    for r in t.ledger:
        run, experiment = r[COLUMNS.index("run_id")], r[COLUMNS.index("experiment_id")]
        if run.startswith("baseline-") and experiment != "baseline":
            out.append(f"{who}: the baseline row {run} has experiment_id {experiment!r}")
    ids = [r for r, _ in rows]
    if len(ids) != len(set(ids)):
        out.append(f"{who}: a run is recorded more than once: {ids}")
    history = [(e, v) for e, _, v in t.history]
    if history != scn.history:
        out.append(f"{who}: master history (experiment, val_bpb) {history}, expected "
                   f"{scn.history}")
    if t.gave_up != scn.gives_up:
        out.append(f"{who}: " + ("the lab says its baseline failed for good" if t.gave_up else
                                 "the lab does not say its baseline failed for good"))
    if t.runs != scn.runs:
        out.append(f"{who}: runs (name, gpus, times created) {t.runs}, expected {scn.runs}")
    for name, fields in scn.status.items():
        for path, want in fields.items():
            got = field_of(t.statuses.get(name), path.rstrip("~"))
            if (want not in (got or "")) if path.endswith("~") else got != want:
                out.append(f"{who}: {name}'s status {path.rstrip('~')} is {got!r}, expected "
                           f"{'to contain ' if path.endswith('~') else ''}{want!r}")
    for step, _, runs, val in t.snapshots:
        early = [r for r in runs if r.startswith("exp-")]
        if val is None and early:
            out.append(f"{who}: after {step} {early} were submitted before the master had a "
                       "val_bpb")
    return out


def agreement_problems(local: Transcript, remote: Transcript) -> list[str]:
    out = []
    for part in ("experiments", "ledger", "history", "runs", "snapshots", "gave_up"):
        a, b = getattr(local, part), getattr(remote, part)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            only_a = [x for x in a if x not in b]
            only_b = [x for x in b if x not in a]
            # The same items in another order or number: say where the two lists part.
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(f"the front ends disagree on {part}:\n    local only:    {only_a}\n"
                       f"    operator only: {only_b}\n"
                       f"    first difference at item {at} of {len(a)} (local) and {len(b)} "
                       f"(operator):\n      local:    {a[at:at + 2]}\n"
                       f"      operator: {b[at:at + 2]}")
        else:
            out.append(f"the front ends disagree on {part}:\n    local:    {a}\n"
                       f"    operator: {b}")
    return out


@pytest.mark.parametrize("scn", SCENARIOS, ids=str)
async def test_one_scenario_table_through_both_front_ends(scn: Scenario, cluster: Cluster,
                                                          tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOLAB_GPUS", ",".join(str(i) for i in range(SLOTS)))
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    if scn.coin is not None:  # the entropy each World draws (reconcile.World.entropy)
        monkeypatch.setattr(secrets, "randbits", lambda k: scn.coin)
    # The two front ends share nothing (two lab directories, two sets of runs): side by side.
    local, remote = await asyncio.gather(
        asyncio.to_thread(LocalDriver(tmp_path / "local" / LAB_NAME, scn).run),
        OperatorDriver(cluster, scn).run())
    problems = (agreement_problems(local, remote) + expectation_problems("local", local, scn)
                + expectation_problems("operator", remote, scn))
    assert not problems, "\n".join(problems)


def test_the_table_meets_every_outcome() -> None:
    """The table itself: every phase, reason and outcome the acceptance line names."""
    seen = {v for s in SCENARIOS for v in s.phases.values()}
    assert {("Succeeded", "Promoted", "Promoted"), ("Succeeded", "Rejected", "Rejected"),
            ("Failed", "CandidateCrashed", None), ("Failed", "RunsLost", None),
            ("Duplicate", "DuplicateCandidate", None), ("Invalid", "InvalidSpec", None),
            ("Invalid", "DiffDoesNotApply", None), ("Conflict", "RebaseConflict", None),
            GONE} <= seen
    kinds = {type(step) for s in SCENARIOS for step in s.steps}
    assert {Delete, Down, Up, Vanish} <= kinds
    assert any(s.measured is None and any(isinstance(x, Finish) and x.run == BASELINE
                                          and x.harness.status != "succeeded" for x in s.steps)
               for s in SCENARIOS)
