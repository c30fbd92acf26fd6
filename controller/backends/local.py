"""The local backend: the bench run harness as a child process on this machine.

Each run gets a directory `.autolab/runs/<run>/` holding `launch.json` (the
pid and its kernel start time, so a recycled pid is never mistaken for our
run), `log.txt` (the harness's output) and, at the end, `result.json`, which
the harness writes atomically. Runs start in their own session, so a killed
controller leaves them training; a restarted one finds the directory, sees the
process alive (or the result written) and adopts it instead of starting it
again. A run that vanished without a result is reported lost.

Slots are GPUs: one run per visible GPU with `CUDA_VISIBLE_DEVICES` set to
its id, or one CPU slot on a machine without GPUs. `AUTOLAB_GPUS=0,1` names
the ids by hand (tests use it to stand in for GPUs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from controller.backends import RunRequest
from controller.core.reconcile import RunObservation
from controller.labrepo import atomic_write


def visible_slots(configured: int = 0) -> list[str]:
    """Slot ids for this machine: GPU ids, or ["cpu"]."""
    ids: list[str] = []
    env = os.environ.get("AUTOLAB_GPUS")
    if env is not None:
        ids = [x.strip() for x in env.split(",") if x.strip()]
    elif os.environ.get("CUDA_VISIBLE_DEVICES") not in (None, ""):
        ids = [x.strip() for x in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if x.strip()]
    elif shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout
            ids = [x.strip() for x in out.splitlines() if x.strip()]
        except (OSError, subprocess.SubprocessError):
            ids = []
    if not ids:
        ids = ["cpu"]
    if ids == ["cpu"] and configured > 1:
        ids = [f"cpu{i}" for i in range(configured)]
    elif configured > 0:
        ids = ids[:configured]
    return ids


def _start_ticks(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    state = fields[0]
    if state in ("Z", "X"):
        return None
    return fields[19]


class LocalBackend:
    name = "local"

    def __init__(self, lab_root: str | Path, bench_dir: str | Path | None = None,
                 cache_dir: str | None = None):
        self.root = Path(lab_root).resolve()
        self.runs = self.root / ".autolab" / "runs"
        self.bench = Path(bench_dir) if bench_dir else self.root / "bench"
        self.cache_dir = cache_dir

    def run_dir(self, run: str) -> Path:
        return self.runs / run

    def log_path(self, run: str) -> Path:
        return self.run_dir(run) / "log.txt"

    def submit(self, req: RunRequest) -> RunObservation:
        d = self.run_dir(req.run)
        if (d / "launch.json").exists() or (d / "result.json").exists():
            return self.observe(req.run)  # adopt: never start a run twice
        d.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-u", str(self.bench / "run.py"),
               "--candidate", req.candidate_path, "--result", str(d / "result.json"),
               "--source", req.data, "--termination-log", str(d / "termination.json")]
        if req.budget_seconds:
            cmd += ["--budget", str(req.budget_seconds)]
        env = dict(os.environ, AUTOLAB_BENCH_PROFILE=req.profile, PYTHONUNBUFFERED="1")
        cpu = req.slot is None or str(req.slot).startswith("cpu")
        env["CUDA_VISIBLE_DEVICES"] = "" if cpu else str(req.slot)
        env.pop("AUTOLAB_GPUS", None)
        if self.cache_dir:
            env["AUTOLAB_CACHE"] = self.cache_dir
        with open(d / "log.txt", "ab") as log:
            proc = subprocess.Popen(cmd, cwd=str(d), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        atomic_write(d / "launch.json", json.dumps({
            "pid": proc.pid, "start": _start_ticks(proc.pid), "slot": req.slot,
            "experiment": req.experiment, "startedAt": time.time(), "cmd": cmd}) + "\n")
        return RunObservation(req.run, "running", job_id=str(proc.pid),
                              worker=f"local:{os.uname().nodename}:{req.slot}")

    def observe(self, run: str) -> RunObservation:
        d = self.run_dir(run)
        launch = {}
        if (d / "launch.json").exists():
            launch = json.loads((d / "launch.json").read_text())
        worker = f"local:{os.uname().nodename}:{launch.get('slot')}"
        job_id = str(launch.get("pid", ""))
        if (d / "result.json").exists():
            result = json.loads((d / "result.json").read_text())
            state = {"succeeded": "succeeded", "failed": "failed", "error": "error",
                     "cancelled": "cancelled"}.get(result.get("status"), "failed")
            self._reap(launch)
            return RunObservation(run, state, result=result, message=result.get("reason", ""),
                                  job_id=job_id, worker=worker)
        if not launch:
            return RunObservation(run, "missing")
        if launch.get("start") and _start_ticks(launch["pid"]) == launch["start"]:
            return RunObservation(run, "running", job_id=job_id, worker=worker)
        # The process may have written its result just now: look once more.
        if (d / "result.json").exists():
            return self.observe(run)
        return RunObservation(run, "lost", message="the run process exited without writing a "
                                                   f"result; see {d / 'log.txt'}",
                              job_id=job_id, worker=worker)

    def _reap(self, launch: dict) -> None:
        pid = launch.get("pid")
        if pid:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def cancel(self, run: str) -> RunObservation:
        d = self.run_dir(run)
        obs = self.observe(run)
        if obs.state != "running":
            return obs
        launch = json.loads((d / "launch.json").read_text())
        pid = launch["pid"]
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.time() + wait
            while time.time() < deadline and _start_ticks(pid) == launch["start"]:
                self._reap(launch)
                time.sleep(0.05)
            if _start_ticks(pid) != launch["start"]:
                break
        if not (d / "result.json").exists():
            atomic_write(d / "result.json", json.dumps(
                {"version": 1, "status": "cancelled", "reason": "cancelled by the user",
                 "exit_code": None}) + "\n")
        return self.observe(run)

    def slot_of(self, run: str) -> str | None:
        p = self.run_dir(run) / "launch.json"
        return json.loads(p.read_text()).get("slot") if p.exists() else None
