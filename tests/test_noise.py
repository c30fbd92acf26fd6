"""Promotion on paired runs, through the real local loop: places on the lab's secret seeds, the
master's values kept and reused, decisions after each pair, and what `autolab noise` reports.

The stand-in backend measures a run by its harness seed the way a GPU does (the notes in
`bench/perf/promotion_bench.py`): a part shared by every program at that seed (the data order),
an initialisation part that a change to `SEED` draws again, a gain, and a little noise of the
GPU's own.
"""

from __future__ import annotations

import json
import random

import pytest
import yaml

from controller.cli.main import main
from controller.core.noise import PLACE_SEEDS, lord_level, place_seed
from controller.engine import measure_noise, noise_record
from controller.local import LAB_FILE, LocalLab, init_lab
from labkit import InstantBackend, run_until_done, spec_from_edit


def make_lab(tmp_path, promotion: dict | None = None) -> LocalLab:
    """A tiny lab as `autolab init` writes it (promotion unsaid: `minDelta: auto`)."""
    root = tmp_path / "lab"
    init_lab(root, profile="tiny", data="synthetic", budget=5)
    if promotion is not None:
        doc = yaml.safe_load((root / LAB_FILE).read_text())
        doc["spec"]["promotion"] = promotion
        (root / LAB_FILE).write_text(yaml.safe_dump(doc))
    return LocalLab(root)


class Gpu:
    """val_bpb = 1 + data(seed) + init(SEED line, seed) - gain(source) + noise, each part drawn
    once per key from one generator (so a test is repeatable)."""

    def __init__(self, gains: dict[str, float], data=0.005, init=0.004, gpu=0.0005, seed=1):
        self.rng = random.Random(seed)
        self.gains, self.sd = gains, {"data": data, "init": init, "gpu": gpu}
        self.parts: dict = {}
        self.runs: dict = {}

    def part(self, kind: str, key) -> float:
        if (kind, key) not in self.parts:
            self.parts[(kind, key)] = self.rng.gauss(0.0, self.sd[kind])
        return self.parts[(kind, key)]

    def __call__(self, req) -> float:
        if req.run not in self.runs:
            src = req.candidate_source
            seed_line = next(line for line in src.splitlines() if line.startswith("SEED ="))
            v = 1.0 + self.part("data", req.seed) + self.part("init", (seed_line, req.seed))
            v -= sum(g for marker, g in self.gains.items() if marker in src)
            self.runs[req.run] = round(v + self.rng.gauss(0.0, self.sd["gpu"]), 6)
        return self.runs[req.run]


def places_of(lab: LocalLab, backend: InstantBackend) -> dict[str, int]:
    """The place of every run the backend was asked for, read back from its seed."""
    by_seed = {place_seed(lab.engine.campaign.noise_key(), i): i for i in range(1, 60)}
    return {run: by_seed.get(req.seed) for run, req in backend.requests.items()}


def test_a_real_gain_is_promoted_on_paired_runs_and_its_runs_become_the_masters(tmp_path,
                                                                              monkeypatch, capsys):
    """A gain of 0.006 where seeds spread 0.0064 and a seed twice 0.0007 (the scale measured on
    an H100 at 45 s): the first run is compared with the master's baseline on the same seed,
    and a few more pairs promote it. No noise is measured first. The new master's values per
    place are the candidate's own runs, so the next candidate runs no master at those places."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = make_lab(tmp_path)
    backend = InstantBackend(Gpu({"MATRIX_LR = 0.03": 0.006, "WARMDOWN_RATIO = 0.4": 0.0}))
    lab.backends["local"] = backend
    seed_master = lab.repo.master().hash
    lab.apply_file(spec_from_edit(lab, "lr-03", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"), "t")
    st = run_until_done(lab)["lr-03"]
    assert (st["phase"], st["outcome"], st["verdict"]) == ("Succeeded", "Promoted", "Confirmed")
    runs = list(backend.requests)
    assert runs[0] == f"baseline-default-{seed_master[:10]}-1" and runs[1] == "exp-lr-03-1"
    assert not any(r.startswith("noise-") for r in runs), "no calibration before a decision"
    place = places_of(lab, backend)
    assert place[runs[0]] == place["exp-lr-03-1"] == 1  # the baseline is the master at place 1
    n = st["pairs"]["verdict"]["pairs"]
    assert 3 <= n <= 6, st["pairs"]
    for i in range(2, n + 1):  # the candidate and the master on the same seed at each place
        assert place[f"exp-lr-03-1-p{i}"] == place[f"exp-lr-03-1-m{i}"] == i
    seeds = [q.seed for q in backend.requests.values()]
    assert all(s > PLACE_SEEDS for s in seeds) and len(set(seeds)) == n  # none says its place
    # `describe` and `get -o wide` show the pairs, the estimate with its interval, and why
    capsys.readouterr()  # what the loop printed so far
    assert main(["describe", "--lab", str(lab.root), "lr-03"]) == 0
    shown = capsys.readouterr().out
    assert f"Pairs:        against master {seed_master[:12]}" in shown
    assert f"  {n}: " in shown and "(95 % interval)" in shown
    assert "stopped: a real gain" in shown and f"test 1 against its master, level {lord_level(1):.3g} " in shown
    assert main(["get", "--lab", str(lab.root), "-o", "wide"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "PAIRS" in table[0] and "GAIN" in table[0]
    gain = st["pairs"]["verdict"]["gain"]
    assert f"{gain:+.6f} [" in table[1] and f"   {n}   " in table[1]
    master = lab.repo.master()
    assert master.experiment == "lr-03"
    assert master.places == {i + 1: v for i, v in enumerate(st["pairs"]["candidate"])}
    assert master.val_bpb == round(sum(st["pairs"]["candidate"]) / n, 6)
    # the next candidate: no master run at the places the promoted candidate ran
    lab.apply_file(spec_from_edit(lab, "wd-04", "WARMDOWN_RATIO = 0.5",
                                  "WARMDOWN_RATIO = 0.4"), "t")
    st2 = run_until_done(lab)["wd-04"]
    assert st2["outcome"] == "Rejected"
    spent = [r for r in backend.requests if r.startswith("exp-wd-04-")]
    masters = [r for r in spent if "-m" in r]
    place = places_of(lab, backend)
    assert all(place[r] > n for r in masters)
    assert len(spent) - len(masters) == st2["pairs"]["verdict"]["pairs"]


def test_variants_that_change_nothing_buy_no_promotion(tmp_path, monkeypatch):
    """Noise mining: ten variants that change nothing but the initialisation (another SEED),
    each spreading 0.0057 from the master on the same seed (twice the gain above). Each is
    judged on its own pairs' spread; none is promoted, and most stop well before the cap."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = make_lab(tmp_path)
    backend = InstantBackend(Gpu({}, seed=7))
    lab.backends["local"] = backend
    master = lab.repo.master().hash
    for k in range(10):
        lab.apply_file(spec_from_edit(lab, f"seed-{k}", "SEED = 42 +", f"SEED = {50 + k} +"), "t")
    statuses = run_until_done(lab, steps=400)
    # none is promoted: rejected, or (by chance, its interval clear of zero) undecided
    assert all(s["outcome"] in ("Rejected", "Undecided") for s in statuses.values()), \
        {n: s.get("message") for n, s in statuses.items() if s.get("outcome") != "Rejected"}
    assert lab.repo.master().hash == master
    candidate_runs = [r for r in backend.requests if r.startswith("exp-") and "-m" not in r]
    each = sorted(sum(r.startswith(f"exp-seed-{k}-") for r in candidate_runs) for k in range(10))
    assert sum(each) / 10 < lab.lab.pairs_cap, each  # most stop well before the cap
    # each later test against the master is made at a lower level
    tries = sorted(s["tries"] for s in statuses.values())
    assert tries == list(range(1, 11))


def test_a_candidate_that_spreads_wide_makes_only_its_own_test_harder(tmp_path, monkeypatch):
    """A candidate that changes nothing on average but spreads far wider than the master (sd
    0.02 a run: it draws a new model by its own dice). Before pairs, a decision used the
    master's spread, and such a candidate passed 15-47 % of the time. Its test now uses its own
    pairs' spread: in eight labs it is promoted in none."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    promoted = 0
    for trial in range(8):
        lab = make_lab(tmp_path / f"t{trial}")
        gpu, dice = Gpu({}, seed=trial), random.Random(100 + trial)

        def draw(req, gpu=gpu, dice=dice) -> float:
            wild = "MATRIX_LR = 0.05" in req.candidate_source
            return gpu(req) + (dice.gauss(0.0, 0.02) if wild else 0.0)

        lab.backends["local"] = InstantBackend(draw)
        lab.apply_file(spec_from_edit(lab, "wild", "MATRIX_LR = 0.02", "MATRIX_LR = 0.05"), "t")
        promoted += run_until_done(lab)["wild"]["outcome"] == "Promoted"
    assert promoted == 0


def test_a_candidate_that_voids_its_unlucky_runs_still_spends_its_tries(tmp_path, monkeypatch):
    """A candidate that can end its own run as a harness error (after training, when its loss
    says whether the draw was lucky) ends the decision with nothing held against it, and may be
    applied again under a new name. Each try is counted against the master when its first run
    starts, so each is tested at a lower level: 2 * 0.015 / (k * (k + 1))."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = make_lab(tmp_path)
    gpu = Gpu({}, seed=5)

    def draw(req) -> float | None:
        if "SEED = 6" in req.candidate_source:
            if req.run.endswith("-1"):
                return 0.97  # a first run that beat the master
            if "-p" in req.run:
                return None  # and the next, unlucky by its loss: voided
        return gpu(req)

    lab.backends["local"] = InstantBackend(draw)
    for k in range(3):
        lab.apply_file(spec_from_edit(lab, f"void-{k}", "SEED = 42 +", f"SEED = 6{k} +"), "t")
        run_until_done(lab)
    rows = {r["run_id"]: r for r in lab.ledger.rows()}
    # each ended with nothing held against it: its row says error (it may run again)...
    assert [rows[f"exp-void-{k}-1"]["status"] for k in range(3)] == ["error"] * 3
    # ...and each was counted against the master when it began: the third at 0.03 / 12
    tests = json.loads((lab.paths.state / "tests" / f"{lab.repo.master().hash}.json").read_text())
    assert tests == ["void-0", "void-1", "void-2"]


def test_a_candidate_cannot_time_the_machine_against_the_masters_runs(tmp_path, monkeypatch):
    """A candidate that leaves the machine slow (0.03 of the next run's val_bpb) after each of
    its runs, with no process or file left (a hot GPU, an emptied page cache). Where the master
    has no value at a place, the two runs go in an order drawn by a secret coin per place, so
    the slowdowns fall on its own runs as often as on the master's: it is not promoted. A
    master value reused from earlier runs it cannot touch at all."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    promoted = 0
    for trial in range(6):
        lab = make_lab(tmp_path / f"t{trial}")
        gpu = Gpu({}, seed=trial, data=0.004, init=0.0, gpu=0.0003)
        last = {"slow": False}

        def draw(req, gpu=gpu, last=last) -> float:
            slowed = 0.03 if last["slow"] else 0.0
            last["slow"] = "MATRIX_LR = 0.021" in req.candidate_source
            return gpu(req) + slowed

        lab.backends["local"] = InstantBackend(draw)
        lab.apply_file(spec_from_edit(lab, "hot", "MATRIX_LR = 0.02", "MATRIX_LR = 0.021"), "t")
        promoted += run_until_done(lab)["hot"]["outcome"] == "Promoted"
    assert promoted == 0


def test_autolab_noise_says_what_the_lab_can_see_on_which_master(tmp_path, monkeypatch):
    """`autolab noise`: the master at places 1..N (kept on the master, so candidates reuse them)
    and once more at each. It reports the spread across seeds, the spread of the same seed twice
    and the smallest gain detected, names the master it measured, and is not read for another
    master."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = make_lab(tmp_path)
    backend = InstantBackend(Gpu({"MATRIX_LR = 0.03": 0.02}, data=0.005, gpu=0.0005))
    lab.backends["local"] = backend
    for _ in range(40):  # as `autolab noise --runs 4` steps it
        if lab.repo.master().place(1) is None:
            lab.engine.baseline()
        elif measure_noise(lab.engine, 4).state == "measured":
            break
    doc = noise_record(lab.engine)
    assert doc["master"] == lab.repo.master().hash
    assert 0.002 < doc["acrossSeeds"] < 0.015 and doc["paired"] < 0.002
    assert doc["detectable"] == pytest.approx(doc["detectableSds"] * doc["paired"], abs=1e-6)
    assert 1.5 < doc["detectableSds"] < 3.5
    assert sorted(lab.repo.master().places) == [1, 2, 3, 4]
    assert "noise-" in " ".join(backend.requests)
    # a promotion: the record was another master's, so it says nothing now
    lab.apply_file(spec_from_edit(lab, "lr-03", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"), "t")
    assert run_until_done(lab)["lr-03"]["outcome"] == "Promoted"
    runs = [r for r in backend.requests if r.startswith("exp-lr-03-1-m")]
    assert runs == [], "places 1-4 were the master's already: no master run"
    assert noise_record(lab.engine) is None


def test_a_fixed_handicap_does_not_leave_its_spread_behind(tmp_path, monkeypatch):
    """Issue 40: a master with a handicap that spreads four times wider than the fixed program.
    The first fix is promoted; the next true gain, three times the new master's own paired
    spread, is promoted too: no spread measured on the handicapped master enters its test."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = make_lab(tmp_path)
    gpu = Gpu({"MATRIX_LR = 0.03": 0.05, "WARMDOWN_RATIO = 0.4": 0.003}, seed=11,
              data=0.002, init=0.0, gpu=0.001)

    def draw(req) -> float:
        v = gpu(req)
        if "MATRIX_LR = 0.03" not in req.candidate_source:  # the handicap: 4x the spread
            v += 3 * (v - 1.0 + 0.003 * ("WARMDOWN_RATIO = 0.4" in req.candidate_source))
        return round(v, 6)

    lab.backends["local"] = InstantBackend(draw)
    lab.apply_file(spec_from_edit(lab, "fix", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"), "t")
    assert run_until_done(lab)["fix"]["outcome"] == "Promoted"
    lab.apply_file(spec_from_edit(lab, "gain", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"),
                   "t")
    st = run_until_done(lab)["gain"]
    assert st["outcome"] == "Promoted", st["message"]
    assert lab.repo.master().experiment == "gain"
