"""Trackio: one run per experiment, with its config and its step curve, kept in the lab.

Every experiment that ran becomes one Trackio run in the lab's project
(`autolab-<lab name>`), named after the experiment and what became of it
(`lr-004 · promoted`, `lr-005 · rejected`, `crash · failed`): Trackio's Runs
page shows a run's name and step counts and nothing of its config, so the name
is where promoted and rejected can be told apart. The baseline runs of each
master are tracked the same way, under their run id.

The dashboard is laid out for this lab, from what Trackio's front end does
(`trackio/frontend/src/lib/dataProcessing.js`, `pages/Metrics.svelte`): it
charts every numeric metric, orders the charts by `TRACKIO_PLOT_ORDER` (then
alphabetically), and draws a metric that no run logged twice as bars from 0,
anything else as lines on a scale fitted to the data. So:

- the charts are few and in the order a reader asks: val_bpb, delta (against
  the parent), then the step curve the harness wrote (loss, tokens per second,
  elapsed seconds), then MFU and peak VRAM where a GPU measured them (a CPU
  run has none, or 0 from an older harness, and they are not logged);
- val_bpb is measured once, at the end, but is logged at the curve's first and
  last step: Trackio then draws each run as a level line on a scale fitted to
  the runs, where 0.60 and 0.65 are far apart (as bars from 0 they look alike);
- delta stays one point per run: bars from 0 are right for a difference;
- the figures that describe a run rather than compare runs (parameters,
  depth, steps, tokens, seconds) go to its config, with the hypothesis,
  campaign, parent, candidate hash, backend and outcome; the run's page shows
  it, and the sidebar can group runs by any of it (by `outcome`, say);
- a figure that is the candidate's own word, not the harness's measurement
  (`controller.core.figures`: the result's `self_reported`, else the ledger's
  column), is logged under `self_reported/<name>`: a chart (or config entry)
  of its own, never beside the harness's under the plain name; the config's
  `self_reported` lists them;
- the last record also carries the outcome as text, which Trackio keeps but
  does not chart, so a run that measured nothing still exists.

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
reported, never allowed to stop the controller, nor to keep it waiting: the hook
starts the sync in the background (`settle()` waits for it; `autolab run` does before it
returns). Set `AUTOLAB_TRACKING=0` to
switch the hook off. Optional: `autolab dashboard --sync-space USER/SPACE`
pushes the project to a Hugging Face Space (and bucket) with `trackio.sync`.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from controller.core import figures
from controller.lab.paths import LabPaths


SYNC_TIMEOUT_SECONDS = 300
TRACKED_STATUSES = ("succeeded", "failed", "error", "cancelled", "undecided", "baseline")
# The charts, first to last (TRACKIO_PLOT_ORDER; trackio puts any other metric after them).
CHART_ORDER = ("val_bpb", "delta", "loss", "tokens_per_sec", "elapsed_seconds", "mfu_percent",
               "peak_vram_mb")
# Summary figures charted once per run; the GPU's only where a GPU measured them (not 0).
CHARTED, GPU_ONLY = ("delta", "mfu_percent", "peak_vram_mb"), ("mfu_percent", "peak_vram_mb")
# Summary figures that describe the run (the same for most runs): its config, not a chart.
FACTS = ("val_bpb", "num_params_M", "depth", "num_steps", "total_tokens_M", "training_seconds",
         "total_seconds")
SUMMARY_KEYS = figures.SUMMARY_KEYS
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
               GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1",
               TRACKIO_PLOT_ORDER=",".join(CHART_ORDER))
    return env


def tracked(row: dict) -> bool:
    """Whether a ledger row is a run Trackio should hold (refusals spent no GPU)."""
    if row.get("status") not in TRACKED_STATUSES:
        return False
    return row.get("status") == "baseline" or bool(row.get("backend"))


def outcome_of(row: dict) -> str:
    """What became of a tracked run, in one word: promoted, rejected, follow-up, failed, ..."""
    if row.get("status") == "baseline":
        return "baseline"
    if row.get("promoted") == "1":
        return "promoted"
    if row.get("outcome"):
        return row["outcome"].lower()
    if row.get("status") == "succeeded" and row.get("reason") == "FollowUp":
        return "follow-up"  # it won on an older master; a rebased run decides
    return row.get("status") or "unknown"


def run_label(row: dict) -> str:
    """The Trackio run name of a ledger row: `<experiment> · <outcome>`; a baseline's run id."""
    if row.get("experiment_id") in ("", "baseline"):
        return row["run_id"]
    return f"{row['experiment_id']} · {outcome_of(row)}"


def run_labels(rows: list[dict]) -> list[str]:
    """The run name of each row; a name already taken (a second follow-up) gets its run id."""
    seen: set[str] = set()
    out = []
    for row in rows:
        label = run_label(row)
        if label in seen:
            label = f"{label} ({row.get('run_id', '')})"
        seen.add(label)
        out.append(label)
    return out


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


# Syncs the after-record hook started in the background and nobody has waited for yet:
# (lab root, the child, its log file, when it started). A sync takes seconds (the child
# imports trackio), and the controller must not hold a freed GPU, or an operator's finalizer,
# for that long: the hook starts the child and returns; `settle()` waits (at the end of
# `autolab run`, and at exit).
_BACKGROUND: list[tuple[Path, subprocess.Popen, Any, float]] = []
_BACKGROUND_LOCK = threading.Lock()
# Per lab, one sync running and one waiting for its lock are enough: the waiting one reads the
# ledger once it holds the lock, so it takes every row written until then.
MAX_SYNCS_PER_LAB = 2


def sync_in_background(lab_root: Path, lab_name: str) -> bool:
    """Start a sync of the lab and return at once; False if enough are underway already."""
    lab_root = Path(lab_root).resolve()
    _reap(wait=False)
    with _BACKGROUND_LOCK:
        if sum(root == lab_root for root, *_ in _BACKGROUND) >= MAX_SYNCS_PER_LAB:
            return False
        trackio_dir(lab_root).mkdir(parents=True, exist_ok=True)
        log = open(trackio_dir(lab_root) / "sync.log", "a", encoding="utf-8")
        try:
            child = subprocess.Popen(
                [sys.executable, "-m", "controller.lab.tracking", "sync", str(lab_root), lab_name],
                env=child_env(lab_root), cwd=str(lab_root), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT)
        except OSError:
            log.close()
            raise
        if not _BACKGROUND and not getattr(sync_in_background, "registered", False):
            atexit.register(settle)
            sync_in_background.registered = True  # type: ignore[attr-defined]
        _BACKGROUND.append((lab_root, child, log, time.monotonic()))
    return True


def settle(timeout: float = SYNC_TIMEOUT_SECONDS) -> bool:
    """Wait for this process's background syncs; False (having said why) if one failed."""
    return _reap(wait=True, timeout=timeout)


def _reap(wait: bool, timeout: float = SYNC_TIMEOUT_SECONDS) -> bool:
    ok = True
    with _BACKGROUND_LOCK:
        items = list(_BACKGROUND)
    for entry in items:
        root, child, log, started = entry
        if wait:
            try:
                child.wait(timeout=max(0.0, started + timeout - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                print(f"warning: trackio sync of {root} took over {timeout:g}s and was stopped; "
                      "`autolab dashboard` retries it", file=sys.stderr)
                ok = False
        rc = child.poll()
        if rc is None:
            continue
        with _BACKGROUND_LOCK:
            _BACKGROUND.remove(entry)
        log.close()
        if rc not in (0, -9):
            print(f"warning: trackio sync failed (exit code {rc}); see "
                  f"{trackio_dir(root) / 'sync.log'}; the ledger is intact and `autolab dashboard` "
                  "retries it", file=sys.stderr)
            ok = False
    return ok


def track_quietly(paths, lab_name: str, surface: str, row: dict, spec: dict | None,
                  status: dict | None) -> None:
    """After-record hook: start bringing Trackio up to date with the row just written."""
    if os.environ.get("AUTOLAB_TRACKING", "1") in ("0", "false", "off"):
        return
    if not tracked(row):
        return
    try:
        sync_in_background(paths.root, lab_name)
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


def dashboard_url(url: str) -> str:
    """The dashboard's address with the curves unsmoothed: trackio smooths over 10 points by
    default (`smoothing` in the query overrides it), which flattens a curve of a few dozen."""
    return url + ("&" if "?" in url else "?") + "smoothing=0"


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


def _summary(row: dict, result: dict) -> tuple[dict, set[str]]:
    """Every summary figure the run has, the harness's result first, the ledger row second; and
    those of them that are the candidate's word (by the result's list, else the row's column)."""
    metrics = dict(result.get("metrics") or {})
    out = {}
    for k in SUMMARY_KEYS:
        v = _number(metrics.get(k, row.get(k)))
        if v is not None:
            out[k] = v
    delta = _number(row.get("delta"))
    if delta is not None:
        out["delta"] = delta
    own = set(figures.of_result(result, metrics)) if metrics else figures.of_row(row)
    return out, own & set(out)


def config_of(row: dict, summary: dict | None = None, own: set[str] = frozenset()) -> dict:
    """The run's config: what was tried and what became of it, and the figures that describe it
    (the candidate's own under self_reported/<name>, and listed in `self_reported`)."""
    cfg = {"hypothesis": row.get("hypothesis", ""), "campaign": row.get("campaign", ""),
           "parent": row.get("parent_hash", ""), "candidate_hash": row.get("candidate_hash", ""),
           "backend": row.get("backend") or "local", "run_id": row.get("run_id", ""),
           "status": row.get("status", ""), "outcome": row.get("outcome", ""),
           "promoted": row.get("promoted") == "1", "experiment": row.get("experiment_id", "")}
    summary = summary or {}
    cfg.update({figures.trackio_name(k, k in own): summary[k] for k in FACTS if k in summary})
    cfg["self_reported"] = sorted(own)
    return cfg


def records_of(row: dict, summary: dict, curve: list[tuple[int, dict]],
               own: set[str] = frozenset()) -> list[tuple[int, dict]]:
    """(step, metrics) to log for a run: the curve, val_bpb at its ends, the charted figures;
    a figure that is the candidate's word under self_reported/<name>, a chart of its own."""
    first = curve[0][0] if curve else 0
    last = curve[-1][0] if curve else int(summary.get("num_steps") or 0)
    last = max(last, first + 1)  # two distinct steps: a line, never a bar from 0
    final: dict[str, Any] = {figures.trackio_name(k, k in own): summary[k] for k in CHARTED
                             if k in summary and not (k in GPU_ONLY and summary[k] == 0)}
    records = list(curve)
    if "val_bpb" in summary:
        val = figures.trackio_name("val_bpb", "val_bpb" in own)
        records.insert(0, (first, {val: summary["val_bpb"]}))
        final[val] = summary["val_bpb"]
    # Text is kept but never charted; it makes a run that measured nothing exist all the same.
    final["outcome"] = outcome_of(row)
    records.append((last, final))
    return records


def _child_sync(lab_root: Path, lab_name: str) -> int:
    import trackio
    from filelock import FileLock

    from controller.lab.ledger import Ledger

    project = project_name(lab_name)
    with FileLock(str(trackio_dir(lab_root) / "sync.lock")):
        # The ledger is read under the lock: a sync that waited for another one sees every row
        # written before it got the lock.
        rows = [r for r in Ledger(LabPaths.of(lab_root).ledger).rows() if tracked(r)]
        try:
            have = {r.name for r in trackio.Api().runs(project)}
        except ValueError:  # trackio's word for "no such project yet"
            have = set()
        for row, label in zip(rows, run_labels(rows)):
            # A project written before runs were named with their outcome has the bare name.
            if label in have or row.get("experiment_id") in have:
                continue
            result = _result(lab_root, row["run_id"])
            curve = curve_points(lab_root, row["run_id"], result)
            summary, own = _summary(row, result)
            trackio.init(project=project, name=label, group=row.get("campaign") or None,
                         config=config_of(row, summary, own), resume="allow", auto_log_cpu=False,
                         auto_log_gpu=False, embed=False)
            for step, m in records_of(row, summary, curve, own):
                trackio.log(m, step=step)
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
    from trackio.utils import block_main_thread_until_keyboard_interrupt
    full_url = trackio.show(project=project_name(a.lab_name), open_browser=False,
                            block_thread=False, host=a.host, server_port=a.port)[3]
    print(f"* the lab's dashboard: {dashboard_url(full_url)}", flush=True)
    if not a.no_browser:
        import webbrowser
        webbrowser.open(dashboard_url(full_url))
    block_main_thread_until_keyboard_interrupt()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
