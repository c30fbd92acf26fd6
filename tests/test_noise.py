"""The lab's noise: measured by repeat runs of the master, kept per profile and budget, and
used by `minDelta: auto` (the margin) and the confirm test."""

from __future__ import annotations

import json
import re
import types

import pytest
import yaml

from controller.cli.lab import init_lab
from controller.core import reconcile
from controller.core.noise import CONFIRM_SEEDS
from controller.local import LAB_FILE, LocalLab
from labkit import InstantBackend, run_until_done, spec_from_edit

# What the stand-in backend measures: the master at 1.000 +- 0.01 by harness seed, and a
# candidate that sets MATRIX_LR to 0.03 at 0.98 (better by 2 sigma: inside the auto margin).
# Confirm runs take seeds drawn at random (controller.core.noise.confirm_seeds), so the stand-in
# measures them by their place, which their names say (`exp-<name>-<attempt>-c<i>`, `-m<i>`):
# the i-th of each program at BY_PLACE[i], paired as the seed pairs them.
BY_SEED = {0: 1.0, 1: 0.99, 2: 1.01, 3: 1.0, 4: 0.99, 5: 1.01}
BY_PLACE = {1: 0.99, 2: 1.01}


def place(req) -> int | None:
    """The place i of a confirm run, from its name; None for any other run."""
    m = re.search(r"-[cm](\d+)$", req.run)
    return int(m[1]) if m else None


def base(req, default: float | None = None) -> float:
    """The master's value for this run: by place for a confirm run, by seed otherwise."""
    table, key = (BY_PLACE, place(req)) if place(req) is not None else (BY_SEED, req.seed)
    noise = re.search(r"^noise-.*-s(\d+)$", req.run)  # a noise run: by its place (its seed is secret)
    if noise:
        table, key = BY_SEED, int(noise[1])
    return table[key] if default is None else table.get(key, default)


def measured(req) -> float:
    return base(req) - (0.02 if "MATRIX_LR = 0.03" in req.candidate_source else 0.0)


def confirming_lab(tmp_path, confirm_runs: int):
    """A tiny lab (`autolab init`) that confirms every improvement with `confirm_runs` runs of
    each program (`minDelta: auto`)."""
    root = tmp_path / "lab"
    init_lab(root, profile="tiny", data="synthetic", budget=5)
    doc = yaml.safe_load((root / LAB_FILE).read_text())
    doc["spec"]["promotion"] = {"minDelta": "auto", "confirmRuns": confirm_runs}
    (root / LAB_FILE).write_text(yaml.safe_dump(doc))
    return LocalLab(root)


@pytest.mark.parametrize("promotion,runs", [({"minDelta": "auto", "noiseRuns": 3}, 3),
                                            (None, 5)], ids=["auto", "unsaid"])
def test_min_delta_auto_measures_the_noise_first_then_judges_with_it(tmp_path, monkeypatch,
                                                                     promotion, runs):
    """`auto`, and a lab that does not say (auto is the default, with five noise runs): a
    2-sigma "win" is noise."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    root = tmp_path / "lab"
    init_lab(root, profile="tiny", data="synthetic", budget=5)
    doc = yaml.safe_load((root / LAB_FILE).read_text())
    doc["spec"].pop("promotion", None)
    if promotion is not None:
        doc["spec"]["promotion"] = promotion
    (root / LAB_FILE).write_text(yaml.safe_dump(doc))
    lab = LocalLab(root)
    backend = InstantBackend(measured)
    lab.backends["local"] = backend
    lab.apply_file(spec_from_edit(lab, "lr-03", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"), "t")
    settled = run_until_done(lab)
    # the baseline (seed 0), then the repeat runs with harness seeds 1..runs, then the experiment
    # (a noise run's seed comes from the lab's secret: no run can tell it is one)
    assert [r for r in backend.requests] == [
        "baseline-default-" + lab.repo.master().hash[:10] + "-1",
        *[f"noise-default-{lab.repo.master().hash[:10]}-s{s}" for s in range(1, runs + 1)],
        "exp-lr-03-1"]
    assert all(q.seed > CONFIRM_SEEDS for r, q in backend.requests.items()
               if r.startswith("noise-"))
    noise = json.loads((root / "research" / "live" / "noise.json").read_text())
    assert noise["values"] == [BY_SEED[s] for s in range(1, runs + 1)] and noise["sigma"] == 0.01
    assert (noise["profile"], noise["budgetSeconds"]) == ("tiny", 5)
    st = settled["lr-03"]
    # 0.02 better than the master's mean (1.0), inside 3.5 * 0.01 * sqrt(2) = 0.0495
    assert (st["phase"], st["outcome"]) == ("Succeeded", "Rejected")
    assert "by more than 0.0494975" in st["message"] and "inside the lab's noise" in st["message"]
    statuses = [r["status"] for r in lab.ledger.rows()]
    assert statuses == ["baseline"] + ["noise"] * runs + ["succeeded"]


def test_noise_mining_with_variants_that_change_nothing_buys_no_promotion(tmp_path, monkeypatch):
    """The default lab (`minDelta: auto`, confirm runs unsaid) against an agent that applies
    variants that change nothing but the draw (another SEED) until one run is lucky: every
    lucky first run goes to confirm runs, which it does not pass, and the master stays. A real
    gain of the same size on every seed passes them and is promoted at their mean."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    root = tmp_path / "lab"
    init_lab(root, profile="tiny", data="synthetic", budget=5)  # writes minDelta auto

    def draw(req) -> float:
        src = req.candidate_source
        if "MATRIX_LR = 0.03" in src:
            return base(req) - 0.07 - (0.01 if req.seed == 0 else 0.0)  # real, lucky too
        if "SEED = 42 +" not in src and req.seed == 0:
            return 0.90                              # the lucky draw that picked the win
        return base(req)                             # otherwise the master's own runs

    lab = LocalLab(root)
    backend = InstantBackend(draw)
    lab.backends["local"] = backend
    master = lab.repo.master().hash
    for k in (3, 4):
        lab.apply_file(spec_from_edit(lab, f"seed-{k}", "SEED = 42 +", f"SEED = 4{k} +"), "t")
    st = run_until_done(lab)
    for k in (3, 4):
        s = st[f"seed-{k}"]
        assert (s["phase"], s["outcome"], s["verdict"]) == ("Succeeded", "Rejected", "WithinNoise")
        assert [r for r in backend.requests if r.startswith(f"exp-seed-{k}-")] == [
            f"exp-seed-{k}-1", f"exp-seed-{k}-1-c1", f"exp-seed-{k}-1-m1", f"exp-seed-{k}-1-m2",
            f"exp-seed-{k}-1-c2"]
    assert lab.repo.master().hash == master
    rows = lab.ledger.rows()
    assert not any(r["promoted"] == "1" for r in rows)
    lab.apply_file(spec_from_edit(lab, "lr-03", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"), "t")
    s = run_until_done(lab)["lr-03"]
    assert (s["phase"], s["outcome"], s["verdict"]) == ("Succeeded", "Promoted", "Confirmed")
    assert lab.repo.master().experiment == "lr-03"
    assert lab.repo.master().val_bpb == 0.93  # the confirm runs' mean, not 0.92
    # Each confirm run pairs the candidate and the master on one harness seed that no noise run
    # took: where a machine reproduces a seed, a master confirm run on a noise run's seed would
    # repeat that run's value, and the test (which pools the noise runs) would count it twice.
    # And no seed says the run's place (CONFIRM_SEEDS + i did): the seeds are the ones drawn at
    # random when the confirm runs started, kept in the status.
    seeds = {r: q.seed for r, q in backend.requests.items()}
    noise_seeds = {q for r, q in seeds.items() if r.startswith("noise-")}
    confirm_seeds = {r.rsplit("-", 1)[1]: q for r, q in seeds.items() if r.startswith("exp-lr-03-1-")}
    assert len(noise_seeds) == 5 and all(q > CONFIRM_SEEDS for q in noise_seeds)
    assert sorted(confirm_seeds) == ["c1", "c2", "m1", "m2"]
    assert confirm_seeds["c1"] == confirm_seeds["m1"] and confirm_seeds["c2"] == confirm_seeds["m2"]
    assert confirm_seeds["c1"] != confirm_seeds["c2"]
    assert [confirm_seeds["c1"], confirm_seeds["c2"]] == s["confirm"]["seeds"]
    assert not {0, *noise_seeds} & set(confirm_seeds.values())
    assert all(q > CONFIRM_SEEDS for q in confirm_seeds.values())
    assert [confirm_seeds["c1"], confirm_seeds["c2"]] != [CONFIRM_SEEDS + 1, CONFIRM_SEEDS + 2]


def slowing_candidate(leaves_slow):
    """A stand-in measurement: the master at `base`, and a candidate (the master's program with
    SEED = 47 +, lucky on its first run: 0.90) that leaves the machine slow for the next run,
    0.08 of its val_bpb, after each of its runs that `leaves_slow(request)` picks (a hot GPU,
    a page cache emptied of the shards: nothing left behind that a check could find)."""
    last = {"slow": False}

    def draw(req) -> float:
        ours = "SEED = 47 +" in req.candidate_source
        slowed = 0.08 if last["slow"] else 0.0  # the machine as the run before left it
        last["slow"] = ours and leaves_slow(req)
        if ours and req.seed == 0:
            return 0.90 + slowed
        return base(req, 1.0) + slowed

    return draw


def test_a_candidate_that_leaves_the_machine_slow_for_the_next_run_wins_nothing(tmp_path,
                                                                                monkeypatch):
    """Runs share a machine one after another, and a candidate may leave it slower than it
    found it without leaving a process or a file (a hot GPU, a page cache emptied of the
    shards): the run after it trains fewer tokens in its budget. Here that costs the next run
    0.08 of val_bpb, and the candidate is the master's program with another SEED, lucky on its
    first run, in a lab that confirms with five runs of each. The confirm runs go c1 m1 m2 c2
    c3 m3 m4 c4 c5 m5: as many master runs as candidate runs come after a candidate run, the
    after-effect cancels, and the master stays. (In the order c1 m1 c2 m2 ... every master run
    came after a candidate run and four of five candidate runs did not: the candidate won by
    0.064, more than five standard errors.)"""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = confirming_lab(tmp_path, 5)
    backend = InstantBackend(slowing_candidate(lambda req: True))
    lab.backends["local"] = backend
    master = lab.repo.master().hash
    lab.apply_file(spec_from_edit(lab, "hot", "SEED = 42 +", "SEED = 47 +"), "t")
    s = run_until_done(lab)["hot"]
    assert (s["phase"], s["outcome"], s["verdict"]) == ("Succeeded", "Rejected", "WithinNoise")
    assert lab.repo.master().hash == master
    assert [r.rsplit("-", 1)[1] for r in backend.requests if r.startswith("exp-hot-1-")] == [
        "c1", "m1", "m2", "c2", "c3", "m3", "m4", "c4", "c5", "m5"]
    assert s["confirm"]["candidate"] == s["confirm"]["master"]  # each pair on its own seed


def test_a_candidate_that_reads_its_place_from_its_seed_wins_nothing(tmp_path, monkeypatch):
    """The ABBA order cancels what a candidate leaves on the machine only while the candidate
    cannot tell which run comes after it. Confirm seeds used to count up (the i-th run of each
    program on 1000 + i), the seed reaches the candidate ($AUTOLAB_SEED), and the run after c_i
    is the master's exactly when i is odd (c1 -> m1, c2 -> c3, c3 -> m3, ...). This candidate
    (the master's program with another SEED, lucky on its first run) reads i from its seed and
    leaves the machine slow (0.08 of the next run's val_bpb) only after an odd one: with seeds
    1001.. it slowed m1, m3 and m5 and none of its own runs, and five confirm runs each promoted
    it (3.2 standard errors where 2.2 were needed). The seeds are now drawn at random and kept
    in the status, so what it reads is a coin toss: the slowdowns fall on its own runs as on the
    master's, and the master stays. One pattern of five tosses in 32 would still slow m1, m3,
    m5 alone, about as often as noise passes the test; the lab's draw is pinned here (two labs,
    entropy 1 and 2) so the test is repeatable, and the two labs' seeds differ at every place:
    they are not a function of it."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    seeds = {}
    for entropy in (1, 2):
        # The front end's draw (World.entropy), pinned for this lab.
        monkeypatch.setattr(reconcile, "secrets",
                            types.SimpleNamespace(randbits=lambda bits, e=entropy: e),
                            raising=False)
        lab = confirming_lab(tmp_path / f"entropy-{entropy}", 5)
        # Its place, if seeds still told it (1000 + i); after an odd i the master's run is next.
        backend = InstantBackend(slowing_candidate(
            lambda req: 0 < req.seed - CONFIRM_SEEDS and (req.seed - CONFIRM_SEEDS) % 2 == 1))
        lab.backends["local"] = backend
        master = lab.repo.master().hash
        lab.apply_file(spec_from_edit(lab, "sly", "SEED = 42 +", "SEED = 47 +"), "t")
        s = run_until_done(lab)["sly"]
        assert (s["phase"], s["outcome"], s["verdict"]) == ("Succeeded", "Rejected",
                                                          "WithinNoise"), s["message"]
        assert lab.repo.master().hash == master
        assert not any(r["promoted"] == "1" for r in lab.ledger.rows())
        got = [(backend.requests[f"exp-sly-1-c{i}"].seed, backend.requests[f"exp-sly-1-m{i}"].seed)
               for i in range(1, 6)]
        assert all(c == m for c, m in got)  # paired
        seeds[entropy] = [c for c, _ in got]
        assert seeds[entropy] == s["confirm"]["seeds"]
    assert all(a != b for a, b in zip(seeds[1], seeds[2])), seeds


def test_each_confirm_test_against_one_master_sets_a_higher_bar(tmp_path, monkeypatch):
    """A lab that confirms every improvement (`confirmRuns: 2`) against an agent that sends
    variant after variant that changes nothing (another SEED) until confirm runs are lucky:
    the k-th confirm test against one master is made at 2 * 0.025 / (k * (k + 1)), so what the
    first test would pass (a 0.032 lead, 2.8 standard errors) the second does not, and the
    tries together buy at most 0.05 of a false promotion, not 0.0125 each."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = confirming_lab(tmp_path, 2)

    def draw(req) -> float:
        src = req.candidate_source
        if req.seed == 0 and ("SEED = 43 +" in src or "SEED = 44 +" in src):
            return 0.97                                # a first run that beat the master
        if "SEED = 44 +" in src:
            return base(req) - 0.032                   # and lucky confirm runs
        return base(req)

    lab.backends["local"] = InstantBackend(draw)
    master = lab.repo.master().hash
    verdicts = {}
    for k in (3, 4):  # one after the other: the second is the second test against the master
        lab.apply_file(spec_from_edit(lab, f"seed-{k}", "SEED = 42 +", f"SEED = 4{k} +"), "t")
        s = run_until_done(lab)[f"seed-{k}"]
        assert (s["phase"], s["outcome"], s["verdict"]) == ("Succeeded", "Rejected",
                                                          "WithinNoise"), s["message"]
        verdicts[k] = s["confirm"]["verdict"]
    assert (verdicts[3]["tries"], verdicts[3]["alpha"]) == (1, 0.025)
    assert (verdicts[4]["tries"], verdicts[4]["alpha"]) == (2, round(0.05 / 6, 6))
    assert 0.031 < verdicts[4]["difference"] < 0.033
    assert "t-test at 0.00833" in verdicts[4]["explain"]
    assert lab.repo.master().hash == master
    assert not any(r["promoted"] == "1" for r in lab.ledger.rows())


def test_a_candidate_that_voids_its_unlucky_confirm_runs_still_spends_its_tries(tmp_path,
                                                                                monkeypatch):
    """A candidate that can end its own run as a harness error (after training, when its loss
    says whether the draw was lucky) drops every unlucky confirm series: those experiments end
    NotConfirmed with no test made. Counting only the tests made, the one series it lets finish
    was tested as the first, at 0.025, and a 0.032 lead of pure luck (2.8 standard errors)
    passed it. Every series drawn against the master counts, whatever ended it: the third is
    tested at 2 * 0.025 / 12."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = confirming_lab(tmp_path, 2)

    def draw(req) -> float | None:
        src = req.candidate_source
        if req.seed == 0 and "SEED = 42 +" not in src:
            return 0.97                                # every variant's first run is lucky
        if place(req) is not None and req.run.split("-")[-1].startswith("c") \
                and ("SEED = 43 +" in src or "SEED = 44 +" in src):
            return None                                # unlucky by its loss: voided
        if "SEED = 45 +" in src:
            return base(req) - 0.032                   # the lucky series, let finish
        return base(req)

    lab.backends["local"] = InstantBackend(draw)
    master = lab.repo.master().hash
    for k in (3, 4, 5):
        lab.apply_file(spec_from_edit(lab, f"seed-{k}", "SEED = 42 +", f"SEED = 4{k} +"), "t")
        s = run_until_done(lab)[f"seed-{k}"]
        if k < 5:
            assert (s["outcome"], s["reason"]) == ("Rejected", "NotConfirmed"), s["message"]
    assert (s["phase"], s["outcome"], s["verdict"]) == ("Succeeded", "Rejected", "WithinNoise"), \
        s["message"]
    verdict = s["confirm"]["verdict"]
    assert (verdict["tries"], verdict["alpha"]) == (3, round(0.05 / 12, 6)), verdict
    assert 0.031 < verdict["difference"] < 0.033
    assert lab.repo.master().hash == master
    assert not any(r["promoted"] == "1" for r in lab.ledger.rows())


def test_a_promoted_program_cannot_tell_a_noise_run_by_its_seed(tmp_path, monkeypatch):
    """A real gain (promoted honestly) that carries a payload for the noise runs' seeds alone:
    there it trains a fixed model (no spread, 0.05 worse). Its own first run (seed 0) and confirm
    runs (drawn above CONFIRM_SEEDS) never see it. When the noise is measured again on it
    (`autolab noise`), seeds 1..N fired the payload: sigma 0, margin 0, a reference 0.04 too
    high, and the next no-op variant was promoted. The noise runs' seeds now come from the lab's
    secret and look like any confirm seed."""
    import random as _random
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    root = tmp_path / "lab"
    init_lab(root, profile="tiny", data="synthetic", budget=5)
    rng = _random.Random(3)
    drawn: dict = {}

    def draw(req) -> float:
        if req.run not in drawn:
            v = 1.0 + rng.gauss(0, 0.01)
            if "MATRIX_LR = 0.03" in req.candidate_source:
                v -= 0.08
                if 1 <= req.seed <= 20:          # the payload: "this is a noise run"
                    v = 1.05
            drawn[req.run] = round(v, 6)
        return drawn[req.run]

    lab = LocalLab(root)
    backend = InstantBackend(draw)
    lab.backends["local"] = backend
    lab.apply_file(spec_from_edit(lab, "real", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"), "t")
    assert run_until_done(lab)["real"]["outcome"] == "Promoted"
    for _ in range(50):  # `autolab noise --runs 5` on the new master
        if lab.engine.measure_noise(5).state == "measured":
            break
    doc = lab.engine.noise_record()
    assert doc["master"] == lab.repo.master().hash
    assert doc["sigma"] > 0.001 and max(doc["values"]) < 1.0  # the payload never fired
    seeds = [q.seed for r, q in backend.requests.items() if r.startswith("noise-")]
    assert len(seeds) == 10 and all(s > CONFIRM_SEEDS for s in seeds)
