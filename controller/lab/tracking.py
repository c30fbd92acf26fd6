"""Trackio: one run per experiment, with its config and its step curve, kept in the lab.

Every experiment that ran becomes one Trackio run in the lab's project
(`autolab-<lab name>`): its config holds the hypothesis, campaign, parent,
candidate hash, backend and outcome; its metrics are the step curve the
harness wrote (loss and tokens per second per step, when the result names a
`curve` file) and, at the last step, the summary (val_bpb, training seconds,
MFU and the rest; `run_ok` is 1 for a run that measured its candidate, 0 for
one that failed). The baseline runs of each master are tracked the same way.

Trackio keeps its data where `TRACKIO_DIR` points, read once when trackio is
imported. So all Trackio work happens in a child process
(`python -m controller.lab.tracking ...`) whose `TRACKIO_DIR` is
`<lab>/.autolab/trackio`: nothing is written to the home directory, two labs
in one process never mix, and the controller never imports trackio (or
waits on its threads) itself.

Tracking is derived data. The ledger is the truth; `sync` logs every ledger
row with a run that Trackio does not have yet, under a lock, so it is
idempotent, heals a crash or a failed hook on the next call, and can be run
by hand (`autolab dashboard` runs it before serving). A failure of Trackio is
reported, never allowed to stop the controller. Set `AUTOLAB_TRACKING=0` to
switch the hook off. Optional: `autolab dashboard --sync-space USER/SPACE`
pushes the project to a Hugging Face Space (and bucket) with `trackio.sync`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from controller.lab.paths import LabPaths


SYNC_TIMEOUT_SECONDS = 300
TRACKED_STATUSES = ("succeeded", "failed", "error", "cancelled", "baseline")
SUMMARY_KEYS = ("val_bpb", "training_seconds", "total_seconds", "peak_vram_mb", "mfu_percent",
                "total_tokens_M", "num_steps", "num_params_M", "depth")
# The curve's "time" is a wall-clock timestamp (and a name trackio reserves): it is logged as
# seconds since the curve's first point.
CLOCK_KEY, ELAPSED_KEY = "time", "elapsed_seconds"


def project_name(lab_name: str) -> str:
    return f"autolab-{lab_name}"


def trackio_dir(lab_root: Path) -> Path:
    return LabPaths.of(lab_root).trackio


def child_env(lab_root: Path) -> dict[str, str]:
    """The environment of a Trackio child: data in the lab, local only, no telemetry."""
    env = dict(os.environ)
    for k in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_DATASET_ID",
              "TRACKIO_BUCKET_ID"):
        env.pop(k, None)
    env.update(TRACKIO_DIR=str(trackio_dir(lab_root)), HF_HUB_DISABLE_TELEMETRY="1",
               GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
    return env


def tracked(row: dict) -> bool:
    """Whether a ledger row is a run Trackio should hold (refusals spent no GPU)."""
    if row.get("status") not in TRACKED_STATUSES:
        return False
    return row.get("status") == "baseline" or bool(row.get("backend"))


def run_label(row: dict) -> str:
    if row.get("experiment_id") in ("", "baseline"):
        return row["run_id"]
    return row["experiment_id"]


# --- the controller's side -------------------------------------------------------------------

def _child(lab_root: Path, args: list[str], timeout: float | None,
           capture: bool) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "controller.lab.tracking", *args]
    trackio_dir(lab_root).mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"env": child_env(lab_root), "cwd": str(lab_root)}
    if capture:
        kwargs.update(capture_output=True, text=True)
    return subprocess.run(cmd, timeout=timeout, **kwargs)


def sync(lab_root: Path, lab_name: str, quiet: bool = True) -> bool:
    """Log every tracked ledger row Trackio lacks. Returns False (and says why) on failure."""
    lab_root = Path(lab_root)
    log = trackio_dir(lab_root) / "sync.log"
    try:
        proc = _child(lab_root, ["sync", str(lab_root), lab_name], SYNC_TIMEOUT_SECONDS, True)
    except subprocess.TimeoutExpired:
        print(f"warning: trackio sync of {lab_root} took over {SYNC_TIMEOUT_SECONDS}s and was "
              "stopped; `autolab dashboard` retries it", file=sys.stderr)
        return False
    with open(log, "a", encoding="utf-8") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"warning: trackio sync failed ({tail[0]}); see {log}; the ledger is intact and "
              "`autolab dashboard` retries it", file=sys.stderr)
        return False
    if not quiet:
        for line in proc.stdout.splitlines():
            if line.startswith("tracked "):
                print(line)
    return True


def track_quietly(paths, lab_name: str, surface: str, row: dict, spec: dict | None,
                  status: dict | None) -> None:
    """After-record hook: bring Trackio up to date with the row just written."""
    if os.environ.get("AUTOLAB_TRACKING", "1") in ("0", "false", "off"):
        return
    if not tracked(row):
        return
    try:
        sync(paths.root, lab_name)
    except Exception as e:  # tracking must never stop the controller
        print(f"warning: trackio sync for {row.get('experiment_id')} failed: {e}",
              file=sys.stderr)


def show(lab_root: Path, lab_name: str, host: str = "127.0.0.1", port: int | None = None,
         open_browser: bool = True) -> int:
    """Serve Trackio's dashboard for the lab's project until interrupted."""
    args = ["show", str(lab_root), lab_name, "--host", host]
    if port:
        args += ["--port", str(port)]
    if not open_browser:
        args.append("--no-browser")
    try:
        return _child(Path(lab_root), args, None, False).returncode
    except KeyboardInterrupt:
        return 130


def push(lab_root: Path, lab_name: str, space_id: str | None, bucket_id: str | None) -> int:
    if not space_id:
        print("error: --sync-bucket needs --sync-space (the Space that serves the bucket)",
              file=sys.stderr)
        return 1
    args = ["push", str(lab_root), lab_name, "--space", space_id]
    if bucket_id:
        args += ["--bucket", bucket_id]
    return _child(Path(lab_root), args, None, False).returncode


# --- the child's side (runs with TRACKIO_DIR set) ----------------------------------------------

def _number(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _result(lab_root: Path, run_id: str) -> dict:
    p = LabPaths.of(lab_root).run_dir(run_id) / "result.json"
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def curve_points(lab_root: Path, run_id: str, result: dict) -> list[tuple[int, dict]]:
    """(step, metrics) of the run's step curve, from the JSONL file its result names."""
    ref = result.get("curve")
    if not ref:
        return []
    path = Path(ref)
    if not path.is_absolute():
        path = LabPaths.of(lab_root).run_dir(run_id) / path
    points = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    start: float | None = None
    for line in lines:
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
        step = d.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        m = {k: _number(v) for k, v in d.items() if k not in ("step", CLOCK_KEY)}
        clock = _number(d.get(CLOCK_KEY))
        if clock is not None:
            start = clock if start is None else start
            m[ELAPSED_KEY] = round(clock - start, 3)
        m = {k: v for k, v in m.items() if v is not None}
        if m:
            points.append((step, m))
    return points


def _summary(row: dict, result: dict) -> dict:
    metrics = dict(result.get("metrics") or {})
    out = {}
    for k in SUMMARY_KEYS:
        v = _number(metrics.get(k, row.get(k)))
        if v is not None:
            out[k] = v
    delta = _number(row.get("delta"))
    if delta is not None:
        out["delta"] = delta
    return out


def config_of(row: dict) -> dict:
    return {"hypothesis": row.get("hypothesis", ""), "campaign": row.get("campaign", ""),
            "parent": row.get("parent_hash", ""), "candidate_hash": row.get("candidate_hash", ""),
            "backend": row.get("backend") or "local", "run_id": row.get("run_id", ""),
            "status": row.get("status", ""), "outcome": row.get("outcome", ""),
            "promoted": row.get("promoted") == "1", "experiment": row.get("experiment_id", "")}


def _child_sync(lab_root: Path, lab_name: str) -> int:
    import trackio
    from filelock import FileLock

    from controller.lab.ledger import Ledger

    project = project_name(lab_name)
    rows = [r for r in Ledger(LabPaths.of(lab_root).ledger).rows() if tracked(r)]
    with FileLock(str(trackio_dir(lab_root) / "sync.lock")):
        try:
            have = {r.name for r in trackio.Api().runs(project)}
        except ValueError:  # trackio's word for "no such project yet"
            have = set()
        for row in rows:
            label = run_label(row)
            if label in have:
                continue
            result = _result(lab_root, row["run_id"])
            curve = curve_points(lab_root, row["run_id"], result)
            trackio.init(project=project, name=label, group=row.get("campaign") or None,
                         config=config_of(row), resume="allow", auto_log_cpu=False,
                         auto_log_gpu=False, embed=False)
            for step, m in curve:
                trackio.log(m, step=step)
            # Always one final record, so a run that measured nothing still shows up.
            summary = {**_summary(row, result),
                       "run_ok": 1.0 if row.get("status") in ("succeeded", "baseline") else 0.0}
            trackio.log(summary, step=(curve[-1][0] if curve else 0))
            trackio.finish()
            have.add(label)
            print(f"tracked {label} ({len(curve)} curve points)", flush=True)
    return 0


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m controller.lab.tracking",
                                description="Trackio work for a lab (run with TRACKIO_DIR set)")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("sync", "show", "push"):
        sp = sub.add_parser(name)
        sp.add_argument("lab_root")
        sp.add_argument("lab_name")
        if name == "show":
            sp.add_argument("--host", default="127.0.0.1")
            sp.add_argument("--port", type=int)
            sp.add_argument("--no-browser", action="store_true")
        if name == "push":
            sp.add_argument("--space", required=True)
            sp.add_argument("--bucket")
    a = p.parse_args(argv)
    root = Path(a.lab_root).resolve()
    expected = trackio_dir(root)
    if Path(os.environ.get("TRACKIO_DIR", "")).resolve() != expected.resolve():
        print(f"error: TRACKIO_DIR must be {expected}; run this through `autolab`",
              file=sys.stderr)
        return 2
    if a.cmd == "sync":
        return _child_sync(root, a.lab_name)
    import trackio
    if a.cmd == "push":
        trackio.sync(project_name(a.lab_name), space_id=a.space, bucket_id=a.bucket)
        return 0
    trackio.show(project=project_name(a.lab_name), open_browser=not a.no_browser,
                 block_thread=True, host=a.host, server_port=a.port)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
