"""A candidate's evaluation is bounded by the master's own, not only by the profile's limit.

A model that is legal but slow to score would otherwise hold a GPU for the profile's whole
`eval_timeout` (600 s on the default profile, some forty times the seed's evaluation on an
H200), once per small edit. The controller learns how long the master took to be evaluated
(its baseline, or the run that promoted it) and asks the harness for at most
EVAL_LIMIT_FACTOR times that (`run.py --eval-limit`); the harness holds the run to it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest

from controller.backends.local import LocalBackend
from controller.core.evaluation import EVAL_LIMIT_FACTOR, EVAL_LIMIT_FLOOR, evaluation_limit
from controller.local import LocalLab, init_lab
from labkit import InstantBackend, spec_from_edit
from test_start_ahead import SLOW_NEW, SLOW_OLD, request


@pytest.mark.parametrize("master_seconds, profile_limit, limit", [
    (40.0, 600.0, 40.0 * EVAL_LIMIT_FACTOR),   # five times the master's
    (3.0, 600.0, EVAL_LIMIT_FLOOR),            # never less than the floor
    (200.0, 600.0, None),                      # the profile's is the tighter: it holds
    (40.0, None, 40.0 * EVAL_LIMIT_FACTOR),    # no profile limit known
    (None, 600.0, None), (math.nan, 600.0, None), (-1.0, 600.0, None), (0, 600.0, None),
    (True, 600.0, None), ("40", 600.0, None),  # not a measurement: the profile's
])
def test_the_limit_is_a_few_times_the_masters_evaluation(master_seconds, profile_limit, limit):
    assert evaluation_limit(master_seconds, profile_limit) == limit


def lab_with(tmp_path, evaluate_seconds) -> tuple[LocalLab, InstantBackend]:
    root = tmp_path / "lab"
    init_lab(root, profile="default", data="synthetic", budget=5, min_delta=0)  # eval_timeout 600
    lab = LocalLab(root)
    better = {"MATRIX_LR = 0.03": 0.9, "MATRIX_LR = 0.04": 0.8}
    backend = InstantBackend(
        lambda req: next((v for k, v in better.items() if k in req.candidate_source), 1.0),
        evaluate_seconds)
    lab.backends["local"] = backend
    return lab, backend


def run_all(lab: LocalLab) -> None:
    for _ in range(30):
        if lab.step().done:
            return
    raise AssertionError("the lab did not settle")


def test_each_candidate_is_held_to_five_times_the_evaluation_of_the_master_it_competes_with(
        tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    # The baseline's model is scored in 40 s, the first winner's in 70 s.
    lab, backend = lab_with(tmp_path, lambda req: 70.0 if "MATRIX_LR = 0.03" in req.candidate_source
                            else 40.0)
    seed = lab.repo.master().hash
    lab.apply_file(spec_from_edit(lab, "lr-03", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"), "t")
    run_all(lab)
    kept = json.loads((lab.root / "research" / "live" / "evaluation.json").read_text())
    assert backend.requests["exp-lr-03-1"].eval_limit == 200.0  # 5 x the baseline's 40 s
    assert [r.eval_limit for n, r in backend.requests.items() if n.startswith("baseline-")] == [None]
    promoted = lab.repo.master()
    assert promoted.hash != seed and promoted.experiment == "lr-03"
    assert (kept["master"], kept["evaluateSeconds"]) == (promoted.hash, 70.0)
    # The next candidate competes with lr-03, scored in 70 s: it may take 350 s.
    lab.apply_file(spec_from_edit(lab, "lr-04", "MATRIX_LR = 0.03", "MATRIX_LR = 0.04"), "t")
    run_all(lab)
    assert backend.requests["exp-lr-04-1"].eval_limit == 350.0


def test_a_lab_that_never_learned_its_masters_evaluation_time_keeps_the_profiles_limit(
        tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab, backend = lab_with(tmp_path, None)  # a harness that does not report it
    lab.apply_file(spec_from_edit(lab, "lr-03", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"), "t")
    run_all(lab)
    assert backend.requests["exp-lr-03-1"].eval_limit is None
    assert not (lab.root / "research" / "live" / "evaluation.json").exists()


def test_the_harness_fails_a_model_slower_to_score_than_the_limit_it_was_given(tmp_path, monkeypatch):
    """Real harness, tiny CPU profile (eval_timeout 120 s): a model that takes minutes to score,
    given 4 s, is the candidate's failure after 4 s of evaluation (twice: once more alone, as
    the controller answers its hand-back), not 120."""
    monkeypatch.setenv("AUTOLAB_UNSAFE_NO_SANDBOX", "1")
    monkeypatch.setenv("AUTOLAB_GPUS", "")
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=2)
    backend = LocalBackend(lab.root)
    source = lab.repo.master_source()
    assert source.count(SLOW_OLD) == 1
    req = dataclasses.replace(request(lab, source.replace(SLOW_OLD, SLOW_NEW), "exp-slow-1"),
                              eval_limit=4.0, slot="cpu")
    began = time.monotonic()
    backend.submit(req)
    obs = backend.observe("exp-slow-1")
    for _ in range(1200):
        if obs.state not in ("queued", "running"):
            break
        if obs.handback:  # it may have been slowed by a neighbour: the controller's answer
            backend.give_back("exp-slow-1")
        time.sleep(0.2)
        obs = backend.observe("exp-slow-1")
    assert (obs.state, obs.result["reason_code"]) == ("failed", "EvaluationFailed"), obs.message
    assert "took longer than 4s" in obs.result["reason"]
    assert time.monotonic() - began < 100  # start-up, 2 s of training, 2 x 4 s: not 120 s
