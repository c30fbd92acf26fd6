"""Does `autolab dashboard` show the lab's runs in a real browser? A headless Chromium check.

Serves the lab's Trackio dashboard (`autolab dashboard --no-browser`), loads it in
headless Chromium (Debian's `chromium`: `apt-get install -y chromium`), and checks
the rendered page: the project is the lab's, and every run Trackio should hold
(every ledger row with a run: experiments that ran and the masters' baselines) is
named on it. Saves a screenshot and checks it is a real image, not a blank page.

    .venv/bin/python bench/perf/dashboard_screenshot.py [--lab DIR] [--out PNG]

Without --lab it builds a tiny lab (synthetic data, CPU) and runs the master's
baseline and one experiment through the CLI first (about a minute). Exit code 0
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.cli.lab import init_lab
from controller import cli, tracking  # noqa: E402
from controller.local import LocalLab  # noqa: E402

AUTOLAB = "import sys; from controller.cli.main import main; sys.exit(main(sys.argv[1:]))"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                  "--window-size=1400,900", "--virtual-time-budget=20000"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_lab(root: Path) -> LocalLab:
    """A tiny lab with a measured baseline and one finished experiment, all through the CLI."""
    init_lab(root, profile="tiny", data="synthetic")
    r = str(root)
    assert cli.main(["worktree", "shorter-warmdown", "--lab", r]) == 0
    train = root / ".autolab" / "scratch" / "shorter-warmdown" / "bench" / "train.py"
    train.write_text(train.read_text().replace("WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.3"))
    assert cli.main(["new", "shorter-warmdown", "--lab", r, "--campaign", "schedule", "-w",
                     "--hypothesis", "A shorter warmdown keeps the peak LR for longer."]) == 0
    assert cli.main(["apply", "-f", str(root / "experiments" / "drafts" /
                                        "shorter-warmdown.yaml"), "--lab", r]) == 0
    assert cli.main(["run", "--lab", r, "--interval", "0.5"]) == 0
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


def chromium(binary: str, args: list[str], profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lab", help="an existing lab (default: build a tiny one)")
    p.add_argument("--out", default="dashboard.png", help="screenshot path")
    p.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    p.add_argument("--keep", action="store_true", help="keep the lab that was built")
    a = p.parse_args(argv)
    if not shutil.which(a.chromium):
        print(f"error: {a.chromium} not found; apt-get install -y chromium", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="autolab-dashboard-"))
    lab = LocalLab(a.lab) if a.lab else build_lab(work / "lab")
    tracking.sync(lab.root, lab.name)
    expected = sorted({tracking.run_label(r) for r in lab.ledger.rows() if tracking.tracked(r)})
    project = tracking.project_name(lab.name)
    port = free_port()
    url = f"http://127.0.0.1:{port}/?project={project}"
    server = subprocess.Popen([sys.executable, "-c", AUTOLAB, "dashboard", "--lab",
                               str(lab.root), "--no-browser", "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True, cwd=str(REPO))
    summary: dict = {"lab": str(lab.root), "url": url, "expected_runs": expected}
    try:
        wait_for(f"http://127.0.0.1:{port}/", server)
        dom = chromium(a.chromium, ["--dump-dom", url], work / "profile-dom").stdout
        out = Path(a.out).resolve()
        chromium(a.chromium, [f"--screenshot={out}", url], work / "profile-shot")
        import matplotlib.image
        image = matplotlib.image.imread(str(out)) if out.exists() else None
        summary.update(
            screenshot=str(out),
            screenshot_size=list(image.shape[:2]) if image is not None else None,
            project_shown=project in dom,
            runs_shown={r: r in dom for r in expected},
            page_bytes=len(dom),
        )
        ok = (bool(expected) and summary["project_shown"] and all(summary["runs_shown"].values())
              and image is not None and image.shape[0] >= 400 and float(image.std()) > 0.01)
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
