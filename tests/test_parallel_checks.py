"""Pre-run checks of a batch of new specs run at once, and decide as if run one at a time.

The checks (apply, commit, compile, hashes) of the new specs of a pass are started together on
the engine's check pool (processes in production; threads here, so a test can see inside a
check); the passes then take their results in the front end's order, so the duplicate lookup
and the in-flight claim are as they were. A result checked against a master that has moved
since is not used: the candidate is checked again against the current one.
"""

from __future__ import annotations

import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from controller.local import init_lab
from controller.core.spec import ExperimentSpec
from controller.engine import Observed
from controller.lab.check_pool import CheckPool
from controller.lab.git import stripspace
from controller.lab.repo import LabRepo
from labkit import InstantBackend, spec_from_edit


@pytest.fixture()
def lab(tmp_path: Path):
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic")
    lab.repo.set_master_metric(1.0)  # measured: no baseline run in the way
    lab.backends["local"] = InstantBackend(lambda req: 1.1)
    lab.engine.hooks = ()
    return lab


def write_spec(lab, doc: dict, age: int = 0) -> None:
    path = lab.experiments_dir / f"{doc['metadata']['name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    t = path.stat().st_mtime - age
    os.utime(path, (t, t))  # older files come first in a pass


def status(lab, name: str) -> dict:
    return lab.read_record(name)["status"]


def test_the_new_specs_of_a_pass_are_checked_at_once(lab, monkeypatch):
    names = [f"seed-{i}" for i in range(4)]
    for i, n in enumerate(names):
        write_spec(lab, spec_from_edit(lab, n, "SEED = 42", f"SEED = {100 + i}"))
    all_under_way = threading.Barrier(len(names), timeout=10)
    real = LabRepo.check

    def check(self, name, spec):
        all_under_way.wait()  # passes only once every check of the batch has started
        return real(self, name, spec)

    monkeypatch.setattr(LabRepo, "check", check)
    lab.engine.checks = CheckPool(executor=ThreadPoolExecutor(len(names)))
    summary = lab.step()
    assert summary.errors == []
    for n in names:
        st = status(lab, n)
        assert st["phase"] not in ("Pending", "Invalid", "Failed"), st
        assert st["candidateHash"] and st["commit"]


def test_a_repeat_in_one_batch_is_the_duplicate_even_when_its_check_ends_first(lab, monkeypatch):
    doc = spec_from_edit(lab, "first", "SEED = 42", "SEED = 7")
    write_spec(lab, doc, age=60)
    write_spec(lab, dict(doc, metadata={"name": "second"}))
    second_checked = threading.Event()
    real = LabRepo.check

    def check(self, name, spec):
        if name == "first":
            assert second_checked.wait(10)
        try:
            return real(self, name, spec)
        finally:
            if name == "second":
                second_checked.set()

    monkeypatch.setattr(LabRepo, "check", check)
    lab.engine.checks = CheckPool(executor=ThreadPoolExecutor(2))
    lab.step()
    assert status(lab, "first")["phase"] not in ("Pending", "Duplicate")
    second = status(lab, "second")
    assert second["phase"] == "Duplicate" and "first" in second["message"]


def test_a_check_made_before_the_master_moved_is_made_again(lab):
    seed = lab.repo.master()
    docs = [spec_from_edit(lab, "late", "SEED = 42", "SEED = 8"),
            spec_from_edit(lab, "other", "SEED = 42", "SEED = 9")]
    lab.engine.checks = CheckPool(executor=ThreadPoolExecutor(2))
    observed = [Observed(name=d["metadata"]["name"], key=d["metadata"]["name"], spec=d["spec"],
                         status={}) for d in docs]
    assert lab.engine.precheck(observed) == 2
    for _, future in lab.engine._prechecks.values():
        assert future.result()[0].parent_hash == seed.hash  # checked against the seed
    winner = spec_from_edit(lab, "winner", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03")
    c = lab.repo.materialise("winner", ExperimentSpec.from_dict(winner["spec"]))
    assert lab.repo.promote("winner", c.commit, 0.9, (c.candidate_hash, c.semantic_hash),
                            seed.hash, "now").promoted
    candidate, duplicate = lab.engine._materialise("late",
                                                   ExperimentSpec.from_dict(docs[0]["spec"]))
    assert duplicate is None
    assert candidate.parent_hash == lab.repo.master().hash and candidate.rebased_from == seed.hash
    assert "MATRIX_LR = 0.03" in lab.repo.candidate_source("late")
    lab.engine.drop_prechecks()
    assert lab.engine._prechecks == {}


@pytest.mark.parametrize("message", [
    "Try it.", "  Leading and trailing spaces.  \n\n\n", "\n\nTwo\n\n\n\nparagraphs\t \n",
    "Tabs\tinside, a # hash line\n# not a comment here\n", "Windows\r\nline ends\r\n",
    "trailing\x0bvertical tab\x0b\nform feed\x0c\n",
])
def test_commit_messages_are_cleaned_as_git_commit_cleans_them(message, tmp_path):
    expected = subprocess.run(["git", "stripspace"], input=message.encode(),
                              capture_output=True, cwd=tmp_path).stdout.decode()
    assert stripspace(message + "\n\nAutolab-Experiment: x") == subprocess.run(
        ["git", "stripspace"], input=(message + "\n\nAutolab-Experiment: x").encode(),
        capture_output=True, cwd=tmp_path).stdout.decode()
    assert stripspace(message) == expected


def test_a_check_in_a_worker_process_is_the_check_made_here(lab):
    """The pool's processes read blobs and move branches through long-lived git processes;
    what they give is what a check in the caller's process gives, refusals included."""
    docs = [spec_from_edit(lab, "in-pool", "SEED = 42", "SEED = 11"),
            spec_from_edit(lab, "refused", "SEED = 42", "SEED = (")]
    pool = CheckPool(workers=1)
    try:
        there = [pool.submit(lab.repo, d["metadata"]["name"],
                             ExperimentSpec.from_dict(d["spec"])).result(timeout=60)
                 for d in docs]
    finally:
        pool.shutdown()
    pooled = {d["metadata"]["name"]: lab.repo.candidate_source(d["metadata"]["name"])
              for d in docs[:1]}
    here = [lab.repo.check(d["metadata"]["name"] + "-here", ExperimentSpec.from_dict(d["spec"]))
            for d in docs]
    for (a, master_a), (b, master_b) in zip(there, here):
        assert master_a == master_b == lab.repo.master().commit
        assert (a.refusal, a.reason, a.message, a.candidate_hash, a.semantic_hash,
                a.parent_hash) == (b.refusal, b.reason, b.message, b.candidate_hash,
                                   b.semantic_hash, b.parent_hash)
    assert there[1][0].reason == "CompileError"
    assert pooled["in-pool"] == lab.repo.candidate_source("in-pool-here")
    assert lab.repo.has_worktree("in-pool") and not lab.repo.has_worktree("refused")


def test_a_started_pool_has_every_worker_ready_before_the_first_check():
    """The operator starts its pool at start-up and waits for it: each worker has been spawned
    and has imported what a check runs, so the first batch of specs waits for neither, and
    the first passes do not share the CPU with the workers' imports."""
    pool = CheckPool(workers=2)
    try:
        assert pool.start(wait=120) is True
        assert len(pool._executor._processes) == 2  # type: ignore[union-attr]
        assert all(p.is_alive() for p in pool._executor._processes.values())  # type: ignore[union-attr]
        assert pool.start(wait=0) is True, "started already: nothing to wait for"
    finally:
        pool.shutdown()
