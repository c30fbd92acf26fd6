"""Does `autolab dashboard` show the lab's runs in a real browser? A headless Chromium check.

Serves the lab's Trackio dashboard (`autolab dashboard --no-browser`), loads it in
headless Chromium (Debian's `chromium`: `apt-get install -y chromium`), and checks
the rendered page: the project is the lab's, and every run Trackio should hold
(every ledger row with a run: experiments that ran and the masters' baselines) is
named on it, with what became of it (`· promoted`, `· rejected`). Saves screenshots
of the charts and of the Runs page, and the lab's progress chart, and checks the
screenshots are real images, not blank pages.

    .venv/bin/python bench/perf/dashboard_screenshot.py [--lab DIR] [--out PNG]
        [--runs-out PNG] [--progress-out PNG]

Without --lab it builds a tiny lab (synthetic data, CPU) and runs the master's
baseline and a few experiments (some promoted, some rejected) through the CLI
first (a few minutes on two cores). The README's pictures (docs/dashboard.png,
docs/dashboard-runs.png, docs/progress.png) come from this script. Exit code 0
when every check passes; a JSON summary is printed either way. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from controller.lab import tracking  # noqa: E402
from controller.lab.report import write_report  # noqa: E402
from controller.local import LocalLab, init_lab  # noqa: E402
from labkit import spec_from_edit  # noqa: E402

AUTOLAB = "import sys; from controller.cli.main import main; sys.exit(main(sys.argv[1:]))"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                  "--virtual-time-budget=20000"]
# Small edits of the tiny master, each a constant moved; which win is up to the runs.
EDITS = [("higher-matrix-lr", "lr", "MATRIX_LR = 0.02", "MATRIX_LR = 0.04"),
         ("no-softcap", "model", "LOGIT_SOFTCAP = 15.0", "LOGIT_SOFTCAP = 0.0"),
         ("shorter-warmdown", "schedule", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.3"),
         ("higher-embedding-lr", "lr", "EMBEDDING_LR = 0.3", "EMBEDDING_LR = 0.6"),
         ("more-weight-decay", "schedule", "WEIGHT_DECAY = 0.1", "WEIGHT_DECAY = 0.2"),
         ("higher-adam-beta1", "lr", "ADAM_BETAS = (0.8, 0.95)", "ADAM_BETAS = (0.9, 0.95)")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_lab(root: Path, budget: int) -> LocalLab:
    """A tiny lab with a measured baseline and a few finished experiments, through the library
    (`apply_file` and the loop's `step`, as `autolab apply` and `autolab run` call them).

    One experiment at a time, each an edit of the master of the moment, so none needs a rebase."""
    with init_lab(root, profile="tiny", data="synthetic", budget=budget) as lab:
        for name, campaign, old, new in EDITS:
            spec = spec_from_edit(lab, name, old, new, hypothesis=f"{new.split(' = ')[0]} "
                                  f"at {new.split(' = ')[1]} lowers val_bpb.")
            spec["spec"]["campaign"] = campaign
            path = root / "experiments" / "drafts" / f"{name}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(spec, sort_keys=False))
            lab.apply_file(spec, str(path))
            while not lab.step().done:
                time.sleep(0.5)
            lab.stop_runs_started_ahead()
    return LocalLab(root)


def wait_for(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the dashboard exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the dashboard did not answer at {url} within {timeout:.0f}s")


def stop(server: subprocess.Popen) -> None:
    """End the dashboard we started: its whole process group, and nothing else."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.wait(timeout=10)
            break
        except subprocess.TimeoutExpired:
            continue


def chromium(binary: str, args: list[str], profile: Path,
             size: str = "1500,1100") -> subprocess.CompletedProcess:
    return subprocess.run([binary, *CHROMIUM_FLAGS, f"--window-size={size}",
                           f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lab", help="an existing lab (default: build a tiny one)")
    p.add_argument("--out", default="dashboard.png", help="screenshot of the charts")
    p.add_argument("--runs-out", default="dashboard-runs.png",
                   help="screenshot of the Runs page")
    p.add_argument("--progress-out", default="progress.png",
                   help="where to copy the lab's progress chart (`autolab report`)")
    p.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    p.add_argument("--keep", action="store_true", help="keep the lab that was built")
    p.add_argument("--budget", type=int, default=20,
                   help="training seconds per run of the lab it builds (a curve point per ~5 s)")
    a = p.parse_args(argv)
    if not shutil.which(a.chromium):
        print(f"error: {a.chromium} not found; apt-get install -y chromium", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="autolab-dashboard-"))
    lab = LocalLab(a.lab) if a.lab else build_lab(work / "lab", a.budget)
    tracking.sync(lab.root, lab.name)
    tracked = [r for r in lab.ledger.rows() if tracking.tracked(r)]
    expected = sorted(tracking.run_labels(tracked))
    write_report(lab)
    progress_png = Path(a.progress_out).resolve()
    for out in (a.out, a.runs_out, a.progress_out):
        Path(out).resolve().parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(lab.root / "research" / "live" / "progress.png", progress_png)
    project = tracking.project_name(lab.name)
    port = free_port()
    url = tracking.dashboard_url(f"http://127.0.0.1:{port}/?project={project}")
    server = subprocess.Popen([sys.executable, "-c", AUTOLAB, "dashboard", "--lab",
                               str(lab.root), "--no-browser", "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True, cwd=str(REPO))
    summary: dict = {"lab": str(lab.root), "url": url, "expected_runs": expected}
    try:
        wait_for(f"http://127.0.0.1:{port}/", server)
        dom = chromium(a.chromium, ["--dump-dom", url], work / "profile-dom").stdout
        out, runs_out = Path(a.out).resolve(), Path(a.runs_out).resolve()
        chromium(a.chromium, [f"--screenshot={out}", url], work / "profile-shot")
        runs_url = tracking.dashboard_url(f"http://127.0.0.1:{port}/runs?project={project}")
        runs_dom = chromium(a.chromium, ["--dump-dom", runs_url], work / "profile-runs").stdout
        chromium(a.chromium, [f"--screenshot={runs_out}", runs_url], work / "profile-runs-shot",
                 size="1500,520")
        import matplotlib.image
        images = {str(o): matplotlib.image.imread(str(o)) if o.exists() else None
                  for o in (out, runs_out)}
        summary.update(
            screenshots={o: list(i.shape[:2]) if i is not None else None
                         for o, i in images.items()},
            progress=str(progress_png),
            outcomes={w: sum(f"· {w}" in r for r in expected)
                      for w in ("promoted", "rejected", "follow-up", "failed")},
            project_shown=project in dom,
            runs_shown={r: r in dom for r in expected},
            runs_page_shows={r: r in runs_dom for r in expected},
            page_bytes=len(dom),
        )
        ok = (bool(expected) and summary["project_shown"] and all(summary["runs_shown"].values())
              and all(summary["runs_page_shows"].values())
              and all(i is not None and i.shape[0] >= 400 and float(i.std()) > 0.01
                      for i in images.values()))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        summary["error"] = str(e)
        if server.poll() is not None and server.stdout:
            summary["dashboard_output"] = server.stdout.read().decode(errors="replace")[-2000:]
        ok = False
    finally:
        stop(server)
        if not a.lab and not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary["ok"] = ok
    print(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
