"""Trackio holds one run per experiment that ran, with its config, curve and summary, in the lab."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from controller.cli.lab import init_lab
from controller.cli import main as cli
from controller.lab import tracking
from controller.lab.paths import LabPaths
from controller.core.reconcile import ledger_row
from controller.core.spec import ExperimentSpec
from controller.local import LocalLab

READ = """
import json, sys, trackio
from trackio.sqlite_storage import SQLiteStorage
project = sys.argv[1]
try:
    runs = list(trackio.Api().runs(project))
except ValueError:
    runs = []
print(json.dumps({r.name: {"config": r.config, "logs": SQLiteStorage.get_logs(project, r.name)}
                  for r in runs}, default=str))
"""
CURVE = [{"step": 5, "loss": 3.2, "tokens_per_sec": 15000.0, "time": 1000.0},
         {"step": 15, "loss": 1.6, "tokens_per_sec": 16000.0, "time": 1001.5},
         {"step": 25, "loss": 1.5, "tokens_per_sec": 16100.0, "time": 1003.0}]


def read_back(lab: LocalLab) -> dict:
    """The project as trackio's own API reads it (a child process: TRACKIO_DIR is read once)."""
    proc = subprocess.run([sys.executable, "-c", READ, tracking.project_name(lab.name)],
                          env=tracking.child_env(lab.root), capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def finished(lab: LocalLab, name: str, val: float | None, curve: list | None,
             phase: str = "Succeeded", outcome: str = "Rejected", job: bool = True) -> dict:
    """What the controller leaves behind for a finished run: the harness result and the row."""
    run = f"exp-{name}-1"
    st = {"phase": phase, "reason": outcome or phase, "message": "done",
          "candidateHash": name[0] * 40, "parentHash": "a" * 40}
    if outcome:
        st["outcome"] = outcome
    if job:
        st["job"] = {"backend": "local", "name": run}
        d = lab.root / ".autolab" / "runs" / run
        d.mkdir(parents=True)
        result = {"version": 1, "status": "succeeded" if val is not None else "failed",
                  "metrics": {"val_bpb": val, "num_steps": 25, "mfu_percent": 1.5}
                  if val is not None else None, "curve": None}
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
    assert set(runs) == {"lr-004", "crash"}, "a refused spec spent no GPU and has no run"
    cfg = runs["lr-004"]["config"]
    assert cfg["hypothesis"] == "lr-004 helps." and cfg["campaign"] == "lr"
    assert cfg["parent"] == "a" * 40 and cfg["candidate_hash"] == "l" * 40
    assert cfg["backend"] == "local" and cfg["outcome"] == "Promoted" and cfg["promoted"]
    logs = runs["lr-004"]["logs"]
    curve = [(x["step"], x["loss"], x["tokens_per_sec"], x["elapsed_seconds"])
             for x in logs if "loss" in x]
    assert curve == [(5, 3.2, 15000.0, 0.0), (15, 1.6, 16000.0, 1.5), (25, 1.5, 16100.0, 3.0)]
    summary = next(x for x in logs if "val_bpb" in x)
    assert summary["step"] == 25 and summary["val_bpb"] == 0.98
    assert summary["num_steps"] == 25 and summary["delta"] == pytest.approx(-0.02)
    assert runs["crash"]["config"]["status"] == "failed"


def test_sync_is_idempotent_and_catches_up_what_it_missed(lab):
    finished(lab, "one", 1.01, CURVE)
    assert tracking.sync(lab.root, lab.name)
    first = read_back(lab)
    assert tracking.sync(lab.root, lab.name)
    assert read_back(lab) == first, "a second sync logs nothing twice"
    finished(lab, "two", 0.99, None)
    assert tracking.sync(lab.root, lab.name)
    runs = read_back(lab)
    assert set(runs) == {"one", "two"} and runs["one"] == first["one"]


def test_the_hook_tracks_a_run_and_respects_autolab_tracking_off(lab, monkeypatch):
    row = finished(lab, "lr-004", 0.98, CURVE)
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    tracking.track_quietly(LabPaths.of(lab.root), lab.name, lab.lab.surface, row, None, None)
    assert read_back(lab) == {}
    monkeypatch.delenv("AUTOLAB_TRACKING")
    tracking.track_quietly(LabPaths.of(lab.root), lab.name, lab.lab.surface, row, None, None)
    assert set(read_back(lab)) == {"lr-004"}
    assert (lab.root / ".autolab" / "trackio" / "autolab-default.db").exists()


def test_the_trackio_child_refuses_to_write_outside_the_lab(lab, tmp_path):
    env = dict(tracking.child_env(lab.root), TRACKIO_DIR=str(tmp_path / "elsewhere"))
    proc = subprocess.run([sys.executable, "-m", "controller.lab.tracking", "sync", str(lab.root),
                           lab.name], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "TRACKIO_DIR must be" in proc.stderr
    assert not (tmp_path / "elsewhere").exists()
