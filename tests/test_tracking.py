"""Trackio holds one run per experiment that ran, with its config, curve and summary, in the lab."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from controller.cli import main as cli
from controller.lab import tracking
from controller.lab.paths import LabPaths
from controller.core.reconcile import ledger_row
from controller.core.spec import ExperimentSpec
from controller.local import LocalLab, init_lab

READ = """
import json, sys, trackio
from trackio.server import get_settings
from trackio.sqlite_storage import SQLiteStorage
project = sys.argv[1]
try:
    runs = list(trackio.Api().runs(project))
except ValueError:
    runs = []
print(json.dumps({r.name: {"config": r.config, "logs": SQLiteStorage.get_logs(project, r.name)}
                  for r in runs}, default=str))
print(json.dumps(get_settings()["plot_order"]))
"""
# What the dashboard's settings endpoint answers (trackio.server.get_settings) is read above.
CPU = {"num_steps": 25, "mfu_percent": 0.0, "peak_vram_mb": 0.0, "num_params_M": 11.5,
       "depth": 4, "training_seconds": 30.0, "total_seconds": 41.0, "total_tokens_M": 0.4}
CURVE = [{"step": 5, "loss": 3.2, "tokens_per_sec": 15000.0, "time": 1000.0},
         {"step": 15, "loss": 1.6, "tokens_per_sec": 16000.0, "time": 1001.5},
         {"step": 25, "loss": 1.5, "tokens_per_sec": 16100.0, "time": 1003.0}]


def read_back(lab: LocalLab) -> dict:
    """The project as trackio's own API reads it (a child process: TRACKIO_DIR is read once)."""
    assert tracking.settle()  # the after-record hook syncs in the background
    proc = subprocess.run([sys.executable, "-c", READ, tracking.project_name(lab.name)],
                          env=tracking.child_env(lab.root), capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-2])


def plot_order(lab: LocalLab) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", READ, tracking.project_name(lab.name)],
                          env=tracking.child_env(lab.root), capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def charts(runs: dict) -> dict[str, dict[str, list]]:
    """metric -> run -> the steps it was logged at: what Trackio's Metrics page charts (every
    numeric key but step; a metric no run logged twice is drawn as bars from 0, others as lines:
    trackio/frontend/src/pages/Metrics.svelte, singlePointMetrics)."""
    out: dict[str, dict[str, list]] = {}
    for name, run in runs.items():
        for rec in run["logs"]:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    out.setdefault(k, {}).setdefault(name, []).append(rec["step"])
    return out


def finished(lab: LocalLab, name: str, val: float | None, curve: list | None,
             phase: str = "Succeeded", outcome: str = "Rejected", job: bool = True,
             figures: dict | None = None, self_reported: list | None = None) -> dict:
    """What the controller leaves behind for a finished run: the harness result and the row.
    self_reported: the result's list (default: the steps, as the harness lists them; None in
    the list's place writes a result from before the list)."""
    run = f"exp-{name}-1"
    st = {"phase": phase, "reason": outcome or phase, "message": "done",
          "candidateHash": name[0] * 40, "parentHash": "a" * 40}
    if outcome:
        st["outcome"] = outcome
    if job:
        st["job"] = {"backend": "local", "name": run}
        d = lab.root / ".autolab" / "runs" / run
        d.mkdir(parents=True)
        result = {"version": 2, "status": "succeeded" if val is not None else "failed",
                  "metrics": {"val_bpb": val, **(CPU if figures is None else figures)}
                  if val is not None else None, "curve": None,
                  "self_reported": ["num_steps"] if self_reported is None else self_reported}
        if self_reported == [None]:
            del result["self_reported"]
        if curve:
            (d / "result.curve.jsonl").write_text(
                "".join(json.dumps(p) + "\n" for p in curve) + '{"step": 3')  # torn last line
            result["curve"] = str(d / "result.curve.jsonl")
        (d / "result.json").write_text(json.dumps(result))
    if val is not None:
        st.update(metrics={"val_bpb": val}, delta=round(val - 1.0, 6))
    spec = ExperimentSpec(hypothesis=f"{name} helps.", parent="aaaa", diff="-", campaign="lr")
    row = dict(ledger_row(name, spec, st), created_at="2026-11-29T10:00:00Z")
    assert lab.ledger.append(row)
    return row


@pytest.fixture()
def lab(tmp_path) -> LocalLab:
    return init_lab(tmp_path / "lab", profile="tiny", data="synthetic")


def test_each_run_becomes_one_trackio_run_with_config_curve_and_summary(lab):
    finished(lab, "lr-004", 0.98, CURVE, outcome="Promoted")
    finished(lab, "crash", None, None, phase="Failed", outcome="")
    finished(lab, "bad-diff", None, None, phase="Invalid", outcome="", job=False)
    assert tracking.sync(lab.root, lab.name)
    runs = read_back(lab)
    assert set(runs) == {"lr-004 · promoted", "crash · failed"}, \
        "a refused spec spent no GPU and has no run"
    cfg = runs["lr-004 · promoted"]["config"]
    assert cfg["hypothesis"] == "lr-004 helps." and cfg["campaign"] == "lr"
    assert cfg["parent"] == "a" * 40 and cfg["candidate_hash"] == "l" * 40
    assert cfg["backend"] == "local" and cfg["outcome"] == "Promoted" and cfg["promoted"]
    logs = runs["lr-004 · promoted"]["logs"]
    curve = [(x["step"], x["loss"], x["tokens_per_sec"], x["elapsed_seconds"])
             for x in logs if "loss" in x]
    assert curve == [(5, 3.2, 15000.0, 0.0), (15, 1.6, 16000.0, 1.5), (25, 1.5, 16100.0, 3.0)]
    summary = logs[-1]
    assert summary["step"] == 25 and summary["val_bpb"] == 0.98
    assert summary["delta"] == pytest.approx(-0.02) and summary["outcome"] == "promoted"
    assert runs["crash · failed"]["config"]["status"] == "failed"
    assert runs["crash · failed"]["logs"][-1]["outcome"] == "failed", \
        "a run that measured nothing still has a record, so Trackio lists it"


def test_the_dashboard_leads_with_val_bpb_on_a_readable_scale(lab):
    finished(lab, "lr-004", 0.60, CURVE, outcome="Promoted")
    finished(lab, "lr-005", 0.65, CURVE)
    finished(lab, "hf-run", 0.61, None)  # no curve: a backend that does not return one
    assert tracking.sync(lab.root, lab.name)
    runs = read_back(lab)
    drawn = charts(runs)
    assert plot_order(lab)[0] == "val_bpb", "trackio orders charts by TRACKIO_PLOT_ORDER"
    for name, steps in drawn["val_bpb"].items():
        assert len(set(steps)) == 2, f"{name}: val_bpb at two steps is a line, not a bar from 0"
    assert drawn["val_bpb"]["lr-004 · promoted"] == [5, 25], "a level line along the curve"
    assert sorted(len(v) for v in drawn["delta"].values()) == [1, 1, 1], \
        "delta is one bar per run: from 0 is right for a difference"
    for k in ("loss", "tokens_per_sec", "elapsed_seconds"):
        assert len(drawn[k]["lr-005 · rejected"]) == 3, f"{k} is a line chart"


def test_constants_and_cpu_zeros_are_config_not_charts(lab):
    finished(lab, "cpu-run", 0.98, CURVE)
    finished(lab, "gpu-run", 0.97, CURVE, figures={**CPU, "mfu_percent": 38.5,
                                                   "peak_vram_mb": 12000.0})
    assert tracking.sync(lab.root, lab.name)
    runs = read_back(lab)
    drawn = charts(runs)
    assert set(drawn) == {"val_bpb", "delta", "loss", "tokens_per_sec", "elapsed_seconds",
                          "mfu_percent", "peak_vram_mb"}
    assert set(drawn["mfu_percent"]) == set(drawn["peak_vram_mb"]) == {"gpu-run · rejected"}, \
        "0 on CPU means not measured: no bar"
    cfg = runs["cpu-run · rejected"]["config"]
    assert (cfg["num_params_M"], cfg["depth"], cfg["self_reported/num_steps"], cfg["val_bpb"]) == \
        (11.5, 4, 25, 0.98)
    assert cfg["training_seconds"] == 30.0 and cfg["total_tokens_M"] == 0.4
    assert cfg["self_reported"] == ["num_steps"]


def test_the_candidates_own_figures_are_charted_apart_never_as_measurements(lab):
    hostile = {**CPU, "mfu_percent": 99.9, "peak_vram_mb": 1.0, "depth": 99}
    # Today's harness measured GPU memory and MFU; the steps are the candidate's word.
    finished(lab, "measured", 0.97, CURVE, figures={**CPU, "mfu_percent": 38.5, "peak_vram_mb": 12000.0})
    # A GPU whose driver hid the candidate's processes: its memory figure is its own.
    finished(lab, "hidden", 0.97, CURVE, figures={**CPU, "mfu_percent": 41.0, "peak_vram_mb": 1.0},
             self_reported=["peak_vram_mb", "num_steps"])
    # A harness from before the list took MFU, memory, steps and depth from the candidate.
    finished(lab, "older", 0.96, CURVE, figures=hostile, self_reported=[None])
    assert tracking.sync(lab.root, lab.name)
    runs = read_back(lab)
    drawn = charts(runs)
    assert set(drawn["mfu_percent"]) == {"measured · rejected", "hidden · rejected"}
    assert set(drawn["peak_vram_mb"]) == {"measured · rejected"}
    assert set(drawn["self_reported/peak_vram_mb"]) == {"hidden · rejected", "older · rejected"}
    assert set(drawn["self_reported/mfu_percent"]) == {"older · rejected"}
    last = runs["hidden · rejected"]["logs"][-1]
    assert last["self_reported/peak_vram_mb"] == 1.0 and "peak_vram_mb" not in last
    older = runs["older · rejected"]["config"]
    assert older["self_reported/depth"] == 99 and "depth" not in older
    assert older["self_reported"] == ["depth", "mfu_percent", "num_steps", "peak_vram_mb"]


def test_the_runs_page_tells_promoted_from_rejected_by_name(lab):
    finished(lab, "wins", 0.97, None, outcome="Promoted")
    finished(lab, "loses", 1.02, None)
    finished(lab, "late", 0.96, None, outcome="")
    rows = lab.ledger.rows()
    rows[-1].update(status="succeeded", reason="FollowUp")
    assert tracking.run_labels(rows + [dict(rows[-1])]) == [
        "wins · promoted", "loses · rejected", "late · follow-up",
        f"late · follow-up ({rows[-1]['run_id']})"], "a second follow-up keeps its own run"
    assert tracking.sync(lab.root, lab.name)
    assert set(read_back(lab)) >= {"wins · promoted", "loses · rejected"}


def test_sync_is_idempotent_and_catches_up_what_it_missed(lab):
    finished(lab, "one", 1.01, CURVE)
    assert tracking.sync(lab.root, lab.name)
    first = read_back(lab)
    assert tracking.sync(lab.root, lab.name)
    assert read_back(lab) == first, "a second sync logs nothing twice"
    finished(lab, "two", 0.99, None)
    assert tracking.sync(lab.root, lab.name)
    runs = read_back(lab)
    assert set(runs) == {"one · rejected", "two · rejected"}
    assert runs["one · rejected"] == first["one · rejected"]


def test_the_hook_tracks_a_run_and_respects_autolab_tracking_off(lab, monkeypatch):
    row = finished(lab, "lr-004", 0.98, CURVE)
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    tracking.track_quietly(LabPaths.of(lab.root), lab.name, lab.lab.surface, row, None, None)
    assert read_back(lab) == {}
    monkeypatch.delenv("AUTOLAB_TRACKING")
    tracking.track_quietly(LabPaths.of(lab.root), lab.name, lab.lab.surface, row, None, None)
    assert set(read_back(lab)) == {"lr-004 · rejected"}
    assert (lab.root / ".autolab" / "trackio" / "autolab-default.db").exists()


def test_the_hook_never_waits_for_trackio(lab):
    """The after-record hook starts the sync and returns: a freed GPU is not held for it.

    Another sync holds the lab's sync lock the whole time; a hook that waited for its own
    sync would never return. Once the lock is free, `settle()` sees the run tracked.
    """
    from filelock import FileLock

    row = finished(lab, "lr-004", 0.98, CURVE)
    tracking.trackio_dir(lab.root).mkdir(parents=True, exist_ok=True)
    with FileLock(str(tracking.trackio_dir(lab.root) / "sync.lock")):
        tracking.track_quietly(LabPaths.of(lab.root), lab.name, lab.lab.surface, row, None, None)
    assert tracking.settle()
    assert set(read_back(lab)) == {"lr-004 · rejected"}


def test_the_trackio_child_refuses_to_write_outside_the_lab(lab, tmp_path):
    env = dict(tracking.child_env(lab.root), TRACKIO_DIR=str(tmp_path / "elsewhere"))
    proc = subprocess.run([sys.executable, "-m", "controller.lab.tracking", "sync", str(lab.root),
                           lab.name], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "TRACKIO_DIR must be" in proc.stderr
    assert not (tmp_path / "elsewhere").exists()


def test_a_project_tracked_before_outcome_names_is_not_tracked_twice(lab):
    finished(lab, "old", 1.01, None)
    legacy = ("import sys, trackio; trackio.init(project=sys.argv[1], name='old', embed=False, "
              "auto_log_cpu=False, auto_log_gpu=False); trackio.log({'run_ok': 1.0}); "
              "trackio.finish()")
    subprocess.run([sys.executable, "-c", legacy, tracking.project_name(lab.name)],
                   env=tracking.child_env(lab.root), capture_output=True, check=True)
    finished(lab, "new", 0.99, None)
    assert tracking.sync(lab.root, lab.name)
    assert set(read_back(lab)) == {"old", "new · rejected"}


def test_the_dashboard_opens_with_the_curves_unsmoothed():
    assert tracking.dashboard_url("http://127.0.0.1:7860/?project=autolab-x&write_token=t") == \
        "http://127.0.0.1:7860/?project=autolab-x&write_token=t&smoothing=0"
    assert tracking.dashboard_url("http://h/runs") == "http://h/runs?smoothing=0"


def test_an_undecided_verdict_is_a_trackio_run_and_its_pair_runs_and_lost_tries_are_not():
    from controller.lab.tracking import outcome_of, tracked

    verdict = {"status": "undecided", "backend": "local", "outcome": "Undecided"}
    assert tracked(verdict) and outcome_of(verdict) == "undecided"
    assert not tracked({"status": "confirm", "backend": "local"})
    assert not tracked({"status": "lost", "backend": "local"})
