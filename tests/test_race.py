"""Two winners on one master, decided together: the second is followed up, never lost.

Both were built on the same master and both beat it. Whichever is promoted first, the other
learns that the master moved either before its verdict or from the compare-and-swap of its own
promotion (`promotion_refused` -> MasterMoved). Either way it is rebased onto the new master
and measured there again (reason FollowUp), and ends promoted on top of the first: both
changes are in the final master, and neither experiment is Rejected for MasterMoved.

The local front end is staged so the compare-and-swap itself meets the race: a second
controller (another `autolab run` on the same lab) promotes the first winner in the instant
between the second winner's verdict and its promotion. The operator meets it as a cluster
does: both Jobs end at once, and kopf's handlers decide them side by side.
"""

from __future__ import annotations

import asyncio
import json

import yaml

from controller.backends import Backend
from controller.core.reconcile import RunObservation
from controller.local import LAB_FILE, LocalLab, init_lab
from labkit import spec_from_edit
from test_one_engine import SLOTS, Apply, Finish, OperatorDriver, Scenario, Start, ok
from test_operator import Cluster, cluster

assert cluster  # the emulator fixture of tests/test_operator.py, used here too

A = ("MATRIX_LR = 0.02", "MATRIX_LR = 0.03")
B = ("WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4")


class HeldRuns(Backend):
    """A backend whose runs run until the test ends them (`end`); shared by two controllers."""

    name = "local"

    def __init__(self):
        self.runs: dict[str, dict] = {}

    def submit(self, req):
        self.runs.setdefault(req.run, {"req": req, "val": None})
        return self.observe(req.run)

    def observe(self, run):
        r = self.runs.get(run)
        if r is None:
            return RunObservation(run, "missing")
        if r["val"] is None:
            return RunObservation(run, "running")
        return RunObservation(run, "succeeded", result={"metrics": {"val_bpb": r["val"]}})

    def end(self, run: str, val: float) -> None:
        self.runs[run]["val"] = val

    def cancel(self, run):
        return RunObservation(run, "cancelled")

    def cleanup(self, run):
        pass

    def leftovers(self, run):
        return False


class RaceAtPromotion:
    """The engine's StatusStore, as it is, with one thing added: the moment `name`'s status
    says it is about to promote (stored before the compare-and-swap), `meanwhile` runs."""

    def __init__(self, real, name: str, meanwhile):
        self.real, self.name, self.meanwhile, self.fired = real, name, meanwhile, False

    def read(self, name):
        return self.real.read(name)

    def write_status(self, name, status, previous=None):
        self.real.write_status(name, status, previous)
        promoting = any(c.get("reason") == "Promoting" for c in status.get("conditions") or [])
        if name == self.name and promoting and not self.fired:
            self.fired = True
            self.meanwhile()

    def finalized(self, name):
        self.real.finalized(name)


def test_a_winner_refused_at_the_compare_and_swap_is_followed_up_locally(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    root = tmp_path / "lab"
    init_lab(root, profile="tiny", data="synthetic", budget=5)
    doc = yaml.safe_load((root / LAB_FILE).read_text())
    doc["spec"]["promotion"] = {"minDelta": 0, "confirmRuns": 0}  # one run decides
    doc["spec"]["capacity"] = {"gpuSlots": 2}
    (root / LAB_FILE).write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("AUTOLAB_GPUS", "0,1")
    runs = HeldRuns()
    lab = LocalLab(root)
    lab.backends["local"] = runs
    lab.engine.baseline()
    runs.end(next(iter(runs.runs)), 1.0)  # the master's baseline
    lab.engine.baseline()
    lab.apply_file(spec_from_edit(lab, "tw-a", *A), "t")
    lab.apply_file(spec_from_edit(lab, "tw-b", *B), "t")
    for _ in range(5):
        lab.step()
    assert {"exp-tw-a-1", "exp-tw-b-1"} <= set(runs.runs)
    runs.end("exp-tw-a-1", 0.98)
    runs.end("exp-tw-b-1", 0.975)  # better than both

    other = LocalLab(root)  # a second controller on the same lab
    other.backends["local"] = runs
    lab.engine.statuses = RaceAtPromotion(lab.engine.statuses, "tw-b",
                                          lambda: other.reconcile_one("tw-a"))
    lab.engine.reconcile(lab.statuses.read("tw-b"))  # tw-b's verdict first; tw-a lands during its promotion
    assert lab.engine.statuses.fired and lab.repo.master().experiment == "tw-a"
    st = lab.read_record("tw-b")["status"]
    assert (st["phase"], st["reason"], st["attempt"]) == ("Confirming", "FollowUp", 2), st
    assert "another promotion landed first" in st["message"]
    for _ in range(20):
        lab.step()
        if "exp-tw-b-2" in runs.runs and runs.runs["exp-tw-b-2"]["val"] is None:
            runs.end("exp-tw-b-2", 0.97)
    final = {n: lab.read_record(n)["status"] for n in ("tw-a", "tw-b")}
    assert all(s["outcome"] == "Promoted" for s in final.values()), final
    source = lab.repo.master_source()
    assert A[1] in source and B[1] in source, "both changes are in the final master"
    history = [h.get("experiment") for h in lab.repo.master_doc()["history"]]
    assert history == [None, "tw-a", "tw-b"]
    rows = {r["run_id"]: r for r in lab.ledger.rows()}
    assert rows["exp-tw-b-1"]["reason"] == "FollowUp" and rows["exp-tw-b-2"]["promoted"] == "1"
    assert not any(r.get("reason") == "MasterMoved" for r in rows.values())


async def test_two_winners_finishing_together_both_land_in_the_operator(cluster: Cluster,
                                                                       monkeypatch) -> None:
    """Both Jobs end at once; the operator decides them in whatever order kopf hands them out.
    The one promoted second lands on top of the first after its follow-up run."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    monkeypatch.setenv("AUTOLAB_GPUS", ",".join(str(i) for i in range(SLOTS)))
    scn = Scenario("two-winners", 1.0, (Apply("tw-a", *A), Apply("tw-b", *B),
                                        Start("tw-a"), Start("tw-b")), {}, [], [], [])
    d = OperatorDriver(cluster, scn)
    t = await d.run()  # up to both runs in flight (the driver leaves the operator up at the end)
    assert not t.crashed, t.crashed
    await d.up()
    try:
        jobs = [await d.job_for(n, "started") for n in ("tw-a", "tw-b")]
        await asyncio.gather(d.finish(jobs[0], ok(0.98)), d.finish(jobs[1], ok(0.975)))
        await d.settle()
        follow = [n for n in ("tw-a", "tw-b") if (d.statuses().get(n) or {}).get("reason")
                  == "FollowUp"]
        assert len(follow) == 1, d.statuses()
        run = f"exp-{follow[0]}-2"
        await d.do(Start(run))
        await d.settle()
        await d.do(Finish(run, ok(0.97)))
        await d.settle()
        final = d.statuses()
    finally:
        await d.down()
    assert all(final[n]["outcome"] == "Promoted" for n in ("tw-a", "tw-b")), final
    history = [h.get("experiment") for h in
               json.loads((d.lab_dir / "research/live/master.json").read_text())["history"]]
    assert sorted(history[1:]) == ["tw-a", "tw-b"] and history[-1] == follow[0]
