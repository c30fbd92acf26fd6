"""The progress report: leader, campaigns, recent runs, anomalies and the progress chart."""

from __future__ import annotations

import datetime as dt

import matplotlib.image
import pytest

from controller.cli import main as cli
from controller.core.reconcile import ledger_row
from controller.core.spec import ExperimentSpec
from controller.local import LocalLab, init_lab
from controller.lab.report import build_report, draw_progress, plot_progress, progress


def row(name: str, status: str, val: float | None = None, promoted: bool = False,
        campaign: str = "lr", reason: str = "", duplicate_of: str = "") -> dict:
    phase = status.capitalize() if status != "error" else "Failed"
    st = {"phase": phase, "reason": reason or phase, "message": f"{name}: {reason or phase}"}
    if status in ("succeeded", "failed", "error"):
        st["job"] = {"backend": "local", "name": f"exp-{name}-1"}
    if val is not None:
        st.update(metrics={"val_bpb": val}, outcome="Promoted" if promoted else "Rejected",
                  delta=0.0)
    if duplicate_of:
        st["duplicateOf"] = duplicate_of
    spec = ExperimentSpec(hypothesis=f"{name}.", parent="aaaa", diff="-", campaign=campaign)
    return dict(ledger_row(name, spec, st), created_at="2026-11-29T10:00:00Z")


BASELINE = {"run_id": "baseline-aaaa", "status": "baseline", "experiment_id": "baseline",
            "val_bpb": "1.0", "created_at": "2026-11-29T09:00:00Z"}


def test_progress_has_one_point_per_measured_experiment_and_the_running_best():
    rows = [BASELINE, row("a", "succeeded", 1.02), row("b", "succeeded", 0.97, promoted=True),
            row("c", "invalid"), row("d", "failed", reason="CandidateFailed"),
            row("e", "succeeded", 0.99), row("f", "succeeded", 0.95, promoted=True)]
    p = progress(rows)
    assert [(q.name, q.kept) for q in p.points] == [("a", False), ("b", True), ("e", False),
                                                    ("f", True)]
    assert [y for _, y in p.best] == [1.0, 1.0, 0.97, 0.97, 0.95]


def test_progress_chart_is_a_png(tmp_path):
    rows = [BASELINE] + [row(f"e{i}", "succeeded", 1.0 - i / 100, promoted=i % 3 == 0)
                         for i in range(12)]
    path = plot_progress(progress(rows), tmp_path / "live" / "progress.png", "lab x")
    image = matplotlib.image.imread(str(path))
    assert image.shape[0] > 100 and image.shape[1] > 100
    empty = plot_progress(progress([]), tmp_path / "empty.png", "nothing yet")
    assert empty.read_bytes()[:4] == b"\x89PNG"


def test_progress_chart_counts_experiments_in_whole_numbers():
    for n in (1, 2, 3, 7, 40):
        rows = [BASELINE] + [row(f"e{i}", "succeeded", 1.0 - i / 100) for i in range(n)]
        ax = draw_progress(progress(rows), "x").axes[0]
        lo, hi = ax.get_xlim()
        shown = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert shown and all(float(t).is_integer() for t in shown), (n, shown)
        assert lo == 0.5 and hi == n + 0.5


def test_progress_chart_draws_the_baseline_and_each_promotion_with_its_gain():
    rows = [BASELINE, row("a", "succeeded", 1.02), row("b", "succeeded", 0.97, promoted=True),
            row("c", "succeeded", 0.95, promoted=True),
            {**BASELINE, "run_id": "baseline-bbbb", "val_bpb": "0.97"}]
    ax = draw_progress(progress(rows), "x").axes[0]
    baseline = [ln for ln in ax.get_lines() if ln.get_label().startswith("baseline")]
    assert len(baseline) == 1 and set(baseline[0].get_ydata()) == {1.0}, \
        "a dashed line at the first master's val_bpb, not a later master's"
    assert "1.0000" in baseline[0].get_label()
    assert [t.get_text() for t in ax.texts] == ["b (-0.0300)", "c (-0.0200)"]


@pytest.fixture()
def lab(tmp_path) -> LocalLab:
    return init_lab(tmp_path / "lab", profile="tiny", data="synthetic")


def test_report_names_the_anomalies_that_waste_gpu_time(lab):
    for r in (row("good", "succeeded", 1.01), row("crash", "failed", reason="CandidateFailed"),
              row("bad-1", "invalid", reason="DiffDoesNotApply"),
              row("bad-2", "invalid", reason="DiffDoesNotApply"),
              row("dup-1", "duplicate", reason="DuplicateCandidate", duplicate_of="good"),
              row("dup-2", "duplicate", reason="DuplicateCandidate", duplicate_of="good")):
        assert lab.ledger.append(r)
    long_ago = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=3)).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    lab.write_record("slow", {"spec": {"campaign": "lr"}, "status": {
        "phase": "Running", "startedAt": long_ago, "createdAt": long_ago,
        "job": {"backend": "local", "name": "exp-slow-1", "slot": "0"}}})
    md = build_report(lab)
    assert "**stuck run**: `slow` has been Running for 3h00m" in md
    assert "**run without a metric**: `crash` (failed, CandidateFailed)" in md
    assert "**repeated refusals**: 2 specs refused as DiffDoesNotApply (`bad-1`, `bad-2`)" in md
    assert "**repeated duplicate**: 2 specs repeat good" in md
    assert "| lr | 6 | 0 | 1 | 1 | 4 | 1 | 1.010000 (`good`) |" in md
    assert "| `slow` | Running | 0 | 3h00m | lr |" in md


def test_a_quiet_lab_reports_its_leader_and_no_anomalies(lab, capsys):
    assert cli.main(["report", "--lab", str(lab.root)]) == 0
    md = capsys.readouterr().out
    assert f"master `{lab.repo.master().hash[:12]}`: val_bpb not measured yet, set by the seed" in md
    assert "## Anomalies\n\nNone." in md
    assert (lab.root / "research" / "live" / "progress.png").exists()
