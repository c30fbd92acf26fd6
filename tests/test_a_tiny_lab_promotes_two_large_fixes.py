"""The tiny profile promotes large fixes (issue 44). The file's name sorts first, so its one long
test (real CPU runs, about 90 s) starts while the rest of the suite runs, not at its end.

A tiny lab made as `autolab init --profile tiny` makes it (paired decisions, `maxPairs: 3`) whose
starting program carries two handicaps: an lm_head learning rate a hundred times too low, and
logits soft-capped at 0.5 (no softmax over logits within +-0.5 gets confident). Each fix is worth more than half of val_bpb. On a loaded 2-core machine
their pairs spread widely, and at the cap of 3 pairs their t fell short while their 95 %
intervals were far from zero (before: both Rejected, "no measurable effect"). Now a decision
whose interval excludes no effect goes on past the cap (`controller.core.noise.hard_cap`), so
both fixes reach the master, one after the other, the second rebased onto the first.

Its runs train for a budget of wall-clock seconds, so a run starved of CPU by the rest of the
suite trains fewer steps than its master did at a quieter moment: in CI (3 workers on 2 cores)
the second fix, worth 70 % of val_bpb, once measured a gain of -0.019 on its first pair and was
rejected. The test asks the scheduler to favour its own processes (nice -10, where it may) so
that it measures the lab's decisions, not the suite's load.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from controller.lab.init import default_max_pairs
from controller.local import LocalLab, init_lab
from labkit import spec_from_edit

HANDICAPS = (("    UNEMBEDDING_LR = 0.02", "    UNEMBEDDING_LR = 0.0002"),
             ("LOGIT_SOFTCAP = 15.0 ", "LOGIT_SOFTCAP = 0.5 "))


@pytest.fixture
def favoured():
    """This worker and the runs it starts at nice -10 (root only), back to its own after."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except PermissionError:
        pass
    yield
    os.setpriority(os.PRIO_PROCESS, 0, before)


def test_two_large_fixes_behind_two_handicaps_both_reach_the_master_on_a_linear_history(
        tmp_path, monkeypatch, favoured):
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    root = tmp_path / "lab"
    # the tiny profile's defaults, at a 2-s budget (the suite's time; the fixes are as large)
    lab = init_lab(root, profile="tiny", data="synthetic", budget=2,
                   max_pairs=default_max_pairs("tiny", None))
    assert lab.lab.pairs_cap == 3 and not lab.lab.one_pair_decides
    src = lab.repo.master_source()
    for good, bad in HANDICAPS:
        assert good in src
        src = src.replace(good, bad, 1)
    (root / lab.lab.surface).write_text(src)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qam",
                    "two handicaps"], cwd=root, check=True)
    lab.repo.seed_master(lab.repo.git("rev-parse", "HEAD").stdout.strip())
    lab = LocalLab(root)
    seed = lab.repo.master()
    for name, (good, bad) in zip(("fix-unembedding", "fix-softcap"), HANDICAPS):
        lab.apply_file(spec_from_edit(lab, name, bad, good), "t")
    deadline = time.monotonic() + 900
    summary = lab.step()
    while not summary.done and time.monotonic() < deadline:
        time.sleep(0.3)
        summary = lab.step()
    assert summary.done, summary.rows
    statuses = {n: st for n, st, _ in summary.rows}
    assert {n: st.get("outcome") for n, st in statuses.items()} == {
        "fix-unembedding": "Promoted", "fix-softcap": "Promoted"}, \
        {n: st.get("message") for n, st in statuses.items()}
    # a linear history: seed -> first fix -> second fix (rebased onto the first), each commit's
    # parent the master before it
    log = lab.repo.git("log", "--first-parent", "--format=%H %P", "-n", "3",
                       lab.repo.master().commit).stdout.split("\n")
    commits = [line.split() for line in log if line]
    assert all(len(c) == 2 for c in commits), commits  # no merges
    final = lab.repo.master_source()
    assert all(good in final and bad not in final for good, bad in HANDICAPS)
    assert seed.hash != lab.repo.master().hash
