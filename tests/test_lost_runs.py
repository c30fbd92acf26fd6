"""A lost run is run again, on the local backend with real processes (issue 45).

A run whose processes die without the harness's verdict (the machine lost them) is recorded
once as a `lost` try, never as a measurement, and the same program runs again at its place
as `<run>-t2`, whose result decides. The same holds where the lab directory was copied to a
new place with a run in flight and the old run died: the new controller finds the run lost.

The paired decisions, the master's runs lost mid-decision, and the bound (RunsLost, then the
change applied again continues from its pairs) run through both front ends in
tests/test_one_engine.py; the Hugging Face stand-in's lost jobs in tests/test_hf_backend.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

from controller.local import LocalLab, init_lab
from labkit import spec_from_edit

MASTER_VAL = 9.9  # the baseline is not what these tests are about


def make_lab(root: Path) -> LocalLab:
    lab = init_lab(root, profile="tiny", data="synthetic", budget=1, min_delta=0)
    lab.repo.set_master_metric(MASTER_VAL)
    lab.apply_file(spec_from_edit(lab, "warmdown", "WARMDOWN_RATIO = 0.5",
                                  "WARMDOWN_RATIO = 0.4", "A slightly shorter warmdown."), "test")
    return lab


def status(root: Path, name: str) -> dict:
    try:
        return json.loads((root / ".autolab" / "status" / f"{name}.json").read_text())["status"]
    except (OSError, ValueError, KeyError):
        return {}


def step_until(lab: LocalLab, done, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        lab.step()
        if done():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: {status(lab.root, 'warmdown')}")


def launched(root: Path, run: str) -> dict:
    path = root / ".autolab" / "runs" / run / "launch.json"
    return json.loads(path.read_text()) if path.exists() else {}


def kill_tree(pid: int) -> None:
    """SIGKILL a run's harness and everything under it, as a lost machine ends them."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(text[text.rfind(")") + 2:].split()[1])
    tree, grew = {pid}, True
    while grew:
        grew = False
        for p, parent in parents.items():
            if parent in tree and p not in tree:
                tree.add(p)
                grew = True
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rows(lab: LocalLab) -> list[tuple[str, str]]:
    return [(r["run_id"], r["status"]) for r in lab.ledger.rows()
            if r["experiment_id"] == "warmdown"]


def assert_run_again_and_decided(lab: LocalLab) -> None:
    """The killed try is one `lost` row and a lost run on the status; its retry decided."""
    st = status(lab.root, "warmdown")
    assert st["phase"] == "Succeeded", st
    assert [(x["run"], x["state"], x["program"], x["place"]) for x in st["lostRuns"]] == \
        [("exp-warmdown-1", "lost", "candidate", 1)]
    assert st["run"] == "exp-warmdown-1-t2"
    assert rows(lab) == [("exp-warmdown-1", "lost"), ("exp-warmdown-1-t2", "succeeded")]
    lost, measured = [r for r in lab.ledger.rows() if r["experiment_id"] == "warmdown"]
    assert lost["val_bpb"] == "" and float(measured["val_bpb"]) == st["metrics"]["val_bpb"]
    result = json.loads((lab.root / ".autolab/runs/exp-warmdown-1-t2/result.json").read_text())
    assert result["metrics"]["val_bpb"] == st["metrics"]["val_bpb"]  # the retry's own result
    assert not (lab.root / ".autolab/runs/exp-warmdown-1/result.json").exists()


def test_a_run_whose_processes_are_killed_is_lost_and_run_again(tmp_path):
    lab = make_lab(tmp_path / "lab")
    step_until(lab, lambda: launched(lab.root, "exp-warmdown-1").get("pid"), 60,
               "the run to start")
    kill_tree(launched(lab.root, "exp-warmdown-1")["pid"])
    step_until(lab, lambda: status(lab.root, "warmdown").get("phase") == "Succeeded", 120,
               "the retry to decide")
    assert_run_again_and_decided(lab)


def test_a_lab_copied_with_a_run_in_flight_finds_the_run_lost_and_runs_it_again(tmp_path):
    """The lab moved (copied, symlinks kept) while a run was in flight, and the old run died
    with its machine: the copy's controller never counts the run as measured; it runs it
    again and the decision finishes there."""
    old = make_lab(tmp_path / "old")
    step_until(old, lambda: status(old.root, "warmdown").get("phase") == "Running", 60,
               "the run to start")
    shutil.copytree(old.root, tmp_path / "new", symlinks=True)
    kill_tree(launched(old.root, "exp-warmdown-1")["pid"])
    del old
    new = LocalLab(tmp_path / "new")
    step_until(new, lambda: status(new.root, "warmdown").get("phase") == "Succeeded", 120,
               "the retry to decide in the copy")
    assert_run_again_and_decided(new)
    assert launched(new.root, "exp-warmdown-1-t2")["cmd"]  # launched from the copy
    assert str(tmp_path / "new") in str(new.backend_for("local").run_dir("exp-warmdown-1-t2"))
