"""The lab notebook the controller keeps: experiment notes and research/do-not-repeat.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.cli import main as cli
from controller.lab import memory
from controller.lab.paths import LabPaths
from controller.core.reconcile import ledger_row
from controller.core.spec import ExperimentSpec
from controller.local import LocalLab, init_lab

DIFF = ("--- a/bench/train.py\n+++ b/bench/train.py\n@@ -1,3 +1,3 @@\n A = 1\n"
        "-LR = 0.02  # peak learning rate\n+LR = 0.04  # peak learning rate\n C = 3\n")
SURFACE = "bench/train.py"


def row(name: str, campaign: str = "lr", phase: str = "Succeeded", outcome: str = "Rejected",
        delta: float | None = 0.01, val: float | None = 1.01, **st) -> dict:
    """A ledger row as the controller writes it (through reconcile's own ledger_row)."""
    spec = ExperimentSpec(hypothesis=f"{name}: a higher peak LR trains faster.", parent="abcd1234",
                          diff=DIFF, campaign=campaign)
    status = {"phase": phase, "reason": outcome or phase, "message": f"{name} finished.",
              "parentHash": "abcd1234" * 5, "candidateHash": "f" * 40,
              "job": {"backend": "local", "name": f"exp-{name}-1"}, **st}
    if outcome:
        status["outcome"] = outcome
    if val is not None:
        status["metrics"] = {"val_bpb": val, "training_seconds": 300.2}
    if delta is not None:
        status["delta"] = delta
        status["masterValBpb"] = 1.0
    return dict(ledger_row(name, spec, status), created_at="2026-11-29T10:00:00Z"), \
        {"hypothesis": spec.hypothesis, "parent": spec.parent, "diff": DIFF}, status


@pytest.fixture()
def root(tmp_path) -> Path:
    (tmp_path / "research").mkdir()
    return tmp_path


def remember(root: Path, name: str, **kw) -> list[Path]:
    r, spec, status = row(name, **kw)
    return memory.remember(root, SURFACE, r, spec, status)


def test_note_holds_hypothesis_parent_changed_lines_result_delta_and_outcome(root):
    remember(root, "lr-004")
    note = (root / "research" / "experiments" / "lr-004.md").read_text()
    assert note.startswith("# lr-004\n")
    assert "lr-004: a higher peak LR trains faster." in note
    assert "`abcd1234abcd`" in note  # the parent master
    assert "-LR = 0.02  # peak learning rate\n+LR = 0.04  # peak learning rate" in note
    assert " A = 1" not in note, "only the changed lines, not the context"
    assert "1.010000 (master 1.000000, delta +0.010000)" in note
    assert "| outcome | Rejected |" in note and "| campaign | lr |" in note


def test_regressions_and_duplicates_go_to_do_not_repeat_by_campaign(root):
    remember(root, "worse", delta=0.02)
    remember(root, "better", outcome="Promoted", delta=-0.01, val=0.99)
    remember(root, "no-gain", delta=-0.0001, val=0.9999)  # rejected but not a regression
    remember(root, "crashed", phase="Failed", outcome="", val=None, delta=None)
    remember(root, "warm-05", campaign="schedule", delta=0.003)
    remember(root, "again", phase="Duplicate", outcome="", val=None, delta=None,
             duplicateOf="worse")
    dnr = (root / "research" / "do-not-repeat.md").read_text()
    lr, schedule = dnr.split("## lr\n")[1].split("## schedule\n")
    assert "- `worse` (2026-11-29)" in lr and "regressed: val_bpb 1.010000, +0.020000" in lr
    assert "- `again` (" in lr and "duplicate of worse" in lr
    assert "Change: `LR = 0.04  # peak learning rate`" in lr
    assert "- `warm-05` (" in schedule
    for kept_out in ("better", "no-gain", "crashed"):
        assert f"`{kept_out}`" not in dnr
    assert (root / "research" / "experiments" / "crashed.md").exists()


def test_a_difference_inside_the_noise_is_no_measurable_effect_not_a_regression(root):
    remember(root, "worse-by-noise", delta=0.004, verdict="WithinNoise")
    remember(root, "worse-for-real", delta=0.05)
    dnr = (root / "research" / "do-not-repeat.md").read_text()
    assert "`worse-for-real`" in dnr and "`worse-by-noise`" not in dnr
    nme = (root / "research" / "no-measurable-effect.md").read_text()
    assert "- `worse-by-noise` (" in nme and "no measurable effect" in nme
    assert "`worse-for-real`" not in nme


def test_repeat_runs_and_a_follow_ups_first_run_write_no_memory(root):
    r, spec, status = row("confirming", delta=0.03)
    memory.remember(root, SURFACE, dict(r, status="confirm", run_id="exp-confirming-1-c1"),
                    spec, status)
    memory.remember(root, SURFACE, dict(r, reason="FollowUp"), spec, status)
    assert not (root / "research" / "experiments" / "confirming.md").exists()
    assert not (root / "research" / "do-not-repeat.md").exists()


def test_people_may_annotate_and_nothing_is_written_twice(root):
    remember(root, "worse", delta=0.02)
    dnr = root / "research" / "do-not-repeat.md"
    dnr.write_text(dnr.read_text().rstrip("\n") + "\n  - (alice) it diverged at step 40\n\n"
                   "## people's own section\n\nkeep me\n")
    note = root / "research" / "experiments" / "worse.md"
    note.write_text(note.read_text() + "\nMy annotation.\n")
    remember(root, "worse", delta=0.02)
    remember(root, "worse-too", delta=0.05)
    text = dnr.read_text()
    assert text.count("- `worse` (") == 1
    assert "My annotation." in note.read_text()
    lr = text.split("## lr\n")[1].split("## people's own section")[0]
    assert lr.index("(alice) it diverged") < lr.index("- `worse-too` (")
    assert text.endswith("keep me\n")


def test_a_failing_note_never_stops_the_controller_and_report_fills_it_in(tmp_path, capsys):
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic")
    r, spec, status = row("lr-004")
    lab.ledger.append(r)
    lab.write_record("lr-004", {"spec": spec, "status": status})
    blocker = lab.root / "research" / "experiments"
    for f in blocker.iterdir():
        f.unlink()
    blocker.rmdir()
    blocker.write_text("not a directory")  # the note cannot be written
    memory.remember_quietly(LabPaths.of(lab.root), lab.name, lab.lab.surface, r, spec, status)
    assert "could not write the research notes of lr-004" in capsys.readouterr().err
    blocker.unlink()
    fresh = LocalLab(lab.root)
    written = memory.backfill(fresh.root, fresh.lab.surface, fresh.ledger.rows(), fresh.read_record)
    assert lab.root / "research" / "experiments" / "lr-004.md" in written
    assert "+LR = 0.04" in (lab.root / "research" / "experiments" / "lr-004.md").read_text()


def test_the_labs_own_template_shapes_the_note(tmp_path):
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic")
    assert (lab.root / "research" / "templates" / "experiment.md").exists()
    (lab.root / "research" / "templates" / "experiment.md").write_text(
        "## $name: $outcome ($delta)\n")
    r, spec, status = row("short")
    memory.remember(lab.root, SURFACE, r, spec, status)
    assert (lab.root / "research" / "experiments" / "short.md").read_text() == \
        "## short: Rejected (+0.010000)\n"
